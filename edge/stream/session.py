"""The stream session: one chat completion's node events in, output events out.

A sans-IO state machine, one per stream. It owns
how each node event flows through the filters (sentinels, think blocks, tool
calls written as text) into content and reasoning, and the finish: the
answer's tool calls, the strict output check, the placeholder for a run that
only reasoned. What it keeps, how that is built, and its single terminal
(`finish`, `fail`, `refuse`, `fail_stream` or `cancel`) are its base's,
`edge.stream.sessionstate.SessionState`: once a terminal is reached, further
events are ignored and further terminal attempts are no-ops, by
construction. The decisions made once at the end are
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
from edge.stream.logprobs import MAX_LOGPROB_ENTRIES
from edge.stream.output import (
    ContentOut,
    FinishOut,
    LogprobContentOut,
    Outcome,
    OutEvent,
    ReasoningOut,
    Status,
    ToolCallsOut,
)
from edge.stream.sessionend import (
    hidden_reasoning_fallback,
    output_format_problem,
    reasoning_only_fallback,
    resolve_tool_calls,
)
from edge.stream.sessionsettings import (
    MAX_HELD_CHARS,
    OUTPUT_TOO_LARGE,
    SLICE_CHARS,
    SessionSettings,
)
from edge.stream.sessionstate import SessionState
from edge.stream.think import has_close_think, has_open_think


class StreamSession(SessionState):
    """One stream's state machine. Feed events; take output with `drain()`."""

    __slots__ = ()

    # --- the caller's interface -------------------------------------------------

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
            self._failed(event)
        elif type(event) is LogprobDelta:
            if self._lp is not None:  # else the caller did not ask: text only
                self._add_logprobs(event)  # anchored where they fall: the slices follow
            if self.outcome is None:
                self._on_delta(event.text)
        return self.outcome is not None or self._rest != ""

    # --- events -----------------------------------------------------------------

    def _failed(self, event: Failed) -> None:
        """The node's error or cancelled event: its failure, or its refusal (the node's
        status and words, for the caller) or overload (429), as its status says."""
        kind = failure_class(event.kind, event.http_status)
        if kind == "failed":
            self.fail(NodeFailedError.type, event.reason)
        else:
            error_type = RequestError.type if kind == "refused" else NodeRateLimitedError.type
            self.refuse(event.http_status, error_type, event.words, event.code)

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
            if self._holds_reasoning and self._hold(len(text)):
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
        tools = resolve_tool_calls(
            event, self.settings, self._tool_filter, self._content, self._emitted, self._lp
        )
        self._emit_pending(tools.pending)
        if tools.error is not None:  # a call is never silently dropped
            self.fail(ToolValidationError.type, tools.error)
            return
        self._violations = tools.violations
        calls = tools.calls
        if calls:
            finish_reason = "tool_calls"
        elif finish_reason == "tool_calls":  # the node said so, but no call is returned
            finish_reason = "stop"
        if not tools.native:
            self._reasoning_fallback(finish_reason)
        if self.settings.strict and not calls:
            problem = output_format_problem(self.settings.response_format, self._emitted)
            if problem is not None:
                self.fail(OutputValidationError.type, problem)
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
        said = event.metadata.get("stop_sequence", "")  # a node's word: kept only if it fits
        stop_sequence = said if len(said) <= MAX_STOP_CHARS else ""
        self.out.append(FinishOut(finish_reason, event.usage, finish.node_reason, stop_sequence))

    def _reasoning_fallback(self, finish_reason: str) -> None:
        """A run with reasoning but no visible answer: write a placeholder (never an
        empty completion), quoting the reasoning when the caller may see it."""
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


__all__ = [
    "MAX_HELD_CHARS",
    "OUTPUT_TOO_LARGE",
    "SLICE_CHARS",
    "SessionSettings",
    "Status",
    "StreamSession",
    "Usage",
]
