"""Tests of iop-node's tool-call assembly (`edge.nodes.upstream.toolcalls`): fragments
in each dialect's shape folded into whole calls, and what one run may hold of them."""

from __future__ import annotations

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.chunks import ChunkMapper
from edge.nodes.upstream.sse import SSEMessage
from edge.nodes.upstream.toolcalls import MAX_TOOL_CALL_CHARS, MAX_TOOL_CALLS, ToolCallAssembler
from tests.unit.upstream_replay import chunk, openai_calls

# --- tool-call assembly --------------------------------------------------------------


def test_tool_calls_sharing_an_index_but_not_an_id_are_separate() -> None:
    """Ollama has sent parallel calls all with index 0: distinct ids keep them apart."""
    tools = ToolCallAssembler()
    tools.feed(
        [
            {"id": "a", "index": 0, "function": {"name": "f", "arguments": '{"x":1}'}},
            {"id": "b", "index": 0, "function": {"name": "g", "arguments": {"y": 2}}},
        ]
    )
    out = tools.typed("run")
    assert [(c.id, c.name, c.arguments) for c in out] == [
        ("a", "f", '{"x":1}'),
        ("b", "g", '{"y":2}'),
    ]


def test_tool_fragments_without_index_or_id() -> None:
    """No index: a named fragment starts a call, an anonymous one extends the last;
    missing ids are generated and empty arguments become {}."""
    tools = ToolCallAssembler()
    tools.feed({"function": {"name": "f", "arguments": '{"q": '}})
    tools.feed([{"function": {"arguments": '"x"}'}}])
    tools.feed([{"function": {"name": "g"}}])
    tools.feed([{"index": 5}, "junk"])  # nameless call: dropped
    out = openai_calls(tools.typed("run"))
    assert out == [
        {
            "id": "call_run_0",
            "type": "function",
            "function": {"name": "f", "arguments": '{"q": "x"}'},
        },
        {"id": "call_run_1", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]


# --- bounded reading: what one run may hold of an upstream's answer ---------------------


def test_endless_tool_call_arguments_end_in_an_error_naming_the_limit() -> None:
    """Tool-call argument fragments are held up to MAX_TOOL_CALL_CHARS: past it the run's
    terminal is an error event naming the limit, and later chunks are ignored."""
    mapper = ChunkMapper(id_prefix="r1")
    fragment = {"index": 0, "function": {"name": "f", "arguments": "a" * 65536}}
    events: list[pb.RunEvent] = []
    for _ in range(MAX_TOOL_CALL_CHARS // 65536 + 2):
        events += mapper.feed(chunk({"tool_calls": [fragment]}))
    events += mapper.feed(SSEMessage("[DONE]"))
    assert [e.type for e in events] == ["error"]
    assert str(MAX_TOOL_CALL_CHARS) in events[0].error


def test_too_many_tool_calls_end_in_an_error() -> None:
    """Each new index starts a call: past MAX_TOOL_CALLS calls the run ends in an error."""
    mapper = ChunkMapper(id_prefix="r1")
    events: list[pb.RunEvent] = []
    for i in range(MAX_TOOL_CALLS + 1):
        events += mapper.feed(chunk({"tool_calls": [{"index": i, "function": {"name": "f"}}]}))
    assert [e.type for e in events] == ["error"]
    assert str(MAX_TOOL_CALLS) in events[0].error
