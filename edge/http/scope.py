"""One chat request's scope: its answer, its one count and log line, its span.

The app opens a `ChatScope` around each chat request's whole HTTP cycle, in
the request's own task (`edge.http.app`): the handler, the response head and
the body's iteration all run inside it, and so inside the request's answer
(`edge.fleet.answer.Answer`, `serve`), which owns its runs: they are ended
when the cycle ends, however it ends (body done, client gone, connection
cut), including the window in which the handler has returned and quart has
not begun the body.

`finish` is the one place a chat request is counted
(`iop_edge_requests_total`) and logged, exactly once (a run the node may
have seen as `chat completion <status>`, with its run id and node), whatever
way it ended, from the run that answers it (`Answer.run`; an attempt given
up for another node is not the request's outcome): the handler and the body
call `settled` once that run's outcome is fixed (before the answer's last
byte, so a client that read the whole answer finds it counted), and the app
calls `finish` when the cycle ends, from the HTTP status sent then (an error
status: "error"; none: "cancelled"). It also observes what users chart per
model, node and API (request duration, queue time, time per output token),
and, with tracing on, holds the request's span (`trace`, an
`edge.http.spans.RequestTrace`; None when tracing is off, and then nothing
of it costs anything), which the answer's journal fills when it ends.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar

import trio
from loguru import logger

from edge.api.surfaces import APIS, CHAT_PATH
from edge.fleet.answer import Answer
from edge.fleet.run import OutcomeHook, Run
from edge.http.spans import RequestTrace
from edge.observe.metrics import EdgeMetrics
from edge.stream.output import Outcome

__all__ = ["CHAT_PATH", "CURRENT", "ChatScope"]


class ChatScope:
    """The scope of one chat request's HTTP cycle (see the module doc)."""

    __slots__ = (
        "_finished",
        "_metrics",
        "_on_outcome",
        "_started",
        "answer",
        "http_status",
        "key",
        "model",
        "path",
        "request_id",
        "stream",
        "tier",
        "trace",
    )

    def __init__(
        self, metrics: EdgeMetrics, on_outcome: OutcomeHook | None = None, path: str = CHAT_PATH
    ) -> None:
        self._metrics = metrics
        self.path = path  # which API: chat completions, responses or messages
        self._on_outcome = on_outcome
        self._started = time.perf_counter()
        self._finished = False
        self.answer = Answer()
        self.request_id = ""
        self.model = "unknown"  # a label: set only to a model the nodes serve
        self.stream = False
        self.http_status = 0  # the status sent; 0 while none was
        self.trace: RequestTrace | None = None  # its span, when tracing is on
        self.key = ""  # its API key's name, when it has one
        self.tier = ""  # its service tier, once known

    @property
    def api(self) -> str:
        """The API the request came in by, as the metrics' `api` label says it."""
        return APIS[self.path].name

    @property
    def run(self) -> Run | None:
        """The run whose outcome is the request's (None: none answers it yet)."""
        return self.answer.run

    @asynccontextmanager
    async def serve(self) -> AsyncIterator[Answer]:
        """Around the request's cycle, in its task: the request's answer. A run still
        going when the cycle ends is ended by the answer; the request is counted then,
        before the answer lets its runs go."""
        async with self.answer.serve() as answer:
            answer.at_end(self.settled)  # the first given: called after the runs end
            yield answer

    @property
    def node_metadata(self) -> dict[str, str] | None:
        """What goes with each Run call: the trace context (None: tracing is off)."""
        return None if self.trace is None else self.trace.node_metadata

    def end_trace(self) -> None:
        """The request's cycle is over: its span (if any) ends, with its outcome."""
        if self.trace is not None:
            answer = self.answer
            self.trace.end(self.http_status, answer.run, answer.attempts, answer.journal)

    def settled(self) -> None:
        """Count and log the request now if the run that answers it has its outcome."""
        if self.answer.outcome is not None:
            self.finish()

    def finish(self) -> None:
        """Count and log the request, once; the outcome hook sees each run's outcome."""
        if self._finished:
            return
        self._finished = True
        run = self.answer.run
        outcome = run.outcome if run is not None else None
        if run is None or outcome is None:
            status = "error" if self.http_status >= 400 else "cancelled"
            self._metrics.requests.labels(
                self.model, "none", "true" if self.stream else "false", status, self.api
            ).inc()
            self._log_request(self.http_status)
            return
        info = run.info
        metrics = self._metrics
        metrics.request(info.model, info.node, info.stream, outcome, self.api)
        if run.reached_node:
            labels = (info.model, info.node, self.api)
            metrics.request_duration.labels(*labels).observe(time.perf_counter() - self._started)
            metrics.request_queue.labels(*labels).observe(self.answer.queue_s)
            usage, first = outcome.usage, run.reader.first_event_at
            tokens = usage.output_tokens if usage is not None and outcome.status == "success" else 0
            if first is not None and tokens > 1:
                per_token = (trio.current_time() - first) / (tokens - 1)
                metrics.time_per_output_token.labels(*labels).observe(per_token)
        if run.start_error is not None and not run.reached_node:
            # Its status is the error's (answered next); the run's warning says why.
            self._log_request(run.start_error.status)
        else:
            duration = trio.current_time() - info.started_at
            logger.bind(
                request_id=info.request_id, run_id=info.run_id, model=info.model,
                node=info.node, stream=info.stream, status=outcome.status,
                finish_reason=outcome.finish_reason, error_type=outcome.error_type,
                node_finish_reason=outcome.node_finish_reason, path=self.path,
                duration_ms=round(duration * 1000, 2), key=self.key, tier=self.tier,
            ).info("chat completion {}", outcome.status)  # fmt: skip
        _log_violations(info.request_id, info.run_id, info.model, outcome)
        if self._on_outcome is not None:
            self._on_outcome(info, outcome)

    def _log_request(self, status: int) -> None:
        """The line of a request that ran nothing (one shed among them, with its key and
        tier): its status (0: the client left first)."""
        logger.bind(
            request_id=self.request_id, method="POST", path=self.path, status=status,
            duration_ms=round((time.perf_counter() - self._started) * 1000, 2), key=self.key,
            tier=self.tier,
        ).info("POST {} {}", self.path, status or "(client left)")  # fmt: skip


# A called tool's name is model output: logged up to this many characters.
_LOGGED_TOOL_CHARS = 64


def _log_violations(request_id: str, run_id: str, model: str, outcome: Outcome) -> None:
    """One line per violation a returned call made (report mode): rule and tool, never
    the arguments (the message may quote their values, so it is not logged)."""
    for violation in outcome.tool_violations:
        logger.bind(
            request_id=request_id, run_id=run_id, model=model, rule=violation.rule,
            tool=violation.tool[:_LOGGED_TOOL_CHARS],
        ).warning("tool call violation reported: {}", violation.rule)  # fmt: skip


# The scope of the chat request the current task serves (None: not a chat request).
CURRENT: ContextVar[ChatScope | None] = ContextVar("iop_chat_scope", default=None)
