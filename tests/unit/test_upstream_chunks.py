"""Tests of iop-node's chunk mapping (`edge.nodes.upstream.chunks`): SSE chunks -> RunEvents.

The recorded dialect streams (tests/integration/upstream_fixtures) are fed
whole, character by character and split at random points: every split gives
the same events, and every stream ends in exactly one terminal event.
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.chunks import ChunkMapper, coalesced
from edge.nodes.upstream.logprobs import MAX_DELTA_CHARS
from edge.nodes.upstream.relay import Relay
from edge.nodes.upstream.sse import SSEDecoder, SSEMessage
from tests.unit.upstream_replay import STREAMS, TERMINAL, body, calls, chunk, event_view, replay

# --- the dialects ------------------------------------------------------------------


def test_vllm_reasoning_fragmented_tool_calls_and_usagechunk() -> None:
    """vLLM: reasoning_content deltas, two calls streamed by index, usage in its own chunk."""
    events = replay([body("vllm")])
    assert [e[:2] for e in events[:-1]] == [
        ("reasoning_delta", "The user wants the weather"),
        ("reasoning_delta", " in Paris and Tokyo."),
    ]
    kind, _, _, metadata, usage = events[-1]
    assert kind == "complete"
    assert metadata["finish_reason"] == "tool_calls"
    assert calls(events[-1]) == [
        {
            "id": "chatcmpl-tool-7c1e2a9b",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {
            "id": "chatcmpl-tool-3f8d6b10",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
        },
    ]
    assert usage == (181, 55, 0, 160)


def test_llamacpp_null_first_delta_timings_and_usage_on_finishchunk() -> None:
    """llama.cpp: `content: null` first, extra fields ignored, cache_n counted as cached input."""
    events = replay([body("llamacpp")])
    assert [e[:2] for e in events[:-1]] == [
        ("reasoning_delta", "A greeting."),
        ("reasoning_delta", " Answer briefly."),
        ("delta", "Hello"),
        ("delta", "!"),
        ("delta", " How can I help?"),
    ]
    assert events[-1] == ("complete", "", "", {"finish_reason": "stop"}, (24, 12, 0, 16))


def test_llamacpp_current_usage_chunk_counts_cached_prompt_tokens() -> None:
    """A current llama.cpp: usage in its own last chunk, its cached prompt tokens in
    `prompt_tokens_details.cached_tokens` (the `timings.cache_n` beside it says the same).
    Its native `/completion` field `tokens_cached` is not in a chat completion (and counts
    the whole context after the run, output included): nothing else is read."""
    events = replay([body("llamacpp-cached")])
    assert [e[:2] for e in events[:-1]] == [("delta", "Paris"), ("delta", ".")]
    assert events[-1] == ("complete", "", "", {"finish_reason": "stop"}, (6150, 3, 0, 6144))


def test_ollama_whole_tool_call_without_index_and_no_usage() -> None:
    """Ollama: `reasoning`, one chunk with the whole call, finish "stop", no usage chunk."""
    events = replay([body("ollama")])
    assert events[0][:2] == ("reasoning_delta", "I should call the weather tool.")
    kind, _, _, metadata, usage = events[-1]
    assert (kind, usage, len(events)) == ("complete", None, 2)
    assert metadata["finish_reason"] == "tool_calls"
    assert calls(events[-1]) == [
        {
            "id": "call_k3v9x2mq",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        }
    ]


def test_sglang_nulls_and_flat_reasoning_tokens() -> None:
    """SGLang: null fields and null ids on later fragments; reasoning_tokens outside details."""
    events = replay([body("sglang")])
    assert [e[:2] for e in events[:-1]] == [
        ("reasoning_delta", "Celsius is expected."),
        ("delta", "Checking "),
        ("delta", "Paris."),
    ]
    assert events[-1][4] == (210, 52, 9, 0)
    (call,) = calls(events[-1])
    assert call["id"] == "call_0b7d1c2e"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}


def test_error_object_inside_the_stream_is_the_terminal() -> None:
    """An error chunk mid-stream ends the run with its message; the [DONE] after it is ignored."""
    events = replay([body("stream-error")])
    assert events == [
        ("delta", "Partial", "", {}, None),
        ("error", "", "upstream error: The engine died unexpectedly. (code 500)", {}, None),
    ]


def test_stream_without_done_or_finish_reason_is_an_error() -> None:
    """A body that just stops is not a completion."""
    events = replay([body("truncated")])
    assert [e[1] for e in events[:2]] == ["Once upon", " a time"]
    assert events[-1][0] == "error"
    assert "ended early" in events[-1][2]


def test_finish_reason_without_done_is_complete() -> None:
    """A server that sends finish_reason but forgets [DONE] still completes."""
    text = body("llamacpp").replace("data: [DONE]\n\n", "")
    assert replay([text])[-1][:4] == ("complete", "", "", {"finish_reason": "stop"})


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"stop_reason": "END"}, "END"),  # vLLM
        ({"stop_reason": None, "matched_stop": "END"}, "END"),  # SGLang
        ({"stop_reason": 128009}, None),  # a stop token's id: no stop string
        ({"matched_stop": "x" * 1025}, None),  # longer than any stop the edge sends
        ({}, None),
    ],
)
def test_matched_stop_string_is_the_stop_sequence(
    fields: dict[str, object], named: str | None
) -> None:
    """The stop string a server says matched is the complete metadata's `stop_sequence`."""
    mapper = ChunkMapper("call")
    finish = {"index": 0, "delta": {"content": "up to the"}, "finish_reason": "stop", **fields}
    mapper.feed(SSEMessage(json.dumps({"choices": [finish]})))
    (complete,) = mapper.feed(SSEMessage("[DONE]"))
    assert complete.metadata.get("stop_sequence") == named
    assert complete.metadata["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("native", "named"),
    [
        ({"stop_type": "word", "stopping_word": "END"}, "END"),
        ({"stop_type": "eos", "stopping_word": ""}, None),  # the end-of-turn token
        ({"stop_type": "limit", "stopping_word": ""}, None),
        ({"stop_type": "word", "stopping_word": "x" * 1025}, None),
        ("not an object", None),
    ],
)
def test_llamacpp_names_its_stop_in_its_own_fields(native: object, named: str | None) -> None:
    """llama.cpp asked for its own fields (`LLAMACPP_STOP`) puts them on its last chunk
    as `__verbose`: the stop word it matched is the `stop_sequence` (none for the end of
    turn or the token limit)."""
    mapper = ChunkMapper("call")
    finish = {"index": 0, "delta": {}, "finish_reason": "stop"}
    mapper.feed(SSEMessage(json.dumps({"choices": [finish], "__verbose": native})))
    (complete,) = mapper.feed(SSEMessage("[DONE]"))
    assert complete.metadata.get("stop_sequence") == named


