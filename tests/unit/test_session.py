"""Tests of the stream session: every row of stream-semantics.md, and its properties.

The scenario table walks the spec top to bottom (fixed values, accumulators,
node events, finish, terminal paths, filters, trace logging, and the rows
beyond the seed: think tags, strict output, stream_buffer); each test's
docstring states the invariant it checks. The hypothesis properties at the
end check split invariance of the whole session, exactly one terminal for any
event sequence (garbage included), and that any session renders as valid SSE.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.api.render import ResponseBuilder, SSEEncoder, usage_dict
from edge.api.request import parse_chat_request
from edge.stream.events import Complete, Delta, Failed, NodeEvent, ReasoningDelta, Usage
from edge.stream.output import (
    ContentOut,
    ErrorOut,
    FinishOut,
    Outcome,
    OutEvent,
    ReasoningOut,
    RoleOut,
    ToolCallsOut,
)
from edge.stream.session import SessionSettings, StreamSession
from edge.stream.sessionend import hidden_reasoning_fallback, reasoning_only_fallback
from edge.stream.toolcall import TOOL_VALIDATION_MODES, ToolCall, ToolChoice, ToolPolicy, ToolSpec
from edge.stream.toolparse import DEFAULT_FORMATS, FORMATS

RUN = "run1"

WEATHER = ToolSpec(
    "get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
)
TOOLS = ToolPolicy(tools=(WEATHER, ToolSpec("get_time")))
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
PARIS = ToolCall(id=f"call_{RUN}_0", name="get_weather", arguments='{"city":"Paris"}')


# --- helpers ---------------------------------------------------------------------


@dataclass
class Result:
    """What a caller sees of one session, channel by channel."""

    out: list[OutEvent]
    outcome: Outcome | None
    trace: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    @property
    def content(self) -> str:
        return "".join(e.text for e in self.out if isinstance(e, ContentOut))

    @property
    def reasoning(self) -> str:
        return "".join(e.text for e in self.out if isinstance(e, ReasoningOut))

    @property
    def calls(self) -> tuple[ToolCall, ...] | None:
        found = [e.calls for e in self.out if isinstance(e, ToolCallsOut)]
        assert len(found) <= 1, "at most one tool_calls delta"
        return found[0] if found else None

    @property
    def terminal(self) -> FinishOut | ErrorOut | None:
        found = [e for e in self.out if isinstance(e, FinishOut | ErrorOut)]
        assert len(found) <= 1, "at most one terminal output"
        return found[0] if found else None

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.out]


def conf(**kwargs: Any) -> SessionSettings:
    return SessionSettings(run_id=RUN, **kwargs)


def run(events: Iterable[NodeEvent], cfg: SessionSettings | None = None) -> Result:
    """Feed `events` to a fresh session; drain after every event (as the HTTP layer does).

    The session always gets a list-appending trace hook: it must call it only when the
    settings turn trace on.
    """
    cfg = cfg or conf()
    log: list[tuple[str, dict[str, Any]]] = []
    session = StreamSession(cfg, lambda what, fields: log.append((what, dict(fields))))
    out = session.drain()
    for event in events:
        session.feed(event)
        out += session.drain()
    return Result(out, session.outcome, log)


def complete(finish_reason: str | None = None, **metadata: str) -> Complete:
    if finish_reason is not None:
        metadata["finish_reason"] = finish_reason
    return Complete(metadata=metadata)


def cut(text: str, cuts: Iterable[int]) -> list[str]:
    """`text` cut at the given points (clamped, sorted; empty pieces kept)."""
    points = sorted(min(max(c, 0), len(text)) for c in cuts)
    pieces, prev = [], 0
    for p in [*points, len(text)]:
        pieces.append(text[prev:p])
        prev = p
    return pieces


# --- fixed per stream ----------------------------------------------------------------


def test_fixed_id_created_model_on_every_chunk() -> None:
    """Every chunk of a stream carries the same id, created and model, fixed at dispatch."""
    result = run([Delta("a"), ReasoningDelta("r"), complete(tool_calls="")], conf())
    encoder = SSEEncoder("chatcmpl-" + RUN, 1700000000, "m-1", include_usage=True)
    chunks = [json.loads(p) for p in sse_payloads(encoder.encode(result.out)) if p != "[DONE]"]
    assert len(chunks) == 5  # role, content, reasoning, finish, usage
    for chunk in chunks:
        assert (chunk["id"], chunk["created"], chunk["model"]) == (
            "chatcmpl-" + RUN,
            1700000000,
            "m-1",
        )
        assert chunk["object"] == "chat.completion.chunk"


def test_fixed_output_policy_is_recorded() -> None:
    """strict and stream_buffer are fixed at dispatch and reported in the closing record."""
    session = StreamSession(conf(strict=True, stream_buffer=True))
    session.feed(Delta("x"))
    assert session.log_fields()["strict_output"] is True
    assert session.log_fields()["strict_stream_buffer"] is True


@pytest.mark.parametrize("include", [True, False])
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("explicit", [True, False])
def test_fixed_expose_reasoning(include: bool, strict: bool, explicit: bool) -> None:
    """expose_reasoning = include_reasoning and (not strict or explicit); reasoning_content
    chunks appear exactly when it holds, and reasoning is accumulated either way."""
    cfg = conf(include_reasoning=include, strict=strict, reasoning_explicit=explicit)
    expected = include and (not strict or explicit)
    assert cfg.expose_reasoning is expected
    result = run([ReasoningDelta("why"), Delta("answer"), complete()], cfg)
    assert result.reasoning == ("why" if expected else "")
    assert result.content == "answer"
    assert result.outcome is not None
    assert result.outcome.reasoning_chars == 3


@pytest.mark.parametrize(
    ("fields", "exposed_default", "exposed_strict"),
    [
        ({}, True, False),
        ({"include_reasoning": False}, False, False),
        ({"reasoning": {"exclude": True}}, False, False),
        ({"reasoning": {"enabled": False}}, False, False),
        ({"include_reasoning": True}, True, True),
        ({"reasoning": {"exclude": False}}, True, True),
        ({"reasoning": {"enabled": True}}, True, True),
    ],
)
def test_fixed_include_reasoning_from_the_request(
    fields: dict[str, Any], exposed_default: bool, exposed_strict: bool
) -> None:
    """include_reasoning is on unless the caller turned it off (either dialect); a strict
    stream shows reasoning only when the caller asked for it explicitly."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    request = parse_chat_request(json.dumps(body).encode())
    for strict, exposed in ((False, exposed_default), (True, exposed_strict)):
        cfg = conf(
            strict=strict,
            include_reasoning=request.include_reasoning,
            reasoning_explicit=request.reasoning_explicit,
        )
        assert cfg.expose_reasoning is exposed


