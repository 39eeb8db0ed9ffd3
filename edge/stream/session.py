"""The stream session: one chat completion's node events in, output events out.

A sans-IO state machine, one per stream. It owns how each node event is
applied (a long delta a slice at a time), and the finish: the answer's tool
calls, the strict output check, and which terminal the stream reaches. It
holds two parts: the text's way through the filters into content and
reasoning, with what is kept of it (`edge.stream.sessionflow.TextFlow`), and
the output with its single terminal (`edge.stream.sessionout.SessionOut`):
once a terminal is reached, further events are ignored and further terminal
attempts are no-ops, by construction. The decisions made once at the end are
`edge.stream.sessionend`'s; the settings, `edge.stream.sessionsettings`'s.

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

from typing import Any, Literal

from edge.errors import (
    NodeFailedError,
    NodeRateLimitedError,
    OutputValidationError,
    RequestError,
    ToolValidationError,
)
from edge.stream.bounds import MAX_STOP_CHARS
from edge.stream.events import (
    Complete,
    Delta,
    Failed,
    LogprobDelta,
    NodeEvent,
    ReasoningDelta,
    Usage,
    failure_class,
)
from edge.stream.finish import finish_of
from edge.stream.output import FinishOut, Outcome, OutEvent, Status, ToolCallsOut
from edge.stream.sessionend import output_format_problem, resolve_tool_calls
from edge.stream.sessionflow import TextFlow
from edge.stream.sessionout import SessionOut
from edge.stream.sessionsettings import (
    MAX_HELD_CHARS,
    OUTPUT_TOO_LARGE,
    SLICE_CHARS,
    SessionSettings,
    TraceFn,
)


class StreamSession:
    """One stream's state machine. Feed events; take output with `drain()`."""

    __slots__ = ("_flow", "_out", "_rest", "_rest_at", "_rest_reasoning", "_slice", "settings")

    def __init__(self, settings: SessionSettings, trace: TraceFn | None = None) -> None:
        if settings.slice_chars < 1:
            raise ValueError("slice_chars must be at least 1")
        self.settings = settings
        self._out = SessionOut(settings.run_id, trace if settings.trace else None)
        self._flow = TextFlow(settings, self._out)
        # The rest of a long delta, from `_rest_at` on, for `resume` ("": none), and
        # whether it is reasoning.
        self._slice = settings.slice_chars
        self._rest = ""
        self._rest_at = 0
        self._rest_reasoning = False

    # --- the caller's interface -------------------------------------------------

    @property
    def outcome(self) -> Outcome | None:
        """How the stream ended; None until its terminal."""
        return self._out.outcome

    @property
    def terminated(self) -> bool:
        return self._out.outcome is not None

    def drain(self) -> list[OutEvent]:
        """Take the output produced so far."""
        out = self._out
        events = out.events
        out.events = []
        return events

    @property
    def resuming(self) -> bool:
        """Whether part of a long delta waits for `resume` (feed nothing else before)."""
        return bool(self._rest) and self._out.outcome is None

    def resume(self) -> bool:
        """Apply the next slice of a long delta; True (as `feed`) while more is left or
        once the session has reached its terminal. A caller that bounds its steps calls
        it once a step while `resuming`."""
        rest, at, out = self._rest, self._rest_at, self._out
        if not rest or out.outcome is not None:
            self._rest = ""
            return out.outcome is not None
        end = at + self._slice
        if end >= len(rest):
            self._rest = ""
        else:
            self._rest_at = end
        piece = rest[at:end]
        if self._rest_reasoning:
            self._flow.feed_reasoning(piece)
        else:
            self._flow.feed_content(piece)
        return out.outcome is not None or self._rest != ""

    def feed(self, event: NodeEvent) -> bool:
        """Apply one node event; True once the session has reached its terminal, or when
        part of a long delta waits for `resume`: either way, feed nothing more now.

        (Fed anyway, the event comes after the rest of that delta, applied first.)"""
        out = self._out
        if out.outcome is not None:
            return True
        if self._rest:
            while self._rest and out.outcome is None:
                self.resume()
            if out.outcome is not None:
                return True
        if type(event) is Delta:  # `_apply`, written out: the hot path
            text = event.text
            if len(text) > self._slice:
                self._rest, self._rest_at, self._rest_reasoning = text, self._slice, False
                text = text[: self._slice]
            self._flow.feed_content(text)
        elif type(event) is ReasoningDelta:
            self._apply(event.text, True)
        elif type(event) is Complete:
            self._finish(event)
        elif type(event) is Failed:
            self._failed(event)
        elif type(event) is LogprobDelta:
            self._flow.logprobs(event)  # anchored where they fall: the slices follow
            if out.outcome is None:
                self._apply(event.text, False)
        return out.outcome is not None or self._rest != ""

    def _apply(self, text: str, reasoning: bool) -> None:
        """Apply a delta's text; past a slice, its first slice (the rest waits for `resume`)."""
        if len(text) > self._slice:
            self._rest, self._rest_at, self._rest_reasoning = text, self._slice, reasoning
            text = text[: self._slice]
        if reasoning:
            self._flow.feed_reasoning(text)
        else:
            self._flow.feed_content(text)

    # --- the terminals ------------------------------------------------------------

    def fail(self, error_type: str, message: str, *, node_finish_reason: str | None = None) -> None:
        """Terminal: an error frame, error metrics."""
        self._out.fail(error_type, message, self._flow.reasoning_chars, node_finish_reason)

    def refuse(self, status: int, error_type: str, message: str, code: str | None) -> None:
        """Terminal: the node refused the run (4xx, the request's fault) or was overloaded
        (429). An error frame (or response) with the node's status; no node error."""
        self._out.refuse(status, error_type, message, code, self._flow.reasoning_chars)

    def fail_stream(self, error_type: str, message: str) -> None:
        """Terminal: the run's event stream broke. An error frame, no usage sample."""
        self._out.fail_stream(error_type, message)

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
        self._out.cancel(status, notice, notice_type, self._flow.reasoning_chars)

    def log_fields(self) -> dict[str, Any]:
        """The closing record of the stream (its "stream closed" line)."""
        return {
            "run_id": self.settings.run_id,
            "strict_output": self.settings.strict,
            "strict_stream_buffer": self.settings.stream_buffer,
            "content_len": self._flow.content_chars,
            "reasoning_len": self._flow.reasoning_chars,
        }

    # --- the node's ends ----------------------------------------------------------

    def _failed(self, event: Failed) -> None:
        """The node's error or cancelled event: its failure, or its refusal (the node's
        status and words, for the caller) or overload (429), as its status says."""
        kind = failure_class(event.kind, event.http_status)
        if kind == "failed":
            self.fail(NodeFailedError.type, event.reason)
        else:
            error_type = RequestError.type if kind == "refused" else NodeRateLimitedError.type
            self.refuse(event.http_status, error_type, event.words, event.code)

    def _finish(self, event: Complete) -> None:
        """The node completed the run: the answer's tool calls and checks, then its
        finish (or the error that ends it instead)."""
        flow, out, settings = self._flow, self._out, self.settings
        flow.flush()
        if out.outcome is not None:  # what the flushes released passed the held-output cap
            return
        finish = finish_of(event.metadata.get("finish_reason"))
        if finish.reason is None:  # the node says the run did not finish: no answer
            self.fail(
                NodeFailedError.type,
                "the node ended the run without finishing it"
                f' (finish_reason "{finish.node_reason}")',
                node_finish_reason=finish.node_reason,
            )
            return
        tools = resolve_tool_calls(
            event, settings, flow.tool_filter, flow.content, flow.emitted, flow.lp
        )
        flow.emit_pending(tools.pending)
        if tools.error is not None:  # a call is never silently dropped
            self.fail(ToolValidationError.type, tools.error)
            return
        calls = tools.calls
        finish_reason = finish.reason
        if calls:
            finish_reason = "tool_calls"
        elif finish_reason == "tool_calls":  # the node said so, but no call is returned
            finish_reason = "stop"
        if not tools.native:
            flow.fallback(finish_reason)
        if settings.checks_format and not calls:
            problem = output_format_problem(settings.response_format, flow.emitted)
            if problem is not None:
                self.fail(OutputValidationError.type, problem)
                return
        flow.release_held()
        if calls:
            out.record("tool_calls", {"tool_call_count": len(calls)})
            out.events.append(ToolCallsOut(calls))
        reasoning_chars = flow.reasoning_chars
        out.claim(
            Outcome(
                "success",
                finish_reason=finish_reason,
                usage=event.usage,
                reasoning_chars=reasoning_chars,
                node_finish_reason=finish.node_reason,
                tool_violations=tools.violations,
            )
        )
        out.record(
            "done",
            {
                "finish_reason": finish_reason,
                "node_finish_reason": finish.node_reason,
                "content_len": flow.content_chars,
                "reasoning_len": reasoning_chars,
            },
        )
        said = event.metadata.get("stop_sequence", "")  # a node's word: kept only if it fits
        stop_sequence = said if len(said) <= MAX_STOP_CHARS else ""
        out.events.append(FinishOut(finish_reason, event.usage, finish.node_reason, stop_sequence))


__all__ = [
    "MAX_HELD_CHARS",
    "OUTPUT_TOO_LARGE",
    "SLICE_CHARS",
    "SessionSettings",
    "Status",
    "StreamSession",
    "Usage",
]
