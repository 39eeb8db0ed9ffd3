"""A long delta is applied a slice a step (`StreamSession.resume`), with the whole delta's output.

A node may send megabytes in one event; the session applies at most
`slice_chars` characters of it per step, so the run's reader can let other work
run between steps. These tests hold the sliced session to the whole one: the
same content, reasoning, tool calls, logprobs, terminal and outcome, for the
adversarial alphabets that make the filters hold text back (`<`, `<|`, `{`,
`[`, `<think>`, tool-call tags), under every filter the session composes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.stream.events import Complete, Delta, LogprobDelta, NodeEvent, ReasoningDelta, Usage
from edge.stream.logprobs import TokenLogprob
from edge.stream.output import LogprobContentOut, OutEvent
from edge.stream.session import SLICE_CHARS, SessionSettings, StreamSession
from tests.unit.test_session import (
    JSON_SCHEMA,
    TOOLS,
    Result,
    caller_view,
    conf,
    cut,
    metadata,
    session_settings,
    texts,
)

WHOLE = 1 << 40  # a slice no delta reaches: the whole delta in one step
BIG = 3_800_000


def stepped(events: Iterable[NodeEvent], cfg: SessionSettings) -> tuple[Result, int]:
    """Feed `events` as the run's reader does: after a feed that says stop, `resume` once a
    step while the session is resuming, draining after every step. Returns the result and
    the number of steps."""
    session = StreamSession(cfg)
    out: list[OutEvent] = session.drain()
    steps = 0
    for event in events:
        stop = session.feed(event)
        steps += 1
        out += session.drain()
        assert stop == (session.terminated or session.resuming)
        while session.resuming:
            session.resume()
            steps += 1
            out += session.drain()
    return Result(out, session.outcome), steps


def logprobs_of(result: Result) -> list[TokenLogprob]:
    return [t for e in result.out if isinstance(e, LogprobContentOut) for t in e.logprobs]


def view(result: Result) -> tuple[Any, ...]:
    return (*caller_view(result), logprobs_of(result))


SETTINGS = {
    "plain": conf(),
    "think": conf(reasoning_parser="think"),
    "tools": conf(tools=TOOLS),
    "tools+think+whole": conf(tools=TOOLS, reasoning_parser="think", whole_output=True),
    "logprobs+tools": conf(tools=TOOLS, logprobs=True),
    "strict+buffer": conf(strict=True, stream_buffer=True, response_format=JSON_SCHEMA),
}
ALPHABETS = ["<", "<|", "{", "[", "<think>", "</s", "<tool_call>{", '{"name": "get_time", "a']


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("alphabet", ALPHABETS)
def test_one_big_delta_fed_in_slices_is_the_whole_delta(name: str, alphabet: str) -> None:
    """One 3.8 MB delta of an adversarial alphabet: fed in SLICE_CHARS slices it takes one
    step per slice, each step's output is no more than a slice (and what a filter held),
    and what the caller sees is what the whole delta in one step gives."""
    size = BIG if alphabet == "<" else BIG // 8
    text = (alphabet * (size // len(alphabet) + 1))[:size]
    events = [Delta(text), Complete(Usage(1, 2), {"finish_reason": "stop"})]
    cfg = SETTINGS[name]
    whole, _ = stepped(events, replace(cfg, slice_chars=WHOLE))
    sliced, steps = stepped(events, cfg)
    assert whole.terminal is not None
    assert view(sliced) == view(whole)
    assert steps == -(-size // SLICE_CHARS) + 1  # the slices, then the terminal


def test_a_slice_step_applies_at_most_a_slice() -> None:
    """Streaming, the output of each step is at most one slice (plus the few characters the
    sentinel filter held from the step before): no step handles the whole delta."""
    session = StreamSession(conf())
    text = "<|" * (BIG // 2)
    assert session.feed(Delta(text)) is True
    assert not session.terminated
    sizes = [sum(len(getattr(e, "text", "")) for e in session.drain())]
    while session.resuming:
        session.resume()
        sizes.append(sum(len(getattr(e, "text", "")) for e in session.drain()))
    assert max(sizes) <= SLICE_CHARS + 16
    assert len(sizes) == -(-len(text) // SLICE_CHARS)
    assert session.feed(Complete()) is True
    assert sum(sizes) + sum(len(getattr(e, "text", "")) for e in session.drain()) == len(text)


def test_feeding_while_resuming_applies_the_rest_first() -> None:
    """A caller that feeds the next event without resuming loses nothing and reorders
    nothing: the rest of the long delta is applied first."""
    session = StreamSession(conf(slice_chars=10))
    assert session.feed(Delta("a" * 35)) is True
    assert session.feed(Delta("b")) is False
    assert session.feed(Complete()) is True
    text = "".join(getattr(e, "text", "") for e in session.drain())
    assert text == "a" * 35 + "b"


def test_a_terminal_while_resuming_drops_the_rest() -> None:
    """Cancelled (the caller left, a deadline) while slices remain: the session is over,
    nothing more is applied, `resume` is a no-op."""
    session = StreamSession(conf(slice_chars=10))
    session.feed(Delta("a" * 35))
    assert [getattr(e, "text", "") for e in session.drain()] == ["", "a" * 10]  # role, slice
    session.cancel("cancelled")
    assert not session.resuming
    assert session.resume() is True
    assert session.feed(Delta("b")) is True
    assert not [e for e in session.drain() if getattr(e, "text", "")]


def _logprob_events(text: str, cuts: Sequence[int]) -> list[NodeEvent]:
    """`text` as one LogprobDelta whose tokens are its pieces at `cuts`."""
    tokens = tuple(TokenLogprob(piece, -0.5) for piece in cut(text, cuts) if piece)
    return [LogprobDelta(text, tokens)]


@given(
    cfg=session_settings(),
    reasoning=texts,
    text=texts,
    token_cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=30),
    slice_chars=st.integers(min_value=1, max_value=40),
    meta=metadata,
)
def test_property_slices_give_the_whole_output(
    cfg: SessionSettings,
    reasoning: str,
    text: str,
    token_cuts: list[int],
    slice_chars: int,
    meta: dict[str, str],
) -> None:
    """For any settings, any slice size and any deltas (reasoning, content, content with
    logprobs), applying each delta a slice a step gives what applying it whole gives:
    content, reasoning, tool calls, logprobs, terminal and outcome."""
    events: list[NodeEvent] = [
        ReasoningDelta(reasoning),
        Delta(text),
        *_logprob_events(text, token_cuts),
        Complete(Usage(1, 2), meta),
    ]
    whole, _ = stepped(events, replace(cfg, slice_chars=WHOLE))
    sliced, _ = stepped(events, replace(cfg, slice_chars=slice_chars))
    assert view(sliced) == view(whole)


def test_slice_chars_must_be_positive() -> None:
    """A slice of no characters would never end: refused when the session is made."""
    with pytest.raises(ValueError, match="slice_chars"):
        StreamSession(conf(slice_chars=0))