def test_llamacpp_is_asked_for_its_stop_only_with_stop_sequences() -> None:
    """The relay asks llama.cpp for its stop fields when the run has stop sequences, and
    nothing of any other server (an unknown field may be an error there)."""
    request = pb.RunRequest(
        run_id="r", model="m", messages=[pb.Message(role="user", content="hi")], stop=["END"]
    )
    llama = Relay("http://x/v1", name="n", continuation_mode=lambda m: "none",
                  llamacpp=lambda m: True)  # fmt: skip
    other = Relay("http://x/v1", name="n", continuation_mode=lambda m: "none")
    asked = json.loads(llama.body(request))
    assert (asked["verbose"], asked["response_fields"]) == (True, ["stop_type", "stopping_word"])
    assert "verbose" not in json.loads(other.body(request))
    request.stop = []
    assert "verbose" not in json.loads(llama.body(request))


@pytest.mark.parametrize("name", STREAMS)
def test_exactly_one_terminal_last(name: str) -> None:
    """Every stream maps to events with exactly one terminal, and it is the last."""
    events = replay([body(name)])
    assert [e[0] in TERMINAL for e in events].count(True) == 1
    assert events[-1][0] in TERMINAL


@pytest.mark.parametrize("name", STREAMS)
def test_char_by_char_and_crlf_equal_whole(name: str) -> None:
    """Split into single characters, or with CRLF line breaks: the same events."""
    whole = replay([body(name)])
    assert replay(list(body(name))) == whole
    crlf = body(name).replace("\n", "\r\n")
    assert replay(list(crlf)) == whole
    assert replay([crlf]) == whole


