"""How a stream's text flows from the node's deltas to the caller's chunks.

This module owns `TextFlow`: the filters one stream's text passes (sentinels,
think blocks, tool calls written as text, and their logprob-tracking kinds),
what is kept of the text (each accumulator present only when a feature reads
it), the counters, the cap on an answer held whole, and the end of the flow:
the filters' flush, the content held for validation, and the placeholder for
a run that only reasoned. It writes chunks, and the `output_too_large`
terminal, to the stream's `edge.stream.sessionout.SessionOut`.

It does not know the node's event types beyond logprobs, nor which terminal
the stream reaches or why; `edge.stream.session` decides that. Nor HTTP, SSE,
trio or gRPC.
"""

from __future__ import annotations

from edge.stream.events import LogprobDelta
from edge.stream.logprobs import MAX_LOGPROB_ENTRIES, LogprobTrack
from edge.stream.output import ContentOut, LogprobContentOut, ReasoningOut
from edge.stream.sentinel import SentinelFilter
from edge.stream.sessionend import hidden_reasoning_fallback, reasoning_only_fallback
from edge.stream.sessionout import SessionOut
from edge.stream.sessionsettings import OUTPUT_TOO_LARGE, SessionSettings
from edge.stream.think import ThinkSplitter, has_close_think, has_open_think
from edge.stream.tooltext import ToolTextFilter

__all__ = ["TextFlow"]


