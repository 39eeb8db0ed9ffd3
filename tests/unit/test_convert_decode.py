"""The hand decoder of delta RunEvents agrees with betterproto2 on every input."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from edge.contract._proto.iop.node import v1 as pb
from edge.node.convert import (
    MAX_FAILURE_CHARS,
    REASON_CHARS,
    SKIP,
    Refused,
    RunEventDecoder,
    decode_run_event,
    event_from_pb,
)
from edge.stream.events import Complete, Delta, Failed, ReasoningDelta

_TYPES = st.sampled_from(["delta", "reasoning_delta", "complete", "error", "cancelled", "x", ""])


_CALLS = st.lists(
    st.builds(
        pb.ToolCall,
        id=st.text(max_size=3),
        type=st.sampled_from(["", "function", "custom"]),
        name=st.text(max_size=3),
        arguments=st.text(),
    ),
    max_size=2,
)


_LOGPROBS = st.lists(
    st.builds(
        pb.TokenLogprob,
        token=st.text(max_size=3),
        logprob=st.floats(allow_nan=False),
        bytes=st.none() | st.binary(max_size=3),
        top_logprobs=st.lists(
            st.builds(
                pb.TopLogprob,
                token=st.text(max_size=3),
                logprob=st.floats(allow_nan=False),
                bytes=st.none() | st.binary(max_size=3),
            ),
            max_size=3,
        ),
    ),
    max_size=3,
)


@given(
    kind=_TYPES,
    delta=st.text(),
    error=st.text(max_size=5),
    metadata=st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
    tool_calls=_CALLS,
    logprobs=_LOGPROBS,
)
def test_hand_and_general_paths_agree(
    kind: str,
    delta: str,
    error: str,
    metadata: dict[str, str],
    tool_calls: list[pb.ToolCall],
    logprobs: list[pb.TokenLogprob],
) -> None:
    """For any RunEvent, decoding its bytes gives what betterproto2 + event_from_pb give
    (a delta with logprobs included: the hand path must not take it)."""
    event = pb.RunEvent(
        type=kind,
        delta=delta,
        error=error,
        metadata=metadata,
        tool_calls=tool_calls,
        logprobs=logprobs,
    )
    data = bytes(event)
    assert decode_run_event(data) == event_from_pb(pb.RunEvent.FromString(data))


@given(delta=st.text(), logprobs=_LOGPROBS.filter(bool))
def test_delta_logprobs_reach_the_core_as_sent(delta: str, logprobs: list[pb.TokenLogprob]) -> None:
    """A delta's token logprobs arrive in order with every field (unset bytes: None)."""
    event = decode_run_event(bytes(pb.RunEvent(type="delta", delta=delta, logprobs=logprobs)))
    assert isinstance(event, Delta)
    assert event.text == delta
    assert [(t.token, t.logprob, t.token_bytes) for t in event.logprobs] == [
        (t.token, t.logprob, t.bytes) for t in logprobs
    ]
    assert [[(a.token, a.logprob, a.token_bytes) for a in t.top] for t in event.logprobs] == [
        [(a.token, a.logprob, a.bytes) for a in t.top_logprobs] for t in logprobs
    ]


def test_top_logprobs_past_twenty_are_not_kept() -> None:
    """A node sending more than 20 alternatives a token gets its first 20 kept (OpenAI's cap)."""
    tops = [pb.TopLogprob(token=str(i), logprob=-i) for i in range(30)]
    data = bytes(
        pb.RunEvent(
            type="delta",
            delta="x",
            logprobs=[pb.TokenLogprob(token="x", logprob=0.0, top_logprobs=tops)],
        )
    )
    event = decode_run_event(data)
    assert isinstance(event, Delta)
    assert [a.token for a in event.logprobs[0].top] == [str(i) for i in range(20)]


@given(_CALLS)
def test_typed_tool_calls_reach_the_core_as_sent(tool_calls: list[pb.ToolCall]) -> None:
    """A complete event's typed calls arrive in order, each field as the node wrote it
    (a call without a type is a function call)."""
    data = bytes(pb.RunEvent(type="complete", tool_calls=tool_calls))
    event = decode_run_event(data)
    assert isinstance(event, Complete)
    assert [(c.id, c.name, c.arguments, c.type) for c in event.tool_calls] == [
        (c.id, c.name, c.arguments, c.type or "function") for c in tool_calls
    ]


@given(st.binary(max_size=64))
def test_garbage_after_a_delta_prefix_is_not_misread(tail: bytes) -> None:
    """Bytes that merely start like a delta decode as betterproto2 would, or fail as it does."""
    data = b"\x0a\x05delta\x12" + tail

    def outcome(decode: Callable[[bytes], object]) -> tuple[str, object]:
        try:
            return "ok", decode(data)
        except Exception as exc:
            return "error", type(exc)

    general = outcome(lambda d: event_from_pb(pb.RunEvent.FromString(d)))
    hand = outcome(decode_run_event)
    assert hand[0] == general[0]
    if general[0] == "ok":
        assert hand == general


def test_long_deltas_use_multi_byte_lengths() -> None:
    """Deltas longer than 127 bytes (a varint of two bytes or more) decode by hand too."""
    for size in (127, 128, 300, 70_000):
        text = "é" * size
        data = bytes(pb.RunEvent(type="reasoning_delta", delta=text))
        assert decode_run_event(data) == ReasoningDelta(text)


def test_unknown_types_are_skipped_not_the_end() -> None:
    """grpclib reads None as the end of a stream: an unknown type decodes to SKIP."""
    assert RunEventDecoder.FromString(bytes(pb.RunEvent(type="progress"))) is SKIP
    assert RunEventDecoder.FromString(bytes(pb.RunEvent(type="delta", delta="x"))) == Delta("x")


def test_bytes_that_are_no_run_event_are_refused_not_raised() -> None:
    """A message that does not decode is the node's failure: the decoder answers `Refused`
    with a short reason (the read loop raises NodeFailedError, the fail-stream path), never
    raises while it holds the bytes, and the reason quotes none of them."""
    refused = RunEventDecoder.FromString(b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")
    assert isinstance(refused, Refused)
    assert "not a RunEvent" in refused.reason
    garbage = b"\x0a\x05delta\x12\x80\x80\x04" + b"\xff" * 65536  # a delta that is no UTF-8
    refused = RunEventDecoder.FromString(garbage)
    assert isinstance(refused, Refused)
    assert len(refused.reason) < REASON_CHARS + 100


@given(
    st.integers(min_value=0, max_value=2**32 - 1), st.text(max_size=3000), st.text(max_size=3000)
)
def test_an_error_event_is_bounded_and_its_status_an_http_one(
    status: int, error: str, message: str
) -> None:
    """A node's error event reaches the core with its error and message cut (never added
    to) at MAX_FAILURE_CHARS, and its http_status kept only when it is an HTTP status
    (100-599; else 0, a node failure)."""
    event = decode_run_event(
        bytes(pb.RunEvent(type="error", error=error, message=message, http_status=status))
    )
    assert event == Failed(
        "error",
        error[:MAX_FAILURE_CHARS],
        message[:MAX_FAILURE_CHARS],
        http_status=status if 100 <= status <= 599 else 0,
    )
