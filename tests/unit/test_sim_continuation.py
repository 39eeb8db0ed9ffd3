"""A simulated run that continues an earlier one (`edge.nodes.sim.continuation`,
`edge.nodes.sim.play`): script + continuation -> the steps played, on items built here.

The rule under test: the run plays the answer the same request plays, less what
the continuation holds (text events it holds skipped, one it ends inside sent
from there, sleeps before the cut skipped), and a continuation that is not the
answer's start is one error event, never a wrong answer.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.sim.continuation import Cut, cut_logprobs
from edge.nodes.sim.play import End, Hang, Send, Sleep, Step, echo_steps, script_steps

Items = list[dict[str, Any]]


def steps(items: Items, text: str = "", reasoning: str = "") -> list[Step]:
    return list(script_steps(items, pb.RunRequest(), cut=Cut(text, reasoning)))


def sent(played: list[Step]) -> list[tuple[str, str]]:
    """(type, text) of every event sent, repeats spelled out."""
    out: list[tuple[str, str]] = []
    for step in played:
        if isinstance(step, Send):
            out += [(step.event.type, step.event.delta or step.event.error)] * step.repeat
    return out


def delta(text: str, **extra: Any) -> dict[str, Any]:
    return {"type": "delta", "delta": text, **extra}


def thought(text: str) -> dict[str, Any]:
    return {"type": "reasoning_delta", "delta": text}


COMPLETE = {"type": "complete", "metadata": {"finish_reason": "stop"}}


def test_events_the_continuation_holds_are_skipped_and_one_it_ends_inside_is_cut() -> None:
    """A continuation ending between events plays the events after it; one ending inside
    an event sends that event from where it ends, then the rest."""
    items = [delta("Hel"), delta("lo "), delta("world"), COMPLETE]
    assert sent(steps(items, "Hello ")) == [("delta", "world"), ("complete", "")]
    assert sent(steps(items, "Hell")) == [("delta", "o "), ("delta", "world"), ("complete", "")]
    assert sent(steps(items, "")) == sent(list(script_steps(items, pb.RunRequest())))


def test_reasoning_is_continued_against_its_own_text() -> None:
    """reasoning_delta events are matched against the continuation's reasoning, deltas
    against its text, each with its own running offset."""
    items = [thought("think"), thought("ing"), delta("A"), delta("B"), COMPLETE]
    assert sent(steps(items, "", "thinki")) == [
        ("reasoning_delta", "ng"),
        ("delta", "A"),
        ("delta", "B"),
        ("complete", ""),
    ]
    assert sent(steps(items, "A", "thinking")) == [("delta", "B"), ("complete", "")]


def test_a_continuation_that_differs_is_one_error_event() -> None:
    """Text that differs from the answer's is answered with an error event (no status)
    and the run ends there: nothing of the answer is sent."""
    played = steps([delta("Hello"), delta(" world"), COMPLETE], "Help")
    assert len(played) == 2
    assert isinstance(played[0], Send)
    assert played[0].event.type == "error"
    assert played[0].event.http_status == 0
    assert "differs from this answer's" in played[0].event.error
    assert played[1] == End("error")


def test_a_continuation_longer_than_the_answer_is_an_error() -> None:
    """A continuation holding more than the answer gives is an error at the answer's end,
    whether it ends with a terminal or not."""
    for items in ([delta("ab"), COMPLETE], [delta("ab")]):
        played = steps(items, "abc")
        assert sent(played)[-1][0] == "error"
        assert "longer than this answer's" in sent(played)[-1][1]
        assert played[-1] == End("error")


def test_text_out_of_the_answers_order_is_an_error() -> None:
    """Reasoning the answer gives after some text cannot be skipped while the text
    continuation still holds more: the cut is one point of the answer."""
    played = steps([delta("A"), thought("R"), delta("B"), COMPLETE], "AB")
    assert sent(played)[0][0] == "error"
    assert "goes on past the continuation's" in sent(played)[0][1]


def test_sleeps_before_the_cut_are_skipped_and_after_it_played() -> None:
    """The continuation starts at once: the sleeps before the point reached are skipped,
    those after it play."""
    items = [
        {"sleep_ms": 1000},
        delta("a"),
        {"sleep_ms": 2000},
        delta("b"),
        {"sleep_ms": 3000},
        delta("c"),
    ]
    assert [s for s in steps(items, "ab") if isinstance(s, Sleep)] == [Sleep(3.0)]
    assert [s for s in steps(items, "a") if isinstance(s, Sleep)] == [Sleep(2.0), Sleep(3.0)]


def test_repeated_delta_is_cut_by_copies() -> None:
    """A repeated delta: the copies the continuation holds are skipped, the one it ends
    inside is cut, the others are sent as one repeated event."""
    played = steps([delta("ab", repeat=5), COMPLETE], "abababa")
    assert sent(played) == [("delta", "b"), ("delta", "ab"), ("complete", "")]
    assert [s.repeat for s in played if isinstance(s, Send)] == [1, 1, 1]
    played = steps([delta("ab", repeat=5), COMPLETE], "abab")
    assert [(s.event.delta, s.repeat) for s in played if isinstance(s, Send)] == [
        ("ab", 3),
        ("", 1),
    ]


def test_logprobs_of_a_cut_delta_are_cut_at_the_same_character() -> None:
    """A delta sent from a character on keeps the tokens sitting on a character from there
    on (a token partly sent before is kept: its last character was not)."""
    tokens = [{"token": t, "logprob": -0.5} for t in ("Hello", " wor", "ld")]
    items = [delta("Hello world", logprobs=tokens), COMPLETE]
    (first, *_) = [s for s in steps(items, "Hello w") if isinstance(s, Send)]
    assert first.event.delta == "orld"
    assert [t.token for t in first.event.logprobs] == [" wor", "ld"]
    (first, *_) = [s for s in steps(items, "Hello") if isinstance(s, Send)]
    assert first.event.delta == " world"
    assert [t.token for t in first.event.logprobs] == [" wor", "ld"]


def test_cut_logprobs_places_tokens_as_the_edge_does() -> None:
    """A token sits on its last character; an empty one on the next character."""
    tokens = [pb.TokenLogprob(token=t) for t in ("ab", "", "c", "de")]
    assert [t.token for t in cut_logprobs(tokens, 0)] == ["ab", "", "c", "de"]
    assert [t.token for t in cut_logprobs(tokens, 2)] == ["", "c", "de"]
    assert [t.token for t in cut_logprobs(tokens, 3)] == ["de"]
    assert cut_logprobs(tokens, 5) == []


def test_events_without_text_play_as_normal() -> None:
    """A complete with native tool calls, after the cut, plays with its calls; a hang
    before the cut is played (the run waits as the earlier one did)."""
    call = {"id": "c1", "name": "f", "arguments": "{}"}
    played = steps([delta("x"), {"type": "complete", "tool_calls": [call]}], "x")
    (send,) = [s for s in played if isinstance(s, Send)]
    assert [c.name for c in send.event.tool_calls] == ["f"]
    assert steps([delta("x"), {"type": "hang"}, delta("y")], "xy") == [Hang()]


def test_echo_continues_word_by_word_with_its_usage() -> None:
    """sim-echo continued: the words after the cut, the one it ends inside cut with its
    token, and the whole answer's output tokens on complete."""
    request = pb.RunRequest(
        model="sim-echo",
        messages=[pb.Message(role="user", content="one two three")],
        extra_json='{"logprobs": true}',
    )
    played = list(echo_steps(request, cut=Cut("one tw", "")))
    events = [s.event for s in played if isinstance(s, Send)]
    assert [(e.type, e.delta) for e in events] == [
        ("delta", "o"),
        ("delta", " three"),
        ("complete", ""),
    ]
    assert [t.token for t in events[0].logprobs] == [" two"]
    assert events[-1].usage is not None
    assert events[-1].usage.output_tokens == 3
    assert sent(list(echo_steps(request, cut=Cut("one two", "x"))))[-1][0] == "error"


