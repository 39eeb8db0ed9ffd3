"""What a run cut mid-answer leaves for the run that continues it: the answer so far
(`Delivered`), how the run broke (`Break`), and which ends may move (`failed_break`,
`stream_break`, `why_not`).

A run whose answer may move to another node (`edge.fleet.migration`) taps the
node events it feeds its session (`edge.fleet.run.Run.next_batch`): every
delta's and reasoning delta's text is kept here as the node sent it, before
any filter (text the session still holds back, a tool call's, included), so
the continuation is the model's own output exactly. What is kept is bounded
by what a continuation can carry (`Delivered.cap`: the nodes' gRPC message
limit less the request's bytes, and the session's cap on an answer it holds
whole); past it the parts are let go and the answer no longer moves
(`too_long`), the stream ends as it would have. Once its client stops reading
(the run's event buffer full: `stalled`), at most STALLED_CHARS are kept, and
past them the parts are let go too (`stalled`): a stalled stream would
otherwise hold everything written to it so far, for as long as its client
likes, and the process's backlog counts what one holds with that bound
(`edge.node.backlog.BEYOND_BUFFER`).

A run breaks after output when its stream broke or was reset, its node went
away, its node sent `cancelled` on its own (drained for shutdown), or it sent
an error event that is the node's failure (http_status 0, 408 or 5xx); a
refusal (4xx) or an overload (429) is the request's answer. Ends the edge
chose (the client left, a deadline, a slow reader, the edge's own drain) are
never breaks: the run's handle has a cause for them.

Pure: no I/O, no clock of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from edge.errors import EdgeError, NodeFailedError, NodeUnavailableError
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
from edge.stream.output import Outcome
from edge.stream.session import StreamSession

BreakReason = Literal["stream_broken", "node_gone", "node_drained", "error_event"]
# What is kept is reserved from the process's memory budget in steps of this many
# characters; small pieces are joined JOIN_PARTS at a time.
RESERVE_CHARS = 256 * 1024
# The most kept of an answer whose client stopped reading: its first reservation. A
# client that pauses and reads on (a tunnel, a laptop lid) keeps a short answer's way
# to move; a long answer nobody reads is not held twice for as long as its client likes.
STALLED_CHARS = RESERVE_CHARS
SMALL_CHARS = 4096
JOIN_PARTS = 256
# How a break after output ended (`iop_edge_migrations_total`'s `outcome`): migrated,
# or why not.
MIGRATION_OUTCOMES = (
    "migrated",
    "exhausted",
    "expired",
    "too_long",
    "stalled",
    "no_node",
    "failed",
)


@dataclass(frozen=True, slots=True)
class Break:
    """How a run broke after output, its session left open for a continuation.

    `event`: the node's error or cancelled event (None: the stream broke, with
    `error_type` and `message`). `end` gives the session the terminal the break
    would have given it; `outcome` is the run's own when its answer moves on.
    """

    reason: BreakReason
    event: Failed | None = None
    error_type: str = NodeFailedError.type
    message: str = ""

    def end(self, session: StreamSession) -> None:
        """The session's terminal, as without migration: an error frame."""
        if self.event is not None:
            session.feed(self.event)
        else:
            session.fail_stream(self.error_type, self.message)

    def outcome(self, reasoning_chars: int) -> Outcome:
        """The broken run's outcome when another run continues its answer: what `end`
        would have made it (the run's verdict, `error_event` or `stream_broken`)."""
        if self.event is not None:
            return Outcome(
                "error", error_type=NodeFailedError.type, reasoning_chars=reasoning_chars
            )
        return Outcome("error", error_type=self.error_type, usage_sample=False)


def failed_break(event: Failed) -> BreakReason | None:
    """The break a node's error or cancelled event makes; None: a refusal (4xx) or an
    overload (429), the answer to the request, never moved."""
    if failure_class(event.kind, event.http_status) != "failed":
        return None
    return "node_drained" if event.kind == "cancelled" else "error_event"


def stream_break(error: EdgeError | None) -> Break:
    """The break of a run whose events ended without a terminal (`error`: why, None: the
    stream closed without one)."""
    if error is None:
        return Break("stream_broken", message="the node's run ended without a terminal event")
    reason: BreakReason = (
        "node_gone" if isinstance(error, NodeUnavailableError) else "stream_broken"
    )
    return Break(reason, error_type=error.type, message=error.message)


def why_not(*, migrations_left: int, now: float, deadline: float, gone: str | None) -> str | None:
    """Why an answer that broke after output does not move (a MIGRATION_OUTCOMES value),
    before a node is looked for; None: it may. `gone`: why what was kept was let go."""
    if migrations_left <= 0:
        return "exhausted"
    if now >= deadline:
        return "expired"
    return gone


class _Parts:
    """Text kept in order, at about one byte a character: small pieces (a token each)
    are joined by JOIN_PARTS, a step of bounded work (JOIN_PARTS x SMALL_CHARS)."""

    __slots__ = ("joined", "small")

    def __init__(self) -> None:
        self.joined: list[str] = []
        self.small: list[str] = []

    def add(self, text: str) -> None:
        small = self.small
        if len(text) >= SMALL_CHARS:
            if small:
                self.joined.append("".join(small))
                small.clear()
            self.joined.append(text)
            return
        small.append(text)
        if len(small) >= JOIN_PARTS:
            self.joined.append("".join(small))
            small.clear()

    def all(self) -> list[str]:
        return [*self.joined, *self.small]