def test_fixed_trace_stream_from_request_metadata() -> None:
    """trace_stream is switched on by request metadata, and the hook runs only when it is on."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "metadata": {"trace_stream": "1"},
    }
    assert parse_chat_request(json.dumps(body).encode()).trace_stream is True
    events: list[NodeEvent] = [Delta("a"), ReasoningDelta("r"), complete()]
    assert run(events, conf(trace=False)).trace == []
    assert run(events, conf(trace=True)).trace != []


# --- accumulators ------------------------------------------------------------------


def test_accumulators_content_reasoning_emitted() -> None:
    """`content` is what the model said after the sentinel filter, `emitted` what the caller
    got: tool-call markup is in content (and its length) but never emitted."""
    session = StreamSession(conf(tools=TOOLS))
    session.feed(ReasoningDelta("ab<|im_end|>c"))
    session.feed(Delta("Sure.<|im_end|>\n"))
    session.feed(Delta(CALL_TEXT))
    session.feed(complete())
    out = session.drain()
    shown = "".join(e.text for e in out if isinstance(e, ContentOut))
    assert shown == "Sure."
    fields = session.log_fields()
    assert fields["content_len"] == len("Sure.\n" + CALL_TEXT)
    assert fields["reasoning_len"] == len("abc")


# --- events from the node ------------------------------------------------------------


def test_role_chunk_is_first() -> None:
    """The first output of every session, before any event, is the role chunk."""
    session = StreamSession(conf())
    assert session.drain() == [RoleOut()]
    session.feed(Delta("x"))
    assert RoleOut() not in session.drain()


def test_event_delta_sentinels_removed_across_chunk_boundaries() -> None:
    """delta: a sentinel split over deltas is removed; text that only looked like the start
    of one is released as soon as it cannot be one."""
    result = run([Delta("hel"), Delta("lo<|im_"), Delta("end|> wor"), Delta("ld</"), complete()])
    assert result.content == "hello world</"
    pieces = [e.text for e in result.out if isinstance(e, ContentOut)]
    assert pieces == ["hel", "lo", " wor", "ld", "</"]  # "</" held until flushed at finish


def test_event_delta_suppressed_output_is_traced() -> None:
    """delta: when the tool-text filter holds everything back, nothing is written and (trace
    on) the suppression is logged."""
    result = run([Delta("<tool_call>")], conf(tools=TOOLS, trace=True))
    assert result.kinds() == ["RoleOut"]
    assert [what for what, _ in result.trace] == ["suppressed"]
    assert result.trace[0][1]["type"] == "content"


def test_event_reasoning_delta_sentinels_removed_across_chunk_boundaries() -> None:
    """reasoning_delta: sentinels are removed from reasoning across deltas, as in content."""
    result = run([ReasoningDelta("think<|eot"), ReasoningDelta("_id|>ing</"), complete()])
    assert result.reasoning == "thinking</"


def test_event_reasoning_delta_hidden_is_still_accumulated() -> None:
    """reasoning_delta: hidden reasoning writes no chunk but still counts."""
    result = run([ReasoningDelta("why"), Delta("x"), complete()], conf(include_reasoning=False))
    assert result.kinds() == ["RoleOut", "ContentOut", "FinishOut"]
    assert result.outcome is not None
    assert result.outcome.reasoning_chars == 3


def test_event_complete_is_terminal() -> None:
    """complete: finish; feed reports the terminal."""
    session = StreamSession(conf())
    assert session.feed(Delta("x")) is False
    assert session.feed(complete()) is True
    assert session.terminated


@pytest.mark.parametrize("kind", ["error", "cancelled"])
@pytest.mark.parametrize(
    ("error", "message", "shown"),
    [("boom", "detail", "boom"), ("", "detail", "detail"), ("", "", "run failed")],
)
def test_event_error_and_cancelled_fail_with_run_error(
    kind: Any, error: str, message: str, shown: str
) -> None:
    """error / cancelled: fail with type run_error and message = error, else message, else
    "run failed"; terminal."""
    result = run([Delta("x"), Failed(kind, error=error, message=message)])
    assert result.terminal == ErrorOut("run_error", shown)
    assert result.outcome is not None
    assert (result.outcome.status, result.outcome.error_type) == ("error", "run_error")


@pytest.mark.parametrize(
    ("event", "terminal", "node_status"),
    [
        # A refusal: the node's status, its words, its code (a short token beside words).
        (Failed("error", "context_length_exceeded", "too long", http_status=400),
         ErrorOut("invalid_request_error", "too long", 400, "context_length_exceeded"), 400),
        (Failed("error", "no such model", http_status=404),
         ErrorOut("invalid_request_error", "no such model", 404, None), 404),
        (Failed("error", "not a code!", "words", http_status=422),
         ErrorOut("invalid_request_error", "words", 422, None), 422),
        (Failed("error", "c" * 65, "words", http_status=413),
         ErrorOut("invalid_request_error", "words", 413, None), 413),
        (Failed("error", http_status=400),
         ErrorOut("invalid_request_error", "the node refused the request", 400, None), 400),
        # Overloaded: 429, rate_limit_exceeded.
        (Failed("error", "", "slow down", http_status=429),
         ErrorOut("rate_limit_exceeded", "slow down", 429, None), 429),
        # Failures, whatever their status: run_error, as ever.
        (Failed("error", "boom", http_status=408), ErrorOut("run_error", "boom"), 0),
        (Failed("error", "boom", http_status=503), ErrorOut("run_error", "boom"), 0),
        (Failed("error", "boom", http_status=200), ErrorOut("run_error", "boom"), 0),
        (Failed("cancelled", "gone", http_status=400), ErrorOut("run_error", "gone"), 0),
    ],
)  # fmt: skip
def test_an_error_event_is_a_refusal_an_overload_or_a_failure_by_its_status(
    event: Failed, terminal: ErrorOut, node_status: int
) -> None:
    """An error event with 4xx but 408 and 429 is a refusal (invalid_request_error, the
    node's status, its message, else its error, and a code only when error is a short
    token beside a message); 429 is rate_limit_exceeded; anything else, a cancelled event
    included, is run_error as before. The outcome carries the refusal's status."""
    for events in ([event], [Delta("x"), event]):
        result = run(events)
        assert result.terminal == terminal
        assert result.outcome is not None
        assert result.outcome.status == "error"
        assert (result.outcome.error_type, result.outcome.node_status) == (
            terminal.type,
            node_status,
        )


