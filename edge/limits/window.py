"""The pure logic of a key's limits: one fixed window, its verdict, its headers.

No I/O and no clock here: callers pass `now_ms` and keep the state where
they like (a dict, a shared file, a Redis hash; the Redis Lua script in
`edge.limits.redisstore` is this same logic, line for line).

The window is fixed, and anchored on the key's first request after the last
window ended, not on clock minutes: it lasts WINDOW_MS, counts requests as
they are admitted and tokens as their runs end, and then starts afresh. It
costs one small record per key (three integers), whatever the limit, so the
same record fits a Redis hash, a slot of a shared file and a dict; its
counts are exact (the 11th request of an rpm = 10 window is refused, not
estimated), and its reset is exact too. The price: a client may burst up to
twice a limit across the end of one window and the start of the next.

A request is refused when the window already holds `rpm` requests or `tpm`
tokens, or the key holds `max_streams` requests in flight. Refused requests
are not counted. A request is admitted before its body is read (so a key
over its limits costs no parse); one whose model the key may not use is
refunded once that is known. Tokens are known only when a run ends, so a window may go
past `tpm` by one run's tokens; the next request then waits for the reset.
"""

from __future__ import annotations

from dataclasses import dataclass

# One minute: rpm and tpm are per minute.
WINDOW_MS = 60_000

OVER = ("requests", "tokens", "streams")


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits; None: no limit of that kind."""

    rpm: int | None = None
    tpm: int | None = None
    max_streams: int | None = None


@dataclass(slots=True)
class Window:
    """A key's counters in its current window (start_ms < 0: no window yet)."""

    start_ms: int = -1
    requests: int = 0
    tokens: int = 0

    def roll(self, now_ms: int) -> None:
        """Start a new window when there is none or the last one is over."""
        if self.start_ms < 0 or now_ms >= self.start_ms + WINDOW_MS or now_ms < self.start_ms:
            self.start_ms = now_ms
            self.requests = 0
            self.tokens = 0

    def reset_ms(self, now_ms: int) -> int:
        return max(0, self.start_ms + WINDOW_MS - now_ms)


@dataclass(frozen=True, slots=True)
class Decision:
    """A request's verdict and the counts after it.

    `over` is None when admitted, else which limit refused it. `requests`
    counts the window's admitted requests (this one included), `tokens` its
    tokens, `streams` the key's requests in flight (this one included).
    """

    over: str | None
    requests: int
    tokens: int
    streams: int
    reset_ms: int

    @property
    def admitted(self) -> bool:
        return self.over is None


def admit(window: Window, streams: int, limits: Limits, now_ms: int) -> Decision:
    """Admit one request (counting it in `window`) or say which limit refuses it.

    `streams` is the key's requests in flight before this one; the caller
    adds one when admitted (and `limits.max_streams` is set).
    """
    window.roll(now_ms)
    over: str | None = None
    if limits.rpm is not None and window.requests >= limits.rpm:
        over = "requests"
    elif limits.tpm is not None and window.tokens >= limits.tpm:
        over = "tokens"
    elif limits.max_streams is not None and streams >= limits.max_streams:
        over = "streams"
    else:
        window.requests += 1
        if limits.max_streams is not None:
            streams += 1
    return Decision(over, window.requests, window.tokens, streams, window.reset_ms(now_ms))


def refund(window: Window, now_ms: int) -> None:
    """Take back one admitted request that turned out not to count (a model outside the
    key's allow-list, known only once the body is parsed), if its window still runs."""
    if window.start_ms >= 0 and window.start_ms <= now_ms < window.start_ms + WINDOW_MS:
        window.requests = max(0, window.requests - 1)


def add_tokens(window: Window, tokens: int, now_ms: int) -> None:
    """Count a run's tokens in the window it ended in."""
    window.roll(now_ms)
    window.tokens += max(0, tokens)


def duration_text(ms: int) -> str:
    """A reset as OpenAI writes it: "250ms", "1s", "1.5s", "6m0s", "1m30.5s"."""
    ms = max(0, ms)
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def retry_after_s(decision: Decision) -> int:
    """Whole seconds before a refused request may succeed (Retry-After).

    A full window or token budget frees up at the reset; a stream slot when
    some request ends, which nobody can tell: one second.
    """
    if decision.over == "streams":
        return 1
    return max(1, -(-decision.reset_ms // 1000))


def rate_headers(limits: Limits, decision: Decision) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the limits the key has (rpm, tpm)."""
    headers: dict[str, str] = {}
    reset = duration_text(decision.reset_ms)
    if limits.rpm is not None:
        headers["x-ratelimit-limit-requests"] = str(limits.rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, limits.rpm - decision.requests))
        headers["x-ratelimit-reset-requests"] = reset
    if limits.tpm is not None:
        headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, limits.tpm - decision.tokens))
        headers["x-ratelimit-reset-tokens"] = reset
    return headers
