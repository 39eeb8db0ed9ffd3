"""What the tests of iop-node's pure mapping share: the recorded dialect streams
(tests/integration/upstream_fixtures) and replaying a body through the decoder and
the mapper, as the server does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.chunks import ChunkMapper
from edge.nodes.upstream.sse import SSEDecoder, SSEMessage

FIXTURES = Path(__file__).parent.parent / "integration" / "upstream_fixtures"
STREAMS = (
    "vllm", "llamacpp", "ollama", "sglang", "stream-error", "truncated",
    "vllm-logprobs", "llamacpp-logprobs", "llamacpp-cached",
)  # fmt: skip
TERMINAL = {"complete", "error", "cancelled"}

Event = tuple[str, str, str, dict[str, str], tuple[int, int, int, int] | None]


def event_view(ev: Any) -> Event:
    usage = ev.usage
    counts = None
    if usage is not None:
        counts = (
            usage.input_tokens,
            usage.output_tokens,
            usage.reasoning_tokens,
            usage.cached_input_tokens,
        )
    view = dict(ev.metadata)
    assert "tool_calls" not in view, "native calls travel in the typed field only"
    if ev.tool_calls:  # compared in OpenAI's shape, as the edge renders them
        view["tool_calls"] = json.dumps(openai_calls(ev.tool_calls))
    return (ev.type, ev.delta, ev.error, view, counts)


def openai_calls(typed: list[pb.ToolCall]) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": c.type, "function": {"name": c.name, "arguments": c.arguments}}
        for c in typed
    ]


def replay(pieces: list[str]) -> list[Event]:
    """The events of a body that arrives in `pieces`, as the server maps them."""
    decoder = SSEDecoder()
    mapper = ChunkMapper(id_prefix="run1")
    out: list[Any] = []
    for piece in pieces:
        for message in decoder.feed(piece):
            out.extend(mapper.feed(message))
    for message in decoder.close():
        out.extend(mapper.feed(message))
    out.extend(mapper.end())
    return [event_view(e) for e in out]


def body(name: str) -> str:
    return (FIXTURES / f"{name}.sse").read_text()


def calls(event: Event) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = json.loads(event[3]["tool_calls"])
    return result


def chunk(delta: dict[str, Any]) -> SSEMessage:
    """One chunk whose first choice carries `delta`."""
    return SSEMessage(json.dumps({"choices": [{"index": 0, "delta": delta}]}))