# --- finish -----------------------------------------------------------------------


def test_finish_flushes_both_sentinel_filters() -> None:
    """finish step 1: held partial sentinels in content and reasoning are released."""
    result = run([ReasoningDelta("r<|eo"), Delta("c<|im"), complete()])
    assert (result.content, result.reasoning) == ("c<|im", "r<|eo")


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [({}, "stop"), ({"finish_reason": ""}, "stop"), ({"finish_reason": "length"}, "length")],
)
def test_finish_reason_from_metadata_default_stop(metadata: dict[str, str], expected: str) -> None:
    """finish step 2: finish_reason is the metadata's, default "stop"."""
    result = run([Delta("x"), Complete(metadata=metadata)])
    assert result.terminal == FinishOut(expected, None)
    assert result.outcome is not None
    assert result.outcome.finish_reason == expected


def test_finish_native_tool_calls_win() -> None:
    """finish step 3, native: only the safe prefix before a text candidate is emitted; calls
    are normalized (id, type, JSON-string arguments, declared name); finish_reason tool_calls."""
    native = json.dumps([{"function": {"name": "GET_WEATHER", "arguments": {"city": "Rome"}}}])
    result = run(
        [
            Delta("Let me check.\n<tool_"),
            Delta('call>{"name": "x"'),
            complete("stop", tool_calls=native),
        ],
        conf(tools=TOOLS),
    )
    assert result.content == "Let me check."
    assert result.calls == (
        ToolCall(id=f"call_{RUN}_0", name="get_weather", arguments='{"city":"Rome"}'),
    )
    assert result.terminal == FinishOut("tool_calls", None)
    assert result.kinds()[-2:] == ["ToolCallsOut", "FinishOut"]


def test_finish_native_tool_calls_keep_ids_and_string_arguments() -> None:
    """finish step 3, native: a given id is kept; arguments already a JSON string are compacted."""
    native = json.dumps(
        [{"id": "abc", "type": "function", "function": {"name": "get_time", "arguments": "{ }"}}]
    )
    result = run([complete(tool_calls=native)], conf(tools=TOOLS))
    assert result.calls == (ToolCall(id="abc", name="get_time", arguments="{}"),)


def test_finish_typed_native_tool_calls() -> None:
    """finish step 3, typed native calls: the same normalization as the JSON form, no JSON
    around them (a missing id is chosen, the declared name matched, arguments compacted)."""
    typed = (
        ToolCall(id="", name="GET_WEATHER", arguments='{ "city": "Rome" }'),
        ToolCall(id="abc", name="get_time", arguments=""),
    )
    result = run([Delta("x"), Complete(tool_calls=typed)], conf(tools=TOOLS))
    assert result.calls == (
        ToolCall(id=f"call_{RUN}_0", name="get_weather", arguments='{"city":"Rome"}'),
        ToolCall(id="abc", name="get_time", arguments="{}"),
    )
    assert result.terminal == FinishOut("tool_calls", None)


def test_finish_typed_tool_calls_win_over_metadata() -> None:
    """A node that sends both forms is read by its typed field; the JSON is not parsed."""
    typed = (ToolCall(id="t1", name="get_time", arguments="{}"),)
    event = Complete(metadata={"tool_calls": "not json"}, tool_calls=typed)
    result = run([event], conf(tools=TOOLS))
    assert result.calls == typed
    assert result.terminal == FinishOut("tool_calls", None)


def test_finish_typed_tool_call_without_name_fails() -> None:
    """A typed call with no name is never silently dropped: tool_validation_error."""
    typed = (ToolCall(id="t1", name="", arguments="{}"),)
    result = run([Complete(tool_calls=typed)], conf(tools=TOOLS))
    assert result.calls is None
    assert result.outcome is not None
    assert result.outcome.error_type == "tool_validation_error"


def test_finish_synthesized_tool_calls() -> None:
    """finish step 3, text: calls are synthesized from the whole content; the cleaned text not
    yet emitted is emitted; markup never reaches the caller; finish_reason tool_calls."""
    text = "I will check.\n" + CALL_TEXT
    for pieces in (cut(text, []), cut(text, range(len(text)))):
        result = run([*map(Delta, pieces), complete()], conf(tools=TOOLS))
        assert result.content == "I will check."
        assert result.calls == (PARIS,)
        assert result.terminal == FinishOut("tool_calls", None)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
        "<tool_call>{not json",
    ],
)
def test_finish_tool_validation_error(text: str) -> None:
    """finish step 3, text: a call that fails validation ends the stream with
    tool_validation_error (no tool_calls delta, no finish chunk)."""
    result = run([Delta(text), complete()], conf(tools=TOOLS))
    assert isinstance(result.terminal, ErrorOut)
    assert result.terminal.type == "tool_validation_error"
    assert result.calls is None
    assert result.content == ""


@pytest.mark.parametrize("text", ["see <tool_", '{"a": 1', "prose\n  "])
def test_finish_no_candidate_flushes_held_text(text: str) -> None:
    """finish step 3, text: when no call was found, what the tool-text filter held back is
    released: the caller gets the whole text."""
    result = run([Delta(text), complete()], conf(tools=TOOLS))
    assert result.content == text
    assert result.terminal == FinishOut("stop", None)


CALL_EXAMPLES = (
    "A call looks like this:\n```json\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n'
    'or bare:\n{"name": "search", "arguments": {"q": "x"}}\nThat is all.'
)


@pytest.mark.parametrize("whole_output", [False, True])
def test_default_formats_leave_call_examples_as_content(whole_output: bool) -> None:
    """With the default formats (the tags) and tools declared, an answer showing calls as
    fenced or bare JSON is content, unchanged in any split: no call, finish_reason stop.
    With "json" and "fenced" configured the same text is a (failing) call."""
    cfg = conf(tools=TOOLS, whole_output=whole_output)
    for pieces in (cut(CALL_EXAMPLES, []), list(CALL_EXAMPLES)):
        result = run([*map(Delta, pieces), complete()], cfg)
        assert result.content == CALL_EXAMPLES
        assert result.calls is None
        assert result.terminal == FinishOut("stop", None)
    every = replace(cfg, tool_formats=FORMATS, tools=replace(TOOLS, validation="strict"))
    result = run([Delta(CALL_EXAMPLES), complete()], every)
    assert isinstance(result.terminal, ErrorOut)


def test_finish_without_tools_markup_is_content() -> None:
    """finish step 3, no tools declared: nothing is held; tool-call markup is plain content."""
    result = run([Delta(CALL_TEXT), complete()])
    assert result.content == CALL_TEXT
    assert result.calls is None


