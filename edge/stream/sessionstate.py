"""A stream session's state, how it is built, and its single terminal.

This module owns what one stream keeps (its accumulators, filters and
counters, each present only when a feature reads it), the one terminal
(`fail`, `refuse`, `fail_stream`, `cancel`: a second attempt is a no-op, by
construction), the cap on an answer held whole, and the trace records.
`SessionState` is the base of `edge.stream.session.StreamSession`, which
applies the node's events to this state: the per-delta path lives there, and
calls into this state (`_hold`, the trace records).

It does not know the node's events or how text flows through the filters;
nor HTTP, SSE, trio or gRPC.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from edge.stream.logprobs import LogprobTrack
from edge.stream.output import ContentOut, ErrorOut, Outcome, OutEvent, RoleOut
from edge.stream.sentinel import SentinelFilter
from edge.stream.sessionsettings import OUTPUT_TOO_LARGE, SessionSettings, TraceFn
from edge.stream.think import ThinkSplitter
from edge.stream.toolcall import Violation
from edge.stream.tooltext import ToolTextFilter

__all__ = ["SessionState"]


class SessionState:
    """One stream's state and its terminal; `StreamSession` feeds it events."""

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
        "_holds_reasoning",
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
        # Shown reasoning counts against max_held_chars only when the caller keeps it.
        self._holds_reasoning = settings.whole_output or settings.text_held
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

    # --- the terminals ------------------------------------------------------------

    @property
    def terminated(self) -> bool:
        return self.outcome is not None

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

    def refuse(self, status: int, error_type: str, message: str, code: str | None) -> None:
        """Terminal: the node refused the run (4xx, the request's fault) or was overloaded
        (429). An error frame (or response) with the node's status; no node error."""
        if self._terminate(
            Outcome(
                "error",
                error_type=error_type,
                reasoning_chars=self._reasoning_chars(),
                node_status=status,
            )
        ):
            self.out.append(ErrorOut(error_type, message, status, code))
            self._trace_event("error", {"error_type": error_type, "http_status": status})

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
        """The closing record of the stream (its "stream closed" line)."""
        return {
            "run_id": self.settings.run_id,
            "strict_output": self.settings.strict,
            "strict_stream_buffer": self.settings.stream_buffer,
            "content_len": self._content_chars,
            "reasoning_len": self._reasoning_chars(),
        }

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