@given(
    name=st.sampled_from(STREAMS),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
    crlf=st.booleans(),
)
def test_split_invariance(name: str, cuts: list[int], crlf: bool) -> None:
    """Any split of the body (CR and LF halves included) gives the events of the whole."""
    text = body(name).replace("\n", "\r\n") if crlf else body(name)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert replay(pieces) == replay([text])


# --- SSE framing ---------------------------------------------------------------------


def test_sse_comments_events_multiline_data_and_missing_blank_lines() -> None:
    """Comments are skipped, `event:` names the next event, data lines join, EOF flushes."""
    decoder = SSEDecoder()
    messages = decoder.feed(
        ": keep-alive\n\n"
        'data: {"a":1}\n'  # no blank line: dispatched at once
        'data: {"b":2}\n\n'
        "event: error\ndata: boom\n\n"
        "data: line one\ndata: line two\n\n"
        "data:[DONE]"
    )
    messages += decoder.close()
    assert messages == [
        SSEMessage('{"a":1}'),
        SSEMessage('{"b":2}'),
        SSEMessage("boom", "error"),
        SSEMessage("line one\nline two"),
        SSEMessage("[DONE]"),
    ]


@given(
    name=st.sampled_from(STREAMS),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
)
def test_pending_chars_bound_what_the_next_feed_parses(name: str, cuts: list[int]) -> None:
    """For any split, an event a feed dispatches is no longer than the characters held
    before it (`pending_chars`) and the text it was given: the bound the relay puts a
    feed in a worker thread by. None held once the body's events are out."""
    text = body(name)
    points = sorted({min(c, len(text)) for c in cuts})
    decoder = SSEDecoder()
    for a, b in zip([0, *points], [*points, len(text)], strict=True):
        held = decoder.pending_chars
        for message in decoder.feed(text[a:b]):
            assert len(message.data) <= held + (b - a)
    decoder.close()
    assert decoder.pending_chars == 0


def test_pending_chars_count_data_lines_and_a_line_in_pieces() -> None:
    """A data line waiting for its blank line, and a line still without its break (in
    any pieces), count as pending until their event is dispatched."""
    decoder = SSEDecoder()
    assert decoder.feed("data: line one\n") == []
    assert decoder.pending_chars == len("line one")
    assert decoder.feed('data: {"a"') == []
    assert decoder.feed(":1") == []
    assert decoder.pending_chars == len("line one") + len('data: {"a":1')
    assert decoder.feed("}\n\n") == [SSEMessage('line one\n{"a":1}')]
    assert decoder.pending_chars == 0


def test_event_error_with_plain_text_data() -> None:
    """`event: error` with text data (not JSON) is an error terminal quoting it."""
    mapper = ChunkMapper("r")
    (event,) = mapper.feed(SSEMessage("overloaded", "error"))
    assert (event.type, event.error) == ("error", "upstream error: overloaded")
    assert mapper.feed(SSEMessage("[DONE]")) == []
    assert mapper.end() == []


def test_malformed_chunk_is_an_error() -> None:
    """A data payload that is not JSON ends the run with a clear error."""
    (event,) = ChunkMapper("r").feed(SSEMessage("{not json"))
    assert event.type == "error"
    assert "malformed" in event.error


# --- whole completions ------------------------------------------------------------


def test_non_streaming_completion_is_mapped() -> None:
    """A server that ignored `stream: true` answers one chat.completion: same events."""
    payload = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hi",
                    "reasoning_content": "think",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    events = [event_view(e) for e in ChunkMapper("r").feed_completion(payload)]
    assert [e[:2] for e in events[:2]] == [("reasoning_delta", "think"), ("delta", "Hi")]
    assert events[-1][0] == "complete"
    assert events[-1][3]["finish_reason"] == "tool_calls"
    assert events[-1][4] == (3, 2, 0, 0)