@pytest.mark.parametrize("finish_reason", ["stop", "length", "content_filter"])
@pytest.mark.parametrize("include", [True, False])
def test_finish_reasoning_only_fallback(finish_reason: str, include: bool) -> None:
    """finish step 4: reasoning but no visible content gives a placeholder keyed by
    finish_reason, with the reasoning in it when the caller asked for reasoning."""
    cfg = conf(include_reasoning=include)
    result = run([ReasoningDelta("deep thought"), Delta("  \n"), complete(finish_reason)], cfg)
    placeholder = (
        reasoning_only_fallback("deep thought", finish_reason)
        if include
        else hidden_reasoning_fallback(finish_reason)
    )
    assert result.content == "  \n" + placeholder
    assert ("deep thought" in placeholder) is include
    assert result.terminal == FinishOut(finish_reason, None)


def test_fallback_placeholders_differ_by_finish_reason() -> None:
    """The hidden-reasoning notice is keyed by finish_reason."""
    notices = {hidden_reasoning_fallback(r) for r in ("stop", "length", "content_filter")}
    assert len(notices) == 3


@pytest.mark.parametrize(
    ("events", "cfg"),
    [
        ([ReasoningDelta("r")], conf(strict=True)),
        ([ReasoningDelta("r"), Delta("answer")], conf()),
        ([ReasoningDelta("  \n")], conf()),
        (
            [ReasoningDelta("r"), complete(tool_calls='[{"name": "get_time"}]')],
            conf(tools=TOOLS),
        ),
    ],
    ids=["strict", "content", "blank-reasoning", "native-call"],
)
def test_finish_no_fallback(events: list[NodeEvent], cfg: SessionSettings) -> None:
    """finish step 4: no placeholder on strict output, with visible content, with blank
    reasoning, or with a native tool call."""
    if not any(isinstance(e, Complete) for e in events):
        events = [*events, complete()]
    result = run(events, cfg)
    assert "[The model" not in result.content
    assert isinstance(result.terminal, FinishOut)


def test_finish_terminal_finish_chunk_then_done_and_usage() -> None:
    """finish step 5: the finish chunk (empty delta, finish_reason), then [DONE]; the outcome
    records success with the node's usage and the reasoning chars."""
    usage = Usage(input_tokens=7, output_tokens=3, reasoning_tokens=2, cached_input_tokens=4)
    result = run([ReasoningDelta("rr"), Delta("x"), Complete(usage, {"finish_reason": "stop"})])
    assert result.terminal == FinishOut("stop", usage)
    assert result.outcome == Outcome(
        "success", finish_reason="stop", usage=usage, reasoning_chars=2, node_finish_reason="stop"
    )
    payloads = sse_payloads(SSEEncoder("id", 1, "m", include_usage=False).encode(result.out))
    assert payloads[-1] == "[DONE]"
    finish = json.loads(payloads[-2])["choices"][0]
    assert (finish["delta"], finish["finish_reason"]) == ({}, "stop")


# --- terminal paths ------------------------------------------------------------------


def test_terminal_fail_records_error_metrics() -> None:
    """fail: an error frame with its type; the outcome is an error with a usage sample."""
    session = StreamSession(conf())
    session.feed(ReasoningDelta("abc"))
    session.fail("run_error", "bad")
    assert session.drain()[-1] == ErrorOut("run_error", "bad")
    assert session.outcome == Outcome("error", error_type="run_error", reasoning_chars=3)


def test_terminal_fail_stream_records_no_usage_sample() -> None:
    """fail stream: an error frame; no usage sample is recorded."""
    session = StreamSession(conf())
    session.feed(Delta("x"))
    session.fail_stream("run_error", "stream broke")
    assert session.drain()[-1] == ErrorOut("run_error", "stream broke")
    assert session.outcome is not None
    assert session.outcome.usage_sample is False
    assert session.outcome.status == "error"


def test_terminal_cancel_writes_nothing() -> None:
    """cancel (caller gone): nothing is written; the outcome is cancelled."""
    session = StreamSession(conf())
    session.feed(Delta("x"))
    session.drain()
    session.cancel("cancelled")
    assert session.drain() == []
    assert session.outcome == Outcome("cancelled")


def test_terminal_timeout_writes_only_the_notice() -> None:
    """cancel (timeout): only the notice the caller waits for is written; outcome timeout."""
    session = StreamSession(conf())
    session.feed(ReasoningDelta("ab"))
    session.drain()
    session.cancel("timeout", "timed out waiting for the next token")
    assert session.drain() == [ErrorOut("timeout", "timed out waiting for the next token")]
    assert session.outcome == Outcome("timeout", reasoning_chars=2)


def _terminals() -> dict[str, Any]:
    return {
        "finish": lambda s: s.feed(complete()),
        "node_error": lambda s: s.feed(Failed("error", error="x")),
        "fail": lambda s: s.fail("run_error", "x"),
        "fail_stream": lambda s: s.fail_stream("run_error", "x"),
        "cancel": lambda s: s.cancel("cancelled"),
        "timeout": lambda s: s.cancel("timeout", "late"),
    }


@pytest.mark.parametrize("first", list(_terminals()))
@pytest.mark.parametrize("second", list(_terminals()))
def test_terminal_second_attempt_is_a_noop(first: str, second: str) -> None:
    """Exactly one terminal per stream: a second terminal attempt writes nothing and leaves
    the outcome as the first one set it."""
    session = StreamSession(conf())
    session.feed(Delta("x"))
    _terminals()[first](session)
    session.drain()
    outcome = session.outcome
    assert outcome is not None
    _terminals()[second](session)
    assert session.drain() == []
    assert session.outcome is outcome


@pytest.mark.parametrize(
    "late",
    [Delta("more"), ReasoningDelta("more"), complete(), Failed("error", error="late")],
)
def test_events_after_terminal_are_ignored(late: NodeEvent) -> None:
    """Events after the terminal change nothing: no output, no accumulation."""
    session = StreamSession(conf())
    session.feed(Delta("x"))
    session.feed(complete())
    session.drain()
    before = session.log_fields()
    assert session.feed(late) is True
    assert session.drain() == []
    assert session.log_fields() == before


# --- filters (the properties below check split invariance) ---------------------------


def test_filters_custom_sentinels() -> None:
    """The sentinel list is configurable; only the configured tokens are removed."""
    result = run([Delta("a<eos>b<|im_end|>"), complete()], conf(sentinels=("<eos>",)))
    assert result.content == "ab<|im_end|>"


