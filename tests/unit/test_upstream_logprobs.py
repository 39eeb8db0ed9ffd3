"""Tests of iop-node's logprobs (`edge.nodes.upstream.logprobs`): an upstream's token
logprobs on the content deltas, typed and bounded, cut under gRPC's message limit."""

from __future__ import annotations

import json
from typing import Any

import pytest

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.chunks import ChunkMapper
from edge.nodes.upstream.sse import SSEDecoder, SSEMessage
from tests.unit.upstream_replay import body


def _lp_events(name: str) -> list[pb.RunEvent]:
    decoder = SSEDecoder()
    mapper = ChunkMapper(id_prefix="r1")
    out: list[pb.RunEvent] = []
    for message in [*decoder.feed(body(name)), *decoder.close()]:
        out.extend(mapper.feed(message))
    return out + mapper.end()


def _tokens(events: list[pb.RunEvent]) -> list[tuple[str, float, bytes | None, list[str]]]:
    return [
        (t.token, t.logprob, t.bytes, [a.token for a in t.top_logprobs])
        for e in events
        for t in e.logprobs
    ]


@pytest.mark.parametrize("name", ["vllm-logprobs", "llamacpp-logprobs"])
def test_logprobs_go_on_the_content_deltas(name: str) -> None:
    """Each server's `logprobs.content` arrives on the content delta of its chunk, typed,
    with bytes and alternatives (extra fields such as llama.cpp's `id` ignored); logprobs
    of a reasoning chunk are dropped, as OpenAI gives none for reasoning."""
    events = _lp_events(name)
    assert all(not e.logprobs for e in events if e.type != "delta")
    expected = {
        "vllm-logprobs": [
            ("Hello", -0.0123, b"Hello", ["Hello", "Hi"]),
            (" there", -0.25, b" there", [" there", " world"]),
            ("!", -9999.0, b"!", ["!", "."]),
        ],
        "llamacpp-logprobs": [("Hel", -0.1, b"Hel", ["Hel"]), ("lo", -0.3, b"lo", ["lo"])],
    }
    assert _tokens(events) == expected[name]
    assert events[-1].type == "complete"


def test_logprobs_of_a_chunk_without_content_wait_for_the_next_content() -> None:
    """A chunk carrying only logprobs (a server that held the text back) hands them to the
    next content delta; malformed entries are skipped; alternatives past 20 are not kept."""
    mapper = ChunkMapper(id_prefix="r1")
    tops = [{"token": str(i), "logprob": -i} for i in range(25)]

    def chunk(delta: dict[str, Any], content: list[Any]) -> SSEMessage:
        choice = {"index": 0, "delta": delta, "logprobs": {"content": content}}
        return SSEMessage(json.dumps({"choices": [choice]}))

    events = mapper.feed(chunk({}, [{"token": "a", "logprob": -1, "top_logprobs": tops}, 7]))
    events += mapper.feed(chunk({"content": "ab"}, [{"token": "b", "logprob": None}]))
    assert [e.type for e in events] == ["delta"]
    assert [(t.token, t.logprob, t.bytes) for t in events[0].logprobs] == [
        ("a", -1.0, None),
        ("b", -9999.0, None),
    ]
    assert len(events[0].logprobs[0].top_logprobs) == 20


def test_large_logprobs_are_cut_into_several_events_at_token_ends() -> None:
    """A non-streamed answer's logprobs are cut into delta events that each stay far under
    gRPC's message limit, at token ends, together the same text and tokens."""
    tops = [{"token": "x" * 8, "logprob": -1.0} for _ in range(20)]
    content = [{"token": "word ", "logprob": -0.5, "top_logprobs": tops} for _ in range(5000)]
    mapper = ChunkMapper(id_prefix="r1")
    completion = {
        "choices": [
            {
                "index": 0,
                "message": {"content": "word " * 5000},
                "logprobs": {"content": content},
                "finish_reason": "stop",
            }
        ]
    }
    events = [e for e in mapper.feed_completion(completion) if e.type == "delta"]
    assert len(events) > 1
    assert "".join(e.delta for e in events) == "word " * 5000
    assert sum(len(e.logprobs) for e in events) == 5000
    assert all(len(e.delta) == 5 * len(e.logprobs) for e in events)
    assert all(len(bytes(e)) < 2 * 1024 * 1024 for e in events)
