"""The stream session: one chat completion's node events in, output events out.

This is the seed's chat stream session as a sans-IO state machine. It owns
every accumulator of one stream (content, reasoning, emitted), its filters,
and its single terminal: `finish`, `fail`, `fail_stream` or `cancel`. Once a
terminal is reached, further events are ignored and further terminal
attempts are no-ops, by construction.

It knows nothing of HTTP, SSE bytes, trio or gRPC: the caller feeds
`edge.stream.events` values and drains `edge.stream.output` values.

A delta longer than `slice_chars` (64 Ki characters) is applied a slice at a
time: `feed` applies its first slice and says to stop there (it returns True),
and each `resume` applies the next, so a caller can bound the work of each
step (and let other work run between them) whatever a node sends in one
event. Every filter is split-invariant: the output is the one the whole
delta gives, in smaller chunks. A caller that feeds the next event instead
gets the rest applied first, in that one step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from edge.stream.events import (
    Complete,
    Delta,
    Failed,
    LogprobDelta,
    NodeEvent,
    ReasoningDelta,
    Usage,
)
from edge.stream.finish import finish_of
from edge.stream.logprobs import MAX_LOGPROB_ENTRIES, LogprobTrack
from edge.stream.output import (
    ContentOut,
    ErrorOut,
    FinishOut,
    LogprobContentOut,
    Outcome,
    OutEvent,
    ReasoningOut,
    RoleOut,
    Status,
    ToolCallsOut,
)
from edge.stream.sentinel import DEFAULT_SENTINELS, SentinelFilter
from edge.stream.think import ThinkSplitter, has_close_think, has_open_think
from edge.stream.toolcall import ToolCall, ToolPolicy, Violation
from edge.stream.toolcheck import check_tool_calls
from edge.stream.toolparse import DEFAULT_FORMATS
from edge.stream.toolparse import loads as strict_json
from edge.stream.tools import (
    parse_native_tool_calls,
    schema_error,
    synthesize_tool_calls,
    typed_native_tool_calls,
    unstreamed_remainder,
)
from edge.stream.tooltext import ToolTextFilter

TraceFn = Callable[[str, Mapping[str, Any]], None]

ReasoningParser = Literal["none", "think", "think_start"]

# Placeholders for a run that produced reasoning but no visible answer, keyed
# by finish_reason. The caller never receives an empty completion.
_HIDDEN_FALLBACK = {
    "length": "[The model reached its output limit while reasoning and produced no answer.]",
    "content_filter": "[The model's answer was withheld by a content filter.]",
}
_HIDDEN_FALLBACK_DEFAULT = "[The model produced reasoning but no answer.]"

# What a session may keep of an answer it must hold whole (non-streaming
# answers, tool calls from text, strict JSON output, stream_buffer), in
# characters of model text: past it the stream ends with `output_too_large`.
MAX_HELD_CHARS = 16 * 1024 * 1024
OUTPUT_TOO_LARGE = "output_too_large"
# The most characters of one delta applied in one step (`feed`, `resume`).
SLICE_CHARS = 64 * 1024


def hidden_reasoning_fallback(finish_reason: str) -> str:
    return _HIDDEN_FALLBACK.get(finish_reason, _HIDDEN_FALLBACK_DEFAULT)


def reasoning_only_fallback(reasoning: str, finish_reason: str) -> str:
    return f"{hidden_reasoning_fallback(finish_reason)}\n\nReasoning:\n{reasoning.strip()}"


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """Values resolved once at dispatch; they never change during the stream."""

    run_id: str
    strict: bool = False
    stream_buffer: bool = False
    include_reasoning: bool = True
    reasoning_explicit: bool = False
    trace: bool = False
    tools: ToolPolicy = field(default_factory=ToolPolicy)
    tool_formats: tuple[str, ...] = DEFAULT_FORMATS
    sentinels: tuple[str, ...] = DEFAULT_SENTINELS
    reasoning_parser: ReasoningParser = "none"
    # The request's response_format; checked on strict output.
    response_format: Mapping[str, Any] | None = None
    # The caller keeps every output event until the end (a non-streaming answer).
    whole_output: bool = False
    # The caller's renderer keeps the answer's text until the end although it streams
    # (a Responses stream repeats it in its done events): it counts against
    # max_held_chars like an answer held whole.
    text_held: bool = False
    max_held_chars: int = MAX_HELD_CHARS
    # The caller asked for logprobs: content chunks carry their tokens'
    # (`edge.stream.logprobs` has the rule for text the filters remove).
    logprobs: bool = False
    # A longer delta is applied in slices of this many characters (`resume`).
    slice_chars: int = SLICE_CHARS

    @property
    def expose_reasoning(self) -> bool:
        """Reasoning stays hidden on strict output unless the caller asked for it."""
        return self.include_reasoning and (not self.strict or self.reasoning_explicit)


class StreamSession:
    """One stream's state machine. Feed events; take output with `drain()`."""

    __slots__ = (
        "_content",
        "_content_chars",
        "_content_seen",
        "_content_sentinel",
        "_emitted",
        "_expose_reasoning",
        "_held_chars",
        "_held_content",
        "_holds",
        "_lp",
        "_reasoning",
        "_reasoning_chars_",
        "_reasoning_seen",
        "_reasoning_sentinel",
        "_rest",
        "_rest_at",
        "_rest_reasoning",
        "_slice",
        "_think",
        "_tool_filter",
        "_trace",
        "_trace_seq",
        "_violations",
        "out",
        "outcome",
        "settings",
    )

    def __init__(self, settings: SessionSettings, trace: TraceFn | None = None) -> None:
        self.settings = settings
        self.out: list[OutEvent] = [RoleOut()]
        self.outcome: Outcome | None = None
        self._expose_reasoning = settings.expose_reasoning
        self._trace = trace if settings.trace else None
        self._trace_seq = 0
        # The rest of a long delta, from `_rest_at` on, for `resume` ("": none), and
        # whether it is reasoning.
        if settings.slice_chars < 1:
            raise ValueError("slice_chars must be at least 1")
        self._slice = settings.slice_chars
        self._rest = ""
        self._rest_at = 0
        self._rest_reasoning = False
        # Text is kept only for a feature that reads it whole, and never twice
        # without one: the accumulators below are None when nothing needs them.
        tools = bool(settings.tools.tools)
        strict_json = settings.strict and (settings.response_format or {}).get("type") in (
            "json_object",
            "json_schema",
        )
        # The whole content: tool calls are synthesized from it.
        self._content: list[str] | None = [] if tools else None
        # What was written: for the unstreamed remainder of a tool-call answer,
        # and the strict response_format check.
        self._emitted: list[str] | None = [] if tools or strict_json else None
        # Reasoning, for the fallback that quotes it when no answer came; dropped
        # once content is seen (the fallback cannot happen any more).
        keep_reasoning = not settings.strict and settings.include_reasoning
        self._reasoning: list[str] | None = [] if keep_reasoning else None
        self._content_chars = 0
        self._reasoning_chars_ = 0
        self._content_seen = False  # any content that is not whitespace
        self._reasoning_seen = False
        # stream_buffer: content held until the whole output is validated.
        self._held_content: list[ContentOut] | None = [] if settings.stream_buffer else None
        # Whether this session (or its caller) holds the answer whole: then the
        # answer counts against max_held_chars.
        self._holds = (
            tools or strict_json or settings.stream_buffer or settings.whole_output
            or settings.text_held
        )  # fmt: skip
        self._held_chars = 0
        self._content_sentinel = SentinelFilter(settings.sentinels)
        self._reasoning_sentinel = SentinelFilter(settings.sentinels)
        self._think: ThinkSplitter | None = None
        if settings.reasoning_parser != "none":
            self._think = ThinkSplitter(start_in_think=settings.reasoning_parser == "think_start")
        # What returned calls break (report mode), for the outcome.
        self._violations: tuple[Violation, ...] = ()
        # Present whenever tools are declared: under tool_choice "none" a call written
        # as text is still held back, never shown as content.
        self._tool_filter: ToolTextFilter | None = None
        if settings.tools.tools:
            self._tool_filter = ToolTextFilter(settings.tool_formats)
        # With logprobs the filters are their tracking kind (same output).
        self._lp: LogprobTrack | None = None
        if settings.logprobs:
            self._lp = LogprobTrack(
                settings.sentinels,
                think=self._think is not None,
                start_in_think=settings.reasoning_parser == "think_start",
                tool_formats=settings.tool_formats if self._tool_filter is not None else None,
                keep_all=settings.whole_output or settings.stream_buffer,
            )
            self._content_sentinel = self._lp.sentinel
            self._think = self._lp.think
            self._tool_filter = self._lp.tool

    # --- the caller's interface -------------------------------------------------

    @property
    def terminated(self) -> bool:
        return self.outcome is not None

    def drain(self) -> list[OutEvent]:
        """Take the output produced so far."""
        out = self.out
        self.out = []
        return out

    @property
    def resuming(self) -> bool:
        """Whether part of a long delta waits for `resume` (feed nothing else before)."""
        return bool(self._rest) and self.outcome is None

    def resume(self) -> bool:
        """Apply the next slice of a long delta; True (as `feed`) while more is left or
        once the session has reached its terminal. A caller that bounds its steps calls
        it once a step while `resuming`."""
        rest, at = self._rest, self._rest_at
        if not rest or self.outcome is not None:
            self._rest = ""
            return self.outcome is not None
        end = at + self._slice
        if end >= len(rest):
            self._rest = ""
        else:
            self._rest_at = end
        piece = rest[at:end]
        if self._rest_reasoning:
            self._on_reasoning(piece)
        else:
            self._on_delta(piece)
        return self.outcome is not None or self._rest != ""

    def _slice_of(self, text: str, reasoning: bool) -> str:
        """The first slice of a long delta; the rest waits for `resume`."""
        self._rest, self._rest_at, self._rest_reasoning = text, self._slice, reasoning
        return text[: self._slice]

    def feed(self, event: NodeEvent) -> bool:
        """Apply one node event; True once the session has reached its terminal, or when
        part of a long delta waits for `resume`: either way, feed nothing more now.

        (Fed anyway, the event comes after the rest of that delta, applied first.)"""
        if self.outcome is not None:
            return True
        if self._rest:
            while self._rest and self.outcome is None:
                self.resume()
            if self.outcome is not None:
                return True
        if type(event) is Delta:
            self._on_delta(event.text)
        elif type(event) is ReasoningDelta:
            self._on_reasoning(event.text)
        elif type(event) is Complete:
            self._finish(event)
        elif type(event) is Failed:
            self.fail("run_error", event.reason)
        elif type(event) is LogprobDelta:
            if self._lp is not None:  # else the caller did not ask: text only
                self._add_logprobs(event)  # anchored where they fall: the slices follow
            if self.outcome is None:
                self._on_delta(event.text)
        return self.outcome is not None or self._rest != ""

    def fail(self, error_type: str, message: str, *, node_finish_reason: str | None = None) -> None:
        """Terminal: an error frame, error metrics."""
        if self._terminate(
            Outcome(
                "error",
                error_type=error_type,
                reasoning_chars=self._reasoning_chars(),
                node_finish_reason=node_finish_reason,
            )
        ):
            self.out.append(ErrorOut(error_type, message))
            self._trace_event("error", {"error_type": error_type})

    def fail_stream(self, error_type: str, message: str) -> None:
        """Terminal: the run's event stream broke. An error frame, no usage sample."""
        if self._terminate(Outcome("error", error_type=error_type, usage_sample=False)):
            self.out.append(ErrorOut(error_type, message))
            self._trace_event("error", {"error_type": error_type, "stream_broken": True})

    def cancel(
        self,
        status: Literal["cancelled", "timeout"],
        notice: str | None = None,
        *,
        notice_type: str = "timeout",
    ) -> None:
        """Terminal: the caller went away, the run timed out, or the edge is stopping.

        Nothing is written, except `notice` as an error frame (of type
        `notice_type`) for a caller that is still reading.
        """
        if self._terminate(Outcome(status, reasoning_chars=self._reasoning_chars())):
            if notice is not None:
                self.out.append(ErrorOut(notice_type, notice))
            self._trace_event("cancel", {"status": status})

    def log_fields(self) -> dict[str, Any]:
        """The closing record of the stream (the seed's "stream closed" line)."""
        return {
            "run_id": self.settings.run_id,
            "strict_output": self.settings.strict,
            "strict_stream_buffer": self.settings.stream_buffer,
            "content_len": self._content_chars,
            "reasoning_len": self._reasoning_chars(),
        }

    # --- events -----------------------------------------------------------------

    def _on_delta(self, source: str) -> None:
        if not source:
            return
        if len(source) > self._slice:
            source = self._slice_of(source, False)
        text = self._content_sentinel.feed(source)
        if text:
            self._content_text(text, source)

    def _add_logprobs(self, event: LogprobDelta) -> None:
        assert self._lp is not None
        self._lp.add(len(event.text), event.logprobs)
        if self._lp.entries > MAX_LOGPROB_ENTRIES:
            self._content = self._emitted = self._reasoning = self._held_content = None
            self.fail(
                OUTPUT_TOO_LARGE,
                f"the answer's logprobs exceed the edge's limit of {MAX_LOGPROB_ENTRIES}"
                " entries (a token or one of its top_logprobs) held at once",
            )

    def _content_text(self, text: str, source: str) -> None:
        """Sentinel-filtered content: split out think blocks, then emit."""
        if self._think is not None:
            content, reasoning = self._think.feed(text)
            if reasoning:
                self._reasoning_text(reasoning)
            if not content:
                return
            text = content
        self._visible(text, source)

    def _visible(self, text: str, source: str) -> None:
        self._content_chars += len(text)
        if not self._content_seen and not text.isspace():
            self._content_seen = True
            self._reasoning = None  # no fallback any more: stop keeping reasoning
        if self._holds and self._hold(len(text)):
            return
        if self._content is not None:
            self._content.append(text)
        shown = text
        if self._tool_filter is not None:
            shown = self._tool_filter.feed(text)
            if not shown:
                if self._trace is None:  # the hot path while tool text is held
                    return
                self._trace_event(
                    "suppressed",
                    {
                        "type": "content",
                        "source_len": len(source),
                        "source_has_open_think": has_open_think(source),
                        "source_has_close_think": has_close_think(source),
                    },
                )
                return
        if self._emitted is not None:
            self._emitted.append(shown)
        self._write_content(shown, source, shown != source)

    def _on_reasoning(self, source: str) -> None:
        if not source:
            return
        if len(source) > self._slice:
            source = self._slice_of(source, True)
        text = self._reasoning_sentinel.feed(source)
        if text:
            self._reasoning_text(text)

    def _reasoning_text(self, text: str) -> None:
        self._reasoning_chars_ += len(text)
        if not self._reasoning_seen and not text.isspace():
            self._reasoning_seen = True
        # The fallback quotes at most the first max_held_chars of reasoning.
        if self._reasoning is not None and self._reasoning_chars_ <= self.settings.max_held_chars:
            self._reasoning.append(text)
        if self._expose_reasoning:
            held = self.settings.whole_output or self.settings.text_held
            if held and self._hold(len(text)):
                return
            self._trace_seq += 1
            self._trace_chunk("reasoning", len(text))
            self.out.append(ReasoningOut(text))

    def _emit_pending(self, pending: str) -> None:
        """Emit text the tool-text filter held back."""
        if pending:
            if self._emitted is not None:
                self._emitted.append(pending)
            self._write_content(pending, pending, False)

    def _write_content(
        self, text: str, source: str, filtered: bool, *, sourced: bool = True
    ) -> None:
        """Write content; `sourced` is False for text no node sent (it has no logprobs)."""
        self._trace_seq += 1
        if self._trace is not None:
            self._trace(
                "chunk",
                {
                    "run_id": self.settings.run_id,
                    "seq": self._trace_seq,
                    "type": "content",
                    "len": len(text),
                    "source_len": len(source),
                    "filtered": filtered,
                    "source_has_open_think": has_open_think(source),
                    "source_has_close_think": has_close_think(source),
                },
            )
        chunk = ContentOut(text)
        if self._lp is not None:
            chunk = LogprobContentOut(text, self._lp.take(len(text)) if sourced else ())
        if self._held_content is not None:
            self._held_content.append(chunk)
        else:
            self.out.append(chunk)

    # --- finish -----------------------------------------------------------------

    def _finish(self, event: Complete) -> None:
        tail = self._content_sentinel.flush()
        if tail:
            self._content_text(tail, tail)
        if self._think is not None:
            content, reasoning = self._think.flush()
            if reasoning:
                self._reasoning_text(reasoning)
            if content:
                self._visible(content, content)
        tail = self._reasoning_sentinel.flush()
        if tail:
            self._reasoning_text(tail)
        if self.outcome is not None:  # what the flushes released passed the held-output cap
            return

        finish = finish_of(event.metadata.get("finish_reason"))
        if finish.reason is None:  # the node says the run did not finish: no answer
            self.fail(
                "run_error",
                "the node ended the run without finishing it"
                f' (finish_reason "{finish.node_reason}")',
                node_finish_reason=finish.node_reason,
            )
            return
        finish_reason = finish.reason
        calls, native = self._resolve_tool_calls(event)
        if self.outcome is not None:  # tool validation failed
            return
        if calls:
            finish_reason = "tool_calls"
        elif finish_reason == "tool_calls":  # the node said so, but no call is returned
            finish_reason = "stop"
        if not native:
            self._reasoning_fallback(finish_reason)
        if self.settings.strict and not calls:
            problem = self._check_output_format()
            if problem is not None:
                self.fail("output_validation_error", problem)
                return
        if self._held_content is not None:
            self.out.extend(chunk for chunk in self._held_content if chunk.text)
            self._held_content = None
        if calls:
            self._trace_event("tool_calls", {"tool_call_count": len(calls)})
            self.out.append(ToolCallsOut(calls))
        self._terminate(
            Outcome(
                "success",
                finish_reason=finish_reason,
                usage=event.usage,
                reasoning_chars=self._reasoning_chars(),
                node_finish_reason=finish.node_reason,
                tool_violations=self._violations,
            )
        )
        self._trace_event(
            "done",
            {
                "finish_reason": finish_reason,
                "node_finish_reason": finish.node_reason,
                "content_len": self._content_chars,
                "reasoning_len": self._reasoning_chars(),
            },
        )
        self.out.append(FinishOut(finish_reason, event.usage, finish.node_reason))

    def _resolve_tool_calls(self, event: Complete) -> tuple[tuple[ToolCall, ...], bool]:
        """The completion's tool calls and whether they were native.

        Native calls (typed, or JSON in an older node's metadata) win over
        text; otherwise calls are synthesized from the whole content when
        tools were declared. A validation failure (as the policy's mode says,
        `edge.stream.toolcheck`) ends the session (`fail`), and so does native
        metadata that cannot be read whole: a call is never silently dropped.
        What the calls returned break (report mode) is kept for the outcome.
        """
        policy = self.settings.tools
        run_id = self.settings.run_id
        native: tuple[ToolCall, ...] = ()
        parsed = None
        if event.tool_calls:
            parsed = typed_native_tool_calls(event.tool_calls, policy, run_id)
        elif raw_native := event.metadata.get("tool_calls"):  # a node older than the typed field
            parsed = parse_native_tool_calls(raw_native, policy, run_id)
        if parsed is not None:
            if parsed.errors:
                self.fail("tool_validation_error", parsed.errors[0])
                return (), True
            native = parsed.calls
        if native:
            if self._tool_filter is not None:
                self._emit_pending(self._tool_filter.flush_non_candidate())
            check = check_tool_calls(native, policy)
            if check.error is not None:
                self.fail("tool_validation_error", check.error)
            self._violations = check.violations
            return native, True
        if self._tool_filter is not None:
            assert self._content is not None  # kept whenever tools are declared
            assert self._emitted is not None
            result = synthesize_tool_calls(
                "".join(self._content), policy, run_id, self.settings.tool_formats
            )
            if result.error is not None:
                self.fail("tool_validation_error", result.error)
                return (), False
            self._violations = result.violations
            if result.calls:
                emitted = "".join(self._emitted)
                remainder = unstreamed_remainder(result.cleaned, emitted)
                if self._lp is not None and self._lp.tool is not None:
                    self._lp.tool.realign(remainder, "".join(self._content)[len(emitted) :])
                self._emit_pending(remainder)
                return result.calls, False
            self._emit_pending(self._tool_filter.flush())
        return (), False

    def _reasoning_fallback(self, finish_reason: str) -> None:
        if self.settings.strict or self._content_seen or not self._reasoning_seen:
            return
        reasoning = "".join(self._reasoning or ())
        if self.settings.include_reasoning:
            text = reasoning_only_fallback(reasoning, finish_reason)
        else:
            text = hidden_reasoning_fallback(finish_reason)
        if self._emitted is not None:
            self._emitted.append(text)
        self._write_content(text, reasoning, False, sourced=False)

    def _check_output_format(self) -> str | None:
        """Strict output: the content must honour the request's response_format."""
        fmt = self.settings.response_format
        if not fmt or fmt.get("type") not in ("json_object", "json_schema"):
            return None
        text = "".join(self._emitted or ())
        try:
            value = strict_json(text)
        except ValueError as exc:
            return f"response_format {fmt['type']}: the output is not valid JSON: {exc}"
        if fmt["type"] == "json_object" and not isinstance(value, dict):
            return "response_format json_object: the output is not a JSON object"
        schema = (fmt.get("json_schema") or {}).get("schema")
        if fmt["type"] == "json_schema" and isinstance(schema, dict):
            error = schema_error(schema, value)
            if error is not None:
                return f"response_format json_schema: {error}"
        return None

    # --- bookkeeping ------------------------------------------------------------

    def _terminate(self, outcome: Outcome) -> bool:
        """Claim the single terminal. False if one was already claimed."""
        if self.outcome is not None:
            return False
        self.outcome = outcome
        return True

    def _reasoning_chars(self) -> int:
        return self._reasoning_chars_

    def _hold(self, chars: int) -> bool:
        """Count `chars` more of an answer held whole; True (and the session failed) past the cap.

        Past the cap everything kept is let go: the terminal is an error
        frame (or error response) naming the limit, never unbounded growth.
        """
        self._held_chars += chars
        if self._held_chars <= self.settings.max_held_chars:
            return False
        self._content = self._emitted = self._reasoning = self._held_content = None
        self.fail(
            OUTPUT_TOO_LARGE,
            f"the answer exceeds the edge's limit of {self.settings.max_held_chars} characters"
            " for an answer it must hold whole (a non-streaming answer, tool calls, strict"
            " output or a buffered stream)",
        )
        return True

    def _trace_chunk(self, kind: str, length: int) -> None:
        if self._trace is not None:
            self._trace(
                "chunk",
                {
                    "run_id": self.settings.run_id,
                    "seq": self._trace_seq,
                    "type": kind,
                    "len": length,
                },
            )

    def _trace_event(self, what: str, fields: Mapping[str, Any]) -> None:
        if self._trace is not None:
            self._trace(
                what, {"run_id": self.settings.run_id, "seq": self._trace_seq + 1, **fields}
            )


__all__ = [
    "MAX_HELD_CHARS",
    "OUTPUT_TOO_LARGE",
    "SLICE_CHARS",
    "SessionSettings",
    "Status",
    "StreamSession",
    "Usage",
]