# --- bounded reading: what one run may hold of an upstream's answer ---------------------


def test_long_text_is_split_into_deltas_under_the_message_limit() -> None:
    """A long content or reasoning text becomes several deltas of at most MAX_DELTA_CHARS
    characters (each RunEvent stays under gRPC's 4 MiB), together the same text."""
    text = "é" * (2 * MAX_DELTA_CHARS + 7)
    mapper = ChunkMapper(id_prefix="r1")
    events = mapper.feed(chunk({"content": text, "reasoning_content": text}))
    for kind in ("delta", "reasoning_delta"):
        pieces = [e.delta for e in events if e.type == kind]
        assert len(pieces) == 3
        assert "".join(pieces) == text
        assert all(len(bytes(pb.RunEvent(type=kind, delta=p))) < 4 * 1024 * 1024 for p in pieces)


# --- coalesced: the deltas of one read as one event ------------------------------------

_KINDS = ("delta", "reasoning_delta")


def _joinable_event(kind: str, text: str) -> pb.RunEvent:
    return pb.RunEvent(type=kind, delta=text)


_EVENTS = st.lists(
    st.one_of(
        st.builds(_joinable_event, st.sampled_from(_KINDS), st.text(max_size=8)),
        st.builds(
            lambda text: pb.RunEvent(
                type="delta", delta=text, logprobs=[pb.TokenLogprob(token=text, logprob=-0.5)]
            ),
            st.text(min_size=1, max_size=4),
        ),
        st.builds(lambda: pb.RunEvent(type="delta", tool_calls=[pb.ToolCall(id="c", name="f")])),
        st.just(pb.RunEvent(type="complete", usage=pb.Usage(input_tokens=1))),
    ),
    max_size=30,
)


def _runs(events: list[pb.RunEvent]) -> list[tuple[str, str] | pb.RunEvent]:
    """Each run of text-only deltas of one kind as (kind, its text); the rest as they are."""
    out: list[tuple[str, str] | pb.RunEvent] = []
    for event in events:
        plain = event.type in _KINDS and not event.logprobs and not event.tool_calls
        last = out[-1] if out else None
        if plain and isinstance(last, tuple) and last[0] == event.type:
            out[-1] = (event.type, last[1] + event.delta)
        elif plain:
            out.append((event.type, event.delta))
        else:
            out.append(event)
    return out


@given(_EVENTS)
def test_coalesced_joins_each_run_of_text_deltas_and_keeps_everything_else(
    events: list[pb.RunEvent],
) -> None:
    """The same text of each kind in the same order, the other events unchanged in their
    places, and no two text-only deltas of one kind left side by side."""
    joined = coalesced(list(events))
    assert _runs(joined) == _runs(events)
    for one, two in itertools.pairwise(joined):
        both_plain = all(
            e.type in _KINDS and not e.logprobs and not e.tool_calls for e in (one, two)
        )
        assert not (both_plain and one.type == two.type)


def test_coalesced_keeps_each_delta_under_the_message_limit() -> None:
    """A run of text longer than MAX_DELTA_CHARS goes as several deltas, none past it,
    whose text is the run's."""
    piece = "x" * (MAX_DELTA_CHARS // 3 + 1)
    joined = coalesced([pb.RunEvent(type="delta", delta=piece) for _ in range(7)])
    assert 1 < len(joined) < 7
    assert all(len(e.delta) <= MAX_DELTA_CHARS for e in joined)
    assert "".join(e.delta for e in joined) == piece * 7


def test_coalesced_leaves_a_delta_alone_in_its_run_as_it_is() -> None:
    """A delta with no neighbour of its kind goes on as the same event (nothing built
    again on the per-chunk path); only a run of several is joined."""
    alone = pb.RunEvent(type="delta", delta="a")
    thought = pb.RunEvent(type="reasoning_delta", delta="b")
    done = pb.RunEvent(type="complete")
    joined = coalesced([alone, thought, done])
    assert [id(e) for e in joined] == [id(alone), id(thought), id(done)]