class Delivered:
    """The answer so far of one request, across its runs: the text of every delta and
    reasoning delta in order, and the output tokens they took (bounded: `cap`).

    Tokens: a node's usage comes with its terminal, which a broken run never sent,
    so a run's output tokens are counted here (a delta event one token, a logprob
    delta its tokens), unless its error event reported usage. The continuing
    node is told the answer's so far (`Continuation.output_tokens`) and, by the
    contract, counts them in its usage's output: its usage is the answer's. The
    input tokens a broken run reported (an error event's usage) are added to the
    continuing run's own (`summed`): usage sums the runs, input as each node
    reported it.
    """

    __slots__ = (
        "_past_cap",
        "_reasoning",
        "_reserve",
        "_reserved",
        "_text",
        "cap",
        "chars",
        "earlier_input",
        "earlier_tokens",
        "gone",
        "moves",
        "tokens",
    )

    def __init__(self, cap: int, reserve: Callable[[int], bool] | None = None) -> None:
        """`cap`: the most characters kept. `reserve(n)` is asked for each RESERVE_CHARS
        step of what is kept (the process's memory budget); False: no more is kept."""
        self.cap = cap
        self._reserve = reserve
        self._reserved = 0
        self._text = _Parts()
        self._reasoning = _Parts()
        self.chars = 0  # characters received, kept or not
        # Why the parts are let go (the answer cannot move): "too_long" past
        # `cap` or the budget, "stalled" past STALLED_CHARS once its client stopped
        # reading; None: kept.
        self.gone: str | None = "too_long" if cap <= 0 else None
        self._past_cap = "too_long"  # why, past `cap`
        # The run in flight's output tokens (reasoning among them), as counted.
        self.tokens = 0
        # The earlier runs': output tokens, and the input tokens they reported.
        self.earlier_tokens = 0
        self.earlier_input = 0
        self.moves = 0  # runs that continued the answer

    @property
    def output(self) -> bool:
        """Whether any output came (delta or reasoning text)."""
        return self.chars > 0

    def delta(self, text: str) -> None:
        """Keep a delta's text: `add` for the most common event, without `_keep`'s cap
        and reservation steps while the text fits the room already reserved."""
        if not text:
            return
        self.tokens += 1
        chars = self.chars + len(text)
        if self.gone is not None or chars > self._reserved or chars > self.cap:
            self._keep(text, self._text)  # counts `chars` itself
            return
        self.chars = chars
        self._text.add(text)

    def add(self, event: NodeEvent) -> None:
        """Keep a delta's or reasoning delta's text (other events: nothing)."""
        kind = type(event)
        if kind is Delta:
            assert isinstance(event, Delta)
            self.delta(event.text)
        elif kind is LogprobDelta:
            assert isinstance(event, LogprobDelta)
            self.tokens += len(event.logprobs) or bool(event.text)
            self._keep(event.text, self._text)
        elif kind is ReasoningDelta:
            assert isinstance(event, ReasoningDelta)
            if event.text:
                self.tokens += 1
                self._keep(event.text, self._reasoning)

    def _keep(self, text: str, parts: _Parts) -> None:
        if not text:
            return
        chars = self.chars = self.chars + len(text)
        if self.gone is not None:
            return
        if chars > self.cap:
            self._let_go(self._past_cap)
        elif chars > self._reserved and not self._more(chars):
            self._let_go("too_long")  # it cannot be sent
        else:
            parts.add(text)

    def stalled(self, cut: bool) -> None:
        """The client stopped reading (its run's event buffer is full, the node waits):
        at most STALLED_CHARS are kept from now on; past them (now or later) what is
        kept is let go, and the answer no longer moves. `cut`: the run was ended as
        a slow client's, and nothing is kept."""
        if self.gone is None and (cut or self.cap > STALLED_CHARS):
            self.cap, self._past_cap = min(self.cap, STALLED_CHARS), "stalled"
            if cut or self.chars > self.cap:
                self._let_go("stalled")

    def _let_go(self, why: str) -> None:
        self.gone = why
        self._text, self._reasoning = _Parts(), _Parts()

    def _more(self, chars: int) -> bool:
        """Room for `chars` characters kept, reserved in steps."""
        step = max(RESERVE_CHARS, chars - self._reserved)
        if self._reserve is not None and not self._reserve(step):
            return False
        self._reserved += step
        return True

    def broke(self, event: Failed | None) -> None:
        """The run in flight broke: its error event's usage, if it reported one, is its
        output tokens, and its input is counted."""
        usage = event.usage if event is not None else None
        if usage is not None:
            if usage.output_tokens:
                self.tokens = usage.output_tokens
            self.earlier_input += usage.input_tokens

    def parts(self) -> tuple[list[str], list[str]]:
        """The text and reasoning parts kept (joined off the loop, by the caller)."""
        return self._text.all(), self._reasoning.all()

    @property
    def output_tokens(self) -> int:
        """The answer's output tokens so far, every run's."""
        return self.earlier_tokens + self.tokens

    def moved(self) -> int:
        """A run continues the answer: its tokens so far are the earlier runs'; returns
        them (the continuation's `output_tokens`)."""
        self.earlier_tokens += self.tokens
        self.tokens = 0
        self.moves += 1
        return self.earlier_tokens

    def summed(self, event: Complete) -> Complete:
        """The continuing run's terminal, the input tokens the earlier runs reported added
        to its usage's (its output counts the whole answer's already: see the class
        doc); as it is without usage, earlier runs or input they reported."""
        usage = event.usage
        if usage is None or not self.moves or not self.earlier_input:
            return event
        total = Usage(
            input_tokens=usage.input_tokens + self.earlier_input,
            output_tokens=usage.output_tokens,
            reasoning_tokens=usage.reasoning_tokens,
            cached_input_tokens=usage.cached_input_tokens,
        )
        return Complete(total, event.metadata, event.tool_calls)