def test_filters_tool_text_never_shows_markup_split_anywhere() -> None:
    """The tool-text filter holds markup back wherever the deltas cut it."""
    text = "Checking.\n" + CALL_TEXT + "\n"
    for i in range(len(text) + 1):
        result = run([Delta(text[:i]), Delta(text[i:]), complete()], conf(tools=TOOLS))
        assert result.content == "Checking."
        assert result.calls == (PARIS,)


# --- trace logging -----------------------------------------------------------------


def test_trace_every_written_chunk_is_logged() -> None:
    """Trace on: each written chunk is logged with run id, sequence number, type, source
    length, whether it was filtered, and whether the source held think tags."""
    result = run(
        [ReasoningDelta("r"), Delta("a<|im_end|>"), Delta("b"), complete()],
        conf(trace=True),
    )
    chunks = [fields for what, fields in result.trace if what == "chunk"]
    assert [(c["seq"], c["type"]) for c in chunks] == [
        (1, "reasoning"),
        (2, "content"),
        (3, "content"),
    ]
    assert all(c["run_id"] == RUN for c in chunks)
    assert (chunks[1]["source_len"], chunks[1]["filtered"]) == (len("a<|im_end|>"), True)
    assert (chunks[2]["source_len"], chunks[2]["filtered"]) == (1, False)
    assert chunks[1]["source_has_open_think"] is False


def test_trace_think_tags_in_source_are_flagged() -> None:
    """Trace on: a content chunk whose source held think tags says so."""
    result = run(
        [Delta("<think>r</think>answer"), complete()],
        conf(trace=True, reasoning_parser="think"),
    )
    content = [f for w, f in result.trace if w == "chunk" and f["type"] == "content"]
    assert content[0]["source_has_open_think"] is True
    assert content[0]["source_has_close_think"] is True


@pytest.mark.parametrize(
    ("ending", "what"),
    [
        (complete(), "done"),
        (Failed("error"), "error"),
        (complete(tool_calls='[{"name": "get_time"}]'), "done"),
    ],
)
def test_trace_terminal_is_logged(ending: NodeEvent, what: str) -> None:
    """Trace on: the terminal is logged (after any tool_calls record)."""
    result = run([Delta("x"), ending], conf(trace=True, tools=TOOLS))
    assert result.trace[-1][0] == what
    assert result.trace[-1][1]["run_id"] == RUN


def test_trace_cancel_is_logged_once() -> None:
    """Trace on: a cancel is logged, and a second terminal attempt logs nothing."""
    log: list[tuple[str, Mapping[str, Any]]] = []
    session = StreamSession(conf(trace=True), lambda w, f: log.append((w, f)))
    session.cancel("cancelled")
    session.fail("run_error", "x")
    session.fail_stream("run_error", "x")
    assert [w for w, _ in log] == ["cancel"]


def test_trace_closing_record() -> None:
    """The closing record has run id, strict flags, content and reasoning lengths."""
    session = StreamSession(conf(strict=True))
    session.feed(Delta("abc"))
    session.feed(ReasoningDelta("de"))
    assert session.log_fields() == {
        "run_id": RUN,
        "strict_output": True,
        "strict_stream_buffer": False,
        "content_len": 3,
        "reasoning_len": 2,
    }


def test_trace_off_never_calls_the_hook() -> None:
    """Trace off: the hook is never called, whatever happens."""
    events: list[NodeEvent] = [Delta("<tool_call>"), ReasoningDelta("r"), complete(tool_calls="[{")]
    assert run(events, conf(tools=TOOLS)).trace == []
    session = StreamSession(conf(), lambda w, f: pytest.fail("trace hook called"))
    session.feed(Delta("x"))
    session.cancel("timeout", "late")


# --- beyond the seed: think tags -------------------------------------------------------


def test_think_parser_splits_content_into_reasoning() -> None:
    """reasoning_parser "think": <think>...</think> in content deltas becomes reasoning, split
    anywhere; the tags never reach the caller."""
    text = "<think>let me see</think>The answer is 4."
    for pieces in (cut(text, []), cut(text, range(len(text)))):
        result = run([*map(Delta, pieces), complete()], conf(reasoning_parser="think"))
        assert (result.content, result.reasoning) == ("The answer is 4.", "let me see")


def test_think_start_parser_begins_inside_a_block() -> None:
    """reasoning_parser "think_start": the stream begins in reasoning, until </think>."""
    result = run(
        [Delta("hmm"), Delta("</thi"), Delta("nk>Yes."), complete()],
        conf(reasoning_parser="think_start"),
    )
    assert (result.content, result.reasoning) == ("Yes.", "hmm")


def test_think_parser_none_leaves_tags_in_content() -> None:
    """reasoning_parser "none": think tags are plain content."""
    result = run([Delta("<think>a</think>b"), complete()])
    assert result.content == "<think>a</think>b"


def test_think_reasoning_hidden_on_strict_but_no_tags_leak() -> None:
    """Think-tag reasoning obeys expose_reasoning like reasoning_delta does."""
    result = run(
        [Delta("<think>secret</think>{}"), complete()],
        conf(reasoning_parser="think", strict=True),
    )
    assert (result.content, result.reasoning) == ("{}", "")
    assert result.outcome is not None
    assert result.outcome.reasoning_chars == len("secret")


def test_think_sentinels_removed_inside_think_blocks() -> None:
    """Sentinels are removed before think splitting, so neither channel shows them."""
    result = run(
        [Delta("<think>a<|im_"), Delta("end|>b</think>c</s>"), complete()],
        conf(reasoning_parser="think"),
    )
    assert (result.content, result.reasoning) == ("c", "ab")


def test_think_only_output_gets_the_fallback() -> None:
    """A think-only answer (unclosed block) is reasoning-only: the fallback applies."""
    result = run(
        [Delta("<think>still thinking"), complete("length")], conf(reasoning_parser="think")
    )
    assert result.content == reasoning_only_fallback("still thinking", "length")


# --- beyond the seed: strict output and stream_buffer ----------------------------------

JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"n": {"type": "integer"}},
            "required": ["n"],
        },
    },
}