def test_request_item_echoes_the_request_without_its_continuation() -> None:
    """A `request` item sends the same text whether the run continues or not."""
    request = pb.RunRequest(run_id="r1", model="sim-script")
    whole = sent(list(script_steps([{"type": "request"}], request)))
    continued = pb.RunRequest(
        run_id="r1", model="sim-script", continuation=pb.Continuation(text="")
    )
    assert sent(list(script_steps([{"type": "request"}], continued, cut=Cut.of(continued)))) == (
        whole
    )
    assert Cut.of(request) is None


def test_a_long_continuation_over_many_events_is_linear() -> None:
    """200,000 one-character deltas against a continuation of all but the last: each
    character is compared once (slicing per event would take hours)."""
    n = 200_000
    items = [delta("a")] * n + [COMPLETE]
    assert sent(steps(items, "a" * (n - 1))) == [("delta", "a"), ("complete", "")]
    assert sent(steps([delta("a", repeat=n), COMPLETE], "a" * (n - 1))) == [
        ("delta", "a"),
        ("complete", ""),
    ]


# --- the property: any script, any cut ---------------------------------------------------

_events = st.lists(
    st.tuples(
        st.sampled_from(["delta", "reasoning_delta"]),
        st.text(alphabet="ab", min_size=1, max_size=4),
        st.integers(min_value=1, max_value=3),
    ),
    max_size=8,
)


@given(_events, st.data())
def test_any_cut_continues_to_exactly_the_uncut_answer(
    events: list[tuple[str, str, int]], data: st.DataObject
) -> None:
    """For any script of text and reasoning deltas (repeats among them) and any cut point
    in it: the continuation's events appended to the cut prefix give the uncut text and
    reasoning, and only the events from the cut on are sent, the first from the cut."""
    items: Items = [
        {"type": kind, "delta": text, **({"repeat": times} if times > 1 else {})}
        for kind, text, times in events
    ] + [COMPLETE]
    flat = [(kind, text) for kind, text, times in events for _ in range(times)]
    index = data.draw(st.integers(min_value=0, max_value=len(flat)))
    offset = 0 if index == len(flat) else data.draw(st.integers(0, len(flat[index][1]) - 1))
    head = [*flat[:index], *([(flat[index][0], flat[index][1][:offset])] if offset else [])]
    text = "".join(t for k, t in head if k == "delta")
    reasoning = "".join(t for k, t in head if k == "reasoning_delta")

    played = sent(steps(items, text, reasoning))

    expected = ([(flat[index][0], flat[index][1][offset:])] if index < len(flat) else []) + flat[
        index + 1 :
    ]
    assert played == [*expected, ("complete", "")]
    whole = [*head, *played]
    for kind in ("delta", "reasoning_delta"):
        assert "".join(t for k, t in whole if k == kind) == "".join(t for k, t in flat if k == kind)
