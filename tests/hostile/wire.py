"""One hostile case and how it goes over a real socket to the edge.

A case is a few byte strings sent in order on one TCP connection; between
two parts the sender waits (bounded) for the edge to answer something, so a
part can land after the edge responded (DATA after a response, a byte after
an upgrade). What the edge answers is recorded, never judged here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import trio

# Between parts: wait for the edge's answer until it has been quiet QUIET_S (at most
# PART_WAIT_S); at the end, for its close (at most END_WAIT_S).
QUIET_S = 0.05
PART_WAIT_S = 0.2
END_WAIT_S = 0.2
_READ = 65536
# At most this many answer bytes are kept per case (the rest is read and dropped).
_KEEP = 256


@dataclass(frozen=True, slots=True)
class Case:
    """A generated input: `kind` (h1, h2, trigger), its `index`, a `label`, the parts."""

    kind: str
    index: int
    label: str
    parts: tuple[bytes, ...]

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.parts)

    def show(self, limit: int = 600) -> str:
        """The case for a failure message: label, then each part's bytes (cut at `limit`)."""
        out = [f"{self.kind} case {self.index} ({self.label}, {self.size} bytes)"]
        for i, part in enumerate(self.parts):
            text = repr(part[:limit]) + (
                f" ... (+{len(part) - limit} bytes)" if len(part) > limit else ""
            )
            out.append(f"  part {i}: {text}")
        return "\n".join(out)


@dataclass(slots=True)
class Sent:
    """What one case got back: the first answer bytes, and how the connection ended."""

    answer: bytes = b""
    ended: str = ""  # eof | open (still open when we left) | reset | refused


async def _drain(stream: trio.SocketStream, sent: Sent, wait_s: float, *, until_eof: bool) -> bool:
    """Read what the edge sends for up to `wait_s` (or, unless `until_eof`, until it has
    answered and then been quiet for QUIET_S); True once it closed the connection."""
    with trio.move_on_after(wait_s):
        got = False
        while True:
            with trio.move_on_after(QUIET_S if got and not until_eof else wait_s) as quiet:
                try:
                    data = await stream.receive_some(_READ)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    sent.ended = "reset"
                    return True
            if quiet.cancelled_caught:
                return False
            if not data:
                sent.ended = "eof"
                return True
            got = True
            if len(sent.answer) < _KEEP:
                sent.answer += data[: _KEEP - len(sent.answer)]
    return False


async def send_case(port: int, case: Case) -> Sent:
    """Send `case` to 127.0.0.1:`port`, then half-close and read until EOF (bounded)."""
    sent = Sent()
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        sent.ended = "refused"
        return sent
    try:
        for i, part in enumerate(case.parts):
            if i and await _drain(stream, sent, PART_WAIT_S, until_eof=False):
                return sent
            try:
                await stream.send_all(part)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                sent.ended = "reset"
                return sent
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await stream.send_eof()
        if not await _drain(stream, sent, END_WAIT_S, until_eof=True):
            sent.ended = "open"
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()
    return sent