class TextFlow:
    """One stream's text through its filters into content and reasoning chunks.

    Read by the session at the end: `content` (the whole content, when tools
    are declared), `emitted` (what was written, for tool calls or strict JSON),
    `tool_filter`, `lp`, and the counters `content_chars` and `reasoning_chars`.
    """

    __slots__ = (
        "_content_seen",
        "_content_sentinel",
        "_expose_reasoning",
        "_held_chars",
        "_held_content",
        "_holds",
        "_holds_reasoning",
        "_out",
        "_reasoning",
        "_reasoning_seen",
        "_reasoning_sentinel",
        "_settings",
        "_think",
        "content",
        "content_chars",
        "emitted",
        "lp",
        "reasoning_chars",
        "tool_filter",
    )

    def __init__(self, settings: SessionSettings, out: SessionOut) -> None:
        self._settings = settings
        self._out = out
        self._expose_reasoning = settings.expose_reasoning
        # Text is kept only for a feature that reads it whole, and never twice
        # without one: the accumulators below are None when nothing needs them.
        tools = bool(settings.tools.tools)
        strict_json = settings.checks_format and (settings.response_format or {}).get("type") in (
            "json_object",
            "json_schema",
        )
        # The whole content: tool calls are synthesized from it.
        self.content: list[str] | None = [] if tools else None
        # What was written: for the unstreamed remainder of a tool-call answer,
        # and the strict response_format check.
        self.emitted: list[str] | None = [] if tools or strict_json else None
        # Reasoning, for the fallback that quotes it when no answer came; dropped
        # once content is seen (the fallback cannot happen any more).
        keep_reasoning = not settings.strict and settings.include_reasoning
        self._reasoning: list[str] | None = [] if keep_reasoning else None
        self.content_chars = 0
        self.reasoning_chars = 0
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
        # Present whenever tools are declared: under tool_choice "none" a call written
        # as text is still held back, never shown as content.
        self.tool_filter: ToolTextFilter | None = None
        if tools:
            self.tool_filter = ToolTextFilter(settings.tool_formats)
        # With logprobs the filters are their tracking kind (same output).
        self.lp: LogprobTrack | None = None
        if settings.logprobs:
            self.lp = LogprobTrack(
                settings.sentinels,
                think=self._think is not None,
                start_in_think=settings.reasoning_parser == "think_start",
                tool_formats=settings.tool_formats if self.tool_filter is not None else None,
                keep_all=settings.whole_output or settings.stream_buffer,
            )
            self._content_sentinel = self.lp.sentinel
            self._think = self.lp.think
            self.tool_filter = self.lp.tool

    # --- the node's text ----------------------------------------------------------

    def feed_content(self, source: str) -> None:
        """Content text as the node sent it (one slice at most)."""
        if not source:
            return
        text = self._content_sentinel.feed(source)
        if text:
            self._content_text(text, source)

    def feed_reasoning(self, source: str) -> None:
        """Reasoning text as the node sent it (one slice at most)."""
        if not source:
            return
        text = self._reasoning_sentinel.feed(source)
        if text:
            self._reasoning_text(text)

    def logprobs(self, event: LogprobDelta) -> None:
        """Anchor a delta's logprobs where its text falls (its slices follow); nothing
        when the caller did not ask for them."""
        if self.lp is None:
            return
        self.lp.add(len(event.text), event.logprobs)
        if self.lp.entries > MAX_LOGPROB_ENTRIES:
            self._let_go()
            self._out.fail(
                OUTPUT_TOO_LARGE,
                f"the answer's logprobs exceed the edge's limit of {MAX_LOGPROB_ENTRIES}"
                " entries (a token or one of its top_logprobs) held at once",
                self.reasoning_chars,
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
        self.content_chars += len(text)
        if not self._content_seen and not text.isspace():
            self._content_seen = True
            self._reasoning = None  # no fallback any more: stop keeping reasoning
        if self._holds and self._hold(len(text)):
            return
        if self.content is not None:
            self.content.append(text)
        shown = text
        if self.tool_filter is not None:
            shown = self.tool_filter.feed(text)
            if not shown:
                if self._out.trace is None:  # the hot path while tool text is held
                    return
                self._out.record(
                    "suppressed",
                    {
                        "type": "content",
                        "source_len": len(source),
                        "source_has_open_think": has_open_think(source),
                        "source_has_close_think": has_close_think(source),
                    },
                )
                return
        if self.emitted is not None:
            self.emitted.append(shown)
        self._write_content(shown, source, shown != source)

    def _reasoning_text(self, text: str) -> None:
        self.reasoning_chars += len(text)
        if not self._reasoning_seen and not text.isspace():
            self._reasoning_seen = True
        # The fallback quotes at most the first max_held_chars of reasoning.
        if self._reasoning is not None and self.reasoning_chars <= self._settings.max_held_chars:
            self._reasoning.append(text)
        if self._expose_reasoning:
            if self._holds_reasoning and self._hold(len(text)):
                return
            self._out.chunk("reasoning", len(text))
            self._out.events.append(ReasoningOut(text))

    def emit_pending(self, pending: str) -> None:
        """Write text the tool-text filter held back."""
        if pending:
            if self.emitted is not None:
                self.emitted.append(pending)
            self._write_content(pending, pending, False)

    def _write_content(
        self, text: str, source: str, filtered: bool, *, sourced: bool = True
    ) -> None:
        """Write content; `sourced` is False for text no node sent (it has no logprobs)."""
        out = self._out
        out.seq += 1
        if out.trace is not None:
            out.trace(
                "chunk",
                {
                    "run_id": self._settings.run_id,
                    "seq": out.seq,
                    "type": "content",
                    "len": len(text),
                    "source_len": len(source),
                    "filtered": filtered,
                    "source_has_open_think": has_open_think(source),
                    "source_has_close_think": has_close_think(source),
                },
            )
        chunk = ContentOut(text)
        if self.lp is not None:
            chunk = LogprobContentOut(text, self.lp.take(len(text)) if sourced else ())
        if self._held_content is not None:
            self._held_content.append(chunk)
        else:
            out.events.append(chunk)

    # --- the end of the text --------------------------------------------------------

    def flush(self) -> None:
        """The node's text is complete: write what the filters still hold."""
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

    def release_held(self) -> None:
        """The answer passed its checks: write the content held for them (stream_buffer)."""
        if self._held_content is not None:
            self._out.events.extend(chunk for chunk in self._held_content if chunk.text)
            self._held_content = None

    def fallback(self, finish_reason: str) -> None:
        """A run with reasoning but no visible answer: write a placeholder (never an
        empty completion), quoting the reasoning when the caller may see it."""
        settings = self._settings
        if settings.strict or self._content_seen or not self._reasoning_seen:
            return
        reasoning = "".join(self._reasoning or ())
        if settings.include_reasoning:
            text = reasoning_only_fallback(reasoning, finish_reason)
        else:
            text = hidden_reasoning_fallback(finish_reason)
        if self.emitted is not None:
            self.emitted.append(text)
        self._write_content(text, reasoning, False, sourced=False)

    # --- the cap on an answer held whole ----------------------------------------------

    def _hold(self, chars: int) -> bool:
        """Count `chars` more of an answer held whole; True (and the stream failed) past the cap.

        Past the cap everything kept is let go: the terminal is an error
        frame (or error response) naming the limit, never unbounded growth.
        """
        self._held_chars += chars
        if self._held_chars <= self._settings.max_held_chars:
            return False
        self._let_go()
        self._out.fail(
            OUTPUT_TOO_LARGE,
            f"the answer exceeds the edge's limit of {self._settings.max_held_chars} characters"
            " for an answer it must hold whole (a non-streaming answer, tool calls, strict"
            " output or a buffered stream)",
            self.reasoning_chars,
        )
        return True

    def _let_go(self) -> None:
        """Drop all text kept: the stream ends with `output_too_large`."""
        self.content = self.emitted = self._reasoning = self._held_content = None