@pytest.mark.parametrize(
    ("fmt", "text", "valid"),
    [
        ({"type": "json_object"}, '{"a": 1}', True),
        ({"type": "json_object"}, "[1]", False),
        ({"type": "json_object"}, '{"a": ', False),
        (JSON_SCHEMA, '{"n": 3}', True),
        (JSON_SCHEMA, '{"n": "3"}', False),
        (JSON_SCHEMA, "{}", False),
        ({"type": "text"}, "anything", True),
        (None, "anything", True),
    ],
)
def test_strict_stream_buffer_releases_content_only_when_valid(
    fmt: dict[str, Any] | None, text: str, valid: bool
) -> None:
    """strict + stream_buffer: no content byte goes out before the whole output is validated;
    valid output comes out before the finish chunk, invalid output ends the stream with
    output_validation_error and no content at all."""
    session = StreamSession(conf(strict=True, stream_buffer=True, response_format=fmt))
    out = session.drain()
    for piece in cut(text, range(0, len(text), 2)):
        session.feed(Delta(piece))
        out += session.drain()
        assert not any(isinstance(e, ContentOut) for e in out)
    session.feed(complete())
    result = Result(out + session.drain(), session.outcome)
    if valid:
        assert result.content == text
        assert result.kinds()[-1] == "FinishOut"
    else:
        assert result.content == ""
        assert isinstance(result.terminal, ErrorOut)
        assert result.terminal.type == "output_validation_error"
        assert result.outcome is not None
        assert result.outcome.error_type == "output_validation_error"


def test_strict_without_buffer_streams_then_fails() -> None:
    """strict without stream_buffer: content streams as it comes; invalid output still ends
    with output_validation_error instead of a finish chunk."""
    result = run([Delta("not json"), complete()], conf(strict=True, response_format=JSON_SCHEMA))
    assert result.content == "not json"
    assert isinstance(result.terminal, ErrorOut)
    assert result.terminal.type == "output_validation_error"


def test_stream_buffer_without_strict_holds_until_finish() -> None:
    """stream_buffer alone: content is held to the end, then released; nothing is validated."""
    session = StreamSession(conf(stream_buffer=True, response_format={"type": "json_object"}))
    session.feed(Delta("plain"))
    assert session.drain() == [RoleOut()]
    session.feed(complete())
    assert session.drain() == [ContentOut("plain"), FinishOut("stop", None)]


def test_stream_buffer_failure_releases_nothing() -> None:
    """stream_buffer: a node error after buffered content ends with the error alone."""
    result = run([Delta("partial"), Failed("error", error="x")], conf(stream_buffer=True))
    assert result.kinds() == ["RoleOut", "ErrorOut"]


def test_strict_tool_calls_skip_format_validation() -> None:
    """strict with a tool call: the answer is the call, so response_format is not applied."""
    result = run(
        [Delta(CALL_TEXT), complete()],
        conf(strict=True, tools=TOOLS, response_format={"type": "json_object"}),
    )
    assert result.calls == (PARIS,)
    assert result.terminal == FinishOut("tool_calls", None)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "nonsense"},
        {"type": "string", "minLength": "x"},
        {"pattern": "("},
        {"$ref": "#/$defs/missing"},
        {"$ref": "http://127.0.0.1:9/schema.json"},
    ],
)
def test_strict_bad_schema_is_an_output_validation_error(schema: dict[str, Any]) -> None:
    """A caller's broken or remote json_schema ends the stream with output_validation_error:
    the session never raises and never fetches a $ref."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    result = run([Delta('"text"'), complete()], conf(strict=True, response_format=fmt))
    assert isinstance(result.terminal, ErrorOut)
    assert result.terminal.type == "output_validation_error"


def test_strict_deeply_nested_output_is_invalid_not_a_crash() -> None:
    """Output nested past the JSON parser's depth is invalid JSON, not an exception."""
    deep = "[" * 5000 + "]" * 5000
    result = run([Delta(deep), complete()], conf(strict=True, response_format=JSON_SCHEMA))
    assert isinstance(result.terminal, ErrorOut)
    assert result.terminal.type == "output_validation_error"


@pytest.mark.parametrize("where", ["content", "native"])
def test_deeply_nested_tool_json_still_ends_in_one_terminal(where: str) -> None:
    """Tool JSON nested past the parser's depth (in content or in native metadata) is not a
    call: the session still reaches exactly one terminal instead of raising."""
    deep = "[" * 5000 + "]" * 5000
    events: list[NodeEvent] = (
        [Delta(deep), complete()] if where == "content" else [complete(tool_calls=deep)]
    )
    result = run(events, conf(tools=TOOLS))
    assert result.terminal is not None


# --- rendering: usage, include_usage, the non-streaming form ---------------------------


def test_render_usage_mapping() -> None:
    """Node usage maps to OpenAI usage: prompt = input, completion = output, total = both,
    cached and reasoning tokens in the details; no usage means zeros."""
    usage = Usage(input_tokens=10, output_tokens=4, reasoning_tokens=3, cached_input_tokens=6)
    assert usage_dict(usage) == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 6},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }
    assert usage_dict(None)["total_tokens"] == 0


@pytest.mark.parametrize("include_usage", [True, False])
def test_render_include_usage_chunk(include_usage: bool) -> None:
    """include_usage: one usage chunk with no choices after the finish chunk, before [DONE],
    and "usage": null on every other chunk (as OpenAI sends); without it, no usage anywhere."""
    usage = Usage(input_tokens=2, output_tokens=1)
    result = run([Delta("x"), Complete(usage, {})])
    encoder = SSEEncoder("id", 1, "m", include_usage=include_usage)
    payloads = sse_payloads(encoder.encode(result.out))
    chunks = [json.loads(p) for p in payloads[:-1]]
    with_usage = [c for c in chunks if c.get("usage") is not None]
    if include_usage:
        assert with_usage == [chunks[-1]]
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == usage_dict(usage)
    else:
        assert all("usage" not in c for c in chunks)


def test_render_non_streaming_is_the_same_session() -> None:
    """The non-streaming rendering folds the same events: content, reasoning, tool calls,
    finish_reason and usage agree with the stream."""
    usage = Usage(input_tokens=3, output_tokens=5)
    result = run(
        [ReasoningDelta("r"), Delta("Hi.\n"), Delta(CALL_TEXT), Complete(usage, {})],
        conf(tools=TOOLS),
    )
    builder = ResponseBuilder()
    builder.add(result.out)
    body = builder.response("chatcmpl-" + RUN, 1, "m")
    message = body["choices"][0]["message"]
    assert message["content"] == result.content == "Hi."
    assert message["reasoning_content"] == "r"
    assert message["tool_calls"] == [
        {
            "id": PARIS.id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": PARIS.arguments},
        }
    ]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"] == usage_dict(usage)


# --- properties ------------------------------------------------------------------------

