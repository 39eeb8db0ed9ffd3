"""What a stream session writes: its output events, its single terminal, its trace.

This module owns `SessionOut`: the output events waiting for the caller's
`drain`, the one outcome (`fail`, `refuse`, `fail_stream`, `cancel` or a
success claimed with `claim`: a second attempt is a no-op, by construction),
and the trace records with their sequence number. `edge.stream.session` and
its text flow (`edge.stream.sessionflow`) both write here.

It does not know the node's events, the filters or the session's settings;
nor HTTP, SSE, trio or gRPC.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from edge.stream.output import ErrorOut, Outcome, OutEvent, RoleOut
from edge.stream.sessionsettings import TraceFn

__all__ = ["SessionOut"]


class SessionOut:
    """One stream's output events and outcome, and its trace records.

    `seq` counts the chunks written (the trace's sequence number); `trace` is
    the caller's hook, None when the settings leave trace off.
    """

    __slots__ = ("_run_id", "events", "outcome", "seq", "trace")

    def __init__(self, run_id: str, trace: TraceFn | None) -> None:
        self._run_id = run_id
        self.events: list[OutEvent] = [RoleOut()]
        self.outcome: Outcome | None = None
        self.trace = trace
        self.seq = 0

    def claim(self, outcome: Outcome) -> bool:
        """Claim the single terminal. False if one was already claimed."""
        if self.outcome is not None:
            return False
        self.outcome = outcome
        return True

    def fail(
        self,
        error_type: str,
        message: str,
        reasoning_chars: int,
        node_finish_reason: str | None = None,
    ) -> None:
        """Terminal: an error frame, error metrics."""
        if self.claim(
            Outcome(
                "error",
                error_type=error_type,
                reasoning_chars=reasoning_chars,
                node_finish_reason=node_finish_reason,
            )
        ):
            self.events.append(ErrorOut(error_type, message))
            self.record("error", {"error_type": error_type})

    def refuse(
        self, status: int, error_type: str, message: str, code: str | None, reasoning_chars: int
    ) -> None:
        """Terminal: the node refused the run (4xx) or was overloaded (429): an error
        frame (or response) with the node's status; no node error."""
        if self.claim(
            Outcome(
                "error", error_type=error_type, reasoning_chars=reasoning_chars, node_status=status
            )
        ):
            self.events.append(ErrorOut(error_type, message, status, code))
            self.record("error", {"error_type": error_type, "http_status": status})

    def fail_stream(self, error_type: str, message: str) -> None:
        """Terminal: the run's event stream broke. An error frame, no usage sample."""
        if self.claim(Outcome("error", error_type=error_type, usage_sample=False)):
            self.events.append(ErrorOut(error_type, message))
            self.record("error", {"error_type": error_type, "stream_broken": True})

    def cancel(
        self,
        status: Literal["cancelled", "timeout"],
        notice: str | None,
        notice_type: str,
        reasoning_chars: int,
    ) -> None:
        """Terminal: nothing is written, except `notice` as an error frame of type
        `notice_type`."""
        if self.claim(Outcome(status, reasoning_chars=reasoning_chars)):
            if notice is not None:
                self.events.append(ErrorOut(notice_type, notice))
            self.record("cancel", {"status": status})

    def chunk(self, kind: str, length: int) -> None:
        """Count one chunk written and, with a trace, record it."""
        self.seq += 1
        if self.trace is not None:
            self.trace(
                "chunk", {"run_id": self._run_id, "seq": self.seq, "type": kind, "len": length}
            )

    def record(self, what: str, fields: Mapping[str, Any]) -> None:
        """With a trace, record `what` (numbered as the next chunk would be)."""
        if self.trace is not None:
            self.trace(what, {"run_id": self._run_id, "seq": self.seq + 1, **fields})