FRAGMENTS = [
    "<think>",
    "</think>",
    "<think",
    "</thi",
    "<|im_end|>",
    "<|im_",
    "<|eot_id|>",
    "</s>",
    "<|end|>",
    "<",
    "|",
    ">",
    CALL_TEXT,
    '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "get_time", "arguments": {}}',
    '{"name": "nope"}',
    "[TOOL_CALLS]",
    "{",
    "}",
    '"',
    "\n",
    " ",
    "hello",
    "world",
    "a",
    "The answer",
]

texts = st.lists(st.sampled_from(FRAGMENTS), max_size=25).map("".join)
cuts = st.lists(st.integers(min_value=0, max_value=600), max_size=30)

tool_policies = st.sampled_from(
    [
        ToolPolicy(),
        TOOLS,
        ToolPolicy(tools=TOOLS.tools, choice=ToolChoice("required")),
        ToolPolicy(tools=TOOLS.tools, choice=ToolChoice("none")),
        ToolPolicy(tools=TOOLS.tools, parallel_tool_calls=False),
    ]
)
response_formats = st.sampled_from([None, None, {"type": "json_object"}, JSON_SCHEMA])


@st.composite
def session_settings(draw: st.DrawFn) -> SessionSettings:
    return conf(
        strict=draw(st.booleans()),
        stream_buffer=draw(st.booleans()),
        include_reasoning=draw(st.booleans()),
        reasoning_explicit=draw(st.booleans()),
        trace=draw(st.booleans()),
        tools=replace(draw(tool_policies), validation=draw(st.sampled_from(TOOL_VALIDATION_MODES))),
        tool_formats=draw(st.sampled_from([DEFAULT_FORMATS, FORMATS])),
        reasoning_parser=draw(st.sampled_from(["none", "think", "think_start"])),
        response_format=draw(response_formats),
        logprobs=draw(st.booleans()),
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(["name", "arguments", "parameters", "id", "type", "function"])
            | st.text(max_size=4),
            children,
            max_size=4,
        )
    ),
    max_leaves=10,
)
raw_tool_calls = st.one_of(
    st.text(max_size=30),
    json_values.map(json.dumps),
    st.sampled_from(
        [
            '[{"name": "get_time"}]',
            '[{"function": {"name": "get_weather", "arguments": "{\\"city\\": \\"x\\"}"}}]',
            '[{"name": "get_time"}, {"name": "get_time"}]',
            '[{"name": "undeclared"}]',
            "[",
            "null",
        ]
    ),
)
metadata = st.fixed_dictionaries(
    {},
    optional={
        "finish_reason": st.sampled_from(["stop", "length", "content_filter", "", "abort"])
        | st.text(max_size=8),
        "tool_calls": raw_tool_calls,
        "other": st.text(max_size=8),
    },
)
usages = st.none() | st.builds(
    Usage,
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
)
node_events = st.one_of(
    st.builds(Delta, texts | st.text(max_size=10)),
    st.builds(ReasoningDelta, texts | st.text(max_size=10)),
    st.builds(Complete, usages, metadata),
    st.builds(
        Failed,
        st.sampled_from(["error", "cancelled"]),
        st.text(max_size=8),
        st.text(max_size=8),
        usages,
    ),
)
endings = st.sampled_from(
    ["none", "cancel", "cancel_notice", "timeout", "timeout_notice", "fail_stream", "fail"]
)


def _end(session: StreamSession, ending: str) -> None:
    if ending == "cancel":
        session.cancel("cancelled")
    elif ending == "cancel_notice":
        session.cancel("cancelled", "going away")
    elif ending == "timeout":
        session.cancel("timeout")
    elif ending == "timeout_notice":
        session.cancel("timeout", "timed out")
    elif ending == "fail_stream":
        session.fail_stream("run_error", "broken")
    elif ending == "fail":
        session.fail("run_error", "failed")


def caller_view(result: Result) -> tuple[Any, ...]:
    return (result.content, result.reasoning, result.calls, result.terminal, result.outcome)


@given(
    cfg=session_settings(),
    reasoning=texts,
    text=texts,
    reasoning_cuts=cuts,
    text_cuts=cuts,
    meta=metadata,
)
def test_property_split_invariance_of_the_session(
    cfg: SessionSettings,
    reasoning: str,
    text: str,
    reasoning_cuts: list[int],
    text_cuts: list[int],
    meta: dict[str, str],
) -> None:
    """For any settings, any split of the node's reasoning and text into deltas gives the same
    caller-visible output as the unsplit text: concatenated content and reasoning, tool
    calls, the terminal and the outcome."""
    ending = Complete(Usage(1, 2), meta)

    def session(r: Sequence[str], t: Sequence[str]) -> Result:
        return run([*map(ReasoningDelta, r), *map(Delta, t), ending], cfg)

    whole = session([reasoning], [text])
    assert whole.terminal is not None
    assert caller_view(session(cut(reasoning, reasoning_cuts), cut(text, text_cuts))) == (
        caller_view(whole)
    )
    assert caller_view(session(list(reasoning), list(text))) == caller_view(whole)


@given(
    cfg=session_settings(),
    events=st.lists(node_events, max_size=12),
    ending=endings,
    late=st.lists(node_events, max_size=3),
)
def test_property_exactly_one_terminal(
    cfg: SessionSettings, events: list[NodeEvent], ending: str, late: list[NodeEvent]
) -> None:
    """For any event sequence (garbage metadata included) and any ending: RoleOut comes first;
    the outcome is set at most once and never changes; there is exactly one terminal output
    (none only for a cancel without notice, or while the stream is still open) and nothing
    after it; once terminated, more events and terminal attempts write nothing."""
    session = StreamSession(cfg, lambda w, f: None)
    out = session.drain()
    outcomes: list[Outcome] = []

    def step(apply: Any) -> None:
        nonlocal out
        before = session.outcome
        apply()
        out += session.drain()
        if before is not None:
            assert session.outcome is before
        elif session.outcome is not None:
            outcomes.append(session.outcome)

    for event in events:
        step(lambda e=event: session.feed(e))
    step(lambda: _end(session, ending))
    for event in late:
        step(lambda e=event: session.feed(e))
    for other in ("cancel_notice", "fail_stream", "fail"):
        step(lambda o=other: _end(session, o))

    assert out[0] == RoleOut()
    assert RoleOut() not in out[1:]
    terminals = [i for i, e in enumerate(out) if isinstance(e, FinishOut | ErrorOut)]
    outcome = session.outcome
    assert len(outcomes) == (0 if outcome is None else 1)
    silent = outcome is not None and outcome.status in ("cancelled", "timeout")
    if outcome is None or (silent and not any(isinstance(e, ErrorOut) for e in out)):
        assert terminals == []
    else:
        assert len(terminals) == 1
        assert terminals[0] == len(out) - 1, "nothing after the terminal"
    if outcome is not None and outcome.status == "success":
        assert isinstance(out[-1], FinishOut)
        assert out[-1].finish_reason == outcome.finish_reason


def sse_payloads(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing."""
    text = raw.decode()
    assert text == "" or text.endswith("\n\n"), "every frame ends with a blank line"
    payloads = []
    for frame in text.split("\n\n")[:-1]:
        assert frame.startswith("data: "), f"unexpected frame {frame!r}"
        assert "\n" not in frame, "one data line per frame"
        payloads.append(frame.removeprefix("data: "))
    return payloads


@given(
    cfg=session_settings(),
    events=st.lists(node_events, max_size=10),
    ending=endings,
    include_usage=st.booleans(),
    model=st.text(max_size=8),
)
def test_property_sse_rendering_is_valid(
    cfg: SessionSettings,
    events: list[NodeEvent],
    ending: str,
    include_usage: bool,
    model: str,
) -> None:
    """Any session renders as valid SSE: one data line per frame, each payload JSON or
    [DONE]; at most one [DONE], always last, present exactly on success; the non-streaming
    rendering of a successful session has the same content."""
    session = StreamSession(cfg)
    encoder = SSEEncoder("chatcmpl-" + RUN, 1, model, include_usage=include_usage)
    raw = encoder.encode(session.drain())
    out: list[OutEvent] = []
    for event in events:
        session.feed(event)
        batch = session.drain()
        out += batch
        raw += encoder.encode(batch)
    _end(session, ending)
    batch = session.drain()
    out += batch
    raw += encoder.encode(batch)

    payloads = sse_payloads(raw)
    assert payloads.count("[DONE]") <= 1
    success = session.outcome is not None and session.outcome.status == "success"
    assert ("[DONE]" in payloads) is success
    if success:
        assert payloads[-1] == "[DONE]"
    for payload in payloads:
        if payload != "[DONE]":
            chunk = json.loads(payload)
            assert isinstance(chunk, dict)
            assert set(chunk) == {"error"} or chunk["model"] == model
    if success:
        builder = ResponseBuilder()
        builder.add(out)
        message = builder.response("id", 1, model)["choices"][0]["message"]
        text = "".join(e.text for e in out if isinstance(e, ContentOut))
        assert message["content"] == (text if text or "tool_calls" not in message else None)


# --- bounded memory: what the session keeps ------------------------------------------

DELTA_64K = "x" * 65536  # ASCII: one byte a character


def _growth_after_deltas(cfg: SessionSettings, deltas: int = 32) -> int:
    """Bytes still allocated after feeding (and draining) `deltas` 64 KiB deltas."""
    session = StreamSession(cfg)
    session.drain()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(deltas):
            session.feed(Delta(DELTA_64K[:-1] + str(i % 10)))  # a new string each time
            session.drain()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "cfg",
    [conf(), conf(include_reasoning=False), conf(strict=True), conf(reasoning_parser="think")],
)
def test_streaming_session_keeps_no_copy_of_the_output(cfg: SessionSettings) -> None:
    """A streamed answer with no feature that reads it whole (no tools, no strict JSON, no
    stream_buffer) is not kept: 2 MiB through the session leaves well under 64 KiB behind."""
    assert _growth_after_deltas(cfg) < 64 * 1024


def test_tool_session_keeps_the_content_it_needs() -> None:
    """With tools declared the content is kept (tool calls are synthesized from it whole):
    the same 2 MiB leaves about that much behind, bounded by max_held_chars."""
    assert _growth_after_deltas(conf(tools=TOOLS)) >= 2 * 1024 * 1024


HELD_CAP = 1000


@pytest.mark.parametrize(
    "cfg",
    [
        conf(whole_output=True, max_held_chars=HELD_CAP),
        conf(tools=TOOLS, max_held_chars=HELD_CAP),
        conf(stream_buffer=True, max_held_chars=HELD_CAP),
        conf(strict=True, response_format={"type": "json_object"}, max_held_chars=HELD_CAP),
        conf(whole_output=True, reasoning_explicit=True, max_held_chars=HELD_CAP),
        conf(text_held=True, max_held_chars=HELD_CAP),
        conf(text_held=True, reasoning_explicit=True, max_held_chars=HELD_CAP),
    ],
    ids=[
        "non-stream",
        "tools",
        "stream_buffer",
        "strict-json",
        "non-stream-reasoning",
        "stream-text-held",
        "stream-text-held-reasoning",
    ],
)
def test_held_answer_past_the_cap_ends_with_output_too_large(cfg: SessionSettings) -> None:
    """An answer the edge must hold whole ends, once it passes max_held_chars, with exactly
    one terminal: an `output_too_large` error naming the limit; later events are ignored."""
    kind = ReasoningDelta if cfg.reasoning_explicit else Delta
    result = run([*(kind("y" * 300) for _ in range(10)), complete()], cfg)
    assert result.outcome is not None
    assert result.outcome.status == "error"
    assert result.outcome.error_type == "output_too_large"
    errors = [e for e in result.out if isinstance(e, ErrorOut)]
    assert len(errors) == 1
    assert result.out[-1] is errors[0]
    assert str(HELD_CAP) in errors[0].message
    assert not any(isinstance(e, FinishOut) for e in result.out)


def test_held_answer_within_the_cap_is_whole() -> None:
    """At the cap exactly, a held answer still completes, whole."""
    cfg = conf(whole_output=True, max_held_chars=HELD_CAP)
    result = run([Delta("z" * 500), Delta("z" * 500), complete()], cfg)
    assert result.outcome is not None
    assert result.outcome.status == "success"
    assert result.content == "z" * HELD_CAP


def test_streamed_answer_is_not_capped() -> None:
    """A streamed answer the edge does not hold has no size cap: it flows through."""
    result = run([*(Delta("y" * 300) for _ in range(10)), complete()], conf(max_held_chars=100))
    assert result.outcome is not None
    assert result.outcome.status == "success"
    assert result.content == "y" * 3000


def test_reasoning_fallback_quotes_at_most_the_cap() -> None:
    """Reasoning is kept for the reasoning-only fallback up to max_held_chars, not beyond:
    the stream still completes, quoting the first part."""
    cfg = conf(max_held_chars=HELD_CAP)
    result = run([*(ReasoningDelta("r" * 300) for _ in range(10)), complete()], cfg)
    assert result.outcome is not None
    assert result.outcome.status == "success"
    assert result.content.startswith(hidden_reasoning_fallback("stop"))
    assert 0 < result.content.count("r") <= HELD_CAP
