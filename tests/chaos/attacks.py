"""The hostile mix's attacks and its normal traffic, each a task that runs until cancelled.

Every attack talks to the edge under test (an `EdgeProcess`, whose port can
change when the mix restarts it) over real sockets, bounded in count and
time, and tallies what it saw in a `Tally`; `one_packet` alone ends on its
own (UNTIMED). The normal traffic checks its
own answers: a stream must end with `data: [DONE]` and carry the echoed
text, a non-streamed answer must be a completion with it.
"""

from __future__ import annotations

import json
import math
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from tests.chaos.procs import EdgeProcess, SimNode
from tests.hostile import payloads
from tests.hostile.cases import KEY, KINDS, make_case
from tests.hostile.h2 import stalled_streams
from tests.hostile.triggers import triggers
from tests.hostile.wire import send_case

AUTH = {"Authorization": f"Bearer {KEY}"}
# A key over its rate limit at once (`THROTTLED_CONFIG`): every request of it gets a 429.
THROTTLED_KEY = "sk-hostile-throttled-0123456789"
THROTTLED_CONFIG = f"""
[[keys]]
name = "throttled"
key = "{THROTTLED_KEY}"
rpm = 1
"""
# No single request of the mix waits longer than this.
REQUEST_LIMIT_S = 20.0
# A stalled reader's receive buffer: small, so the answer waits in the edge, not the kernel.
STALLED_RCVBUF = 64 * 1024
# one_packet's outcome for a trigger after which the edge had to be restarted.
ENDED_THE_EDGE = "ended the edge"


@dataclass
class Tally:
    """What one task saw: outcomes by kind ("200", "400", "timeout", ...), and notes."""

    outcomes: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def show(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.outcomes.most_common()) or "nothing sent"


@dataclass(frozen=True, slots=True)
class Sizes:
    """How hard each attack pushes."""

    conns: int = 2000
    stalled: int = 200
    stalled_deltas: int = 400  # 64 KiB each: 25 MiB per answer
    tools: int = 2000
    brace_lines: int = 4000
    redos_a: int = 30
    h2_conns: int = 8
    h2_streams: int = 100  # per connection (the edge's HTTP/2 limit)
    throttled: int = 4  # clients of the throttled key sending 4 MB bodies at once
    seed: int = 1234


@dataclass
class Target:
    """The edge under attack, its nodes (to restart it on), and the attacks' sizes."""

    edge: EdgeProcess
    nodes: list[SimNode]
    sizes: Sizes

    async def restart(self) -> None:
        await self.edge.stop()
        await self.edge.start(self.nodes)


Attack = Callable[[Target, Tally], Awaitable[None]]


def _client(edge: EdgeProcess) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=edge.url, headers=AUTH, timeout=REQUEST_LIMIT_S)


async def _post(edge: EdgeProcess, body: dict[str, Any], tally: Tally) -> None:
    """One authenticated POST read to its end; its status (or failure) goes into `tally`,
    also when the phase ends while it waits ("unanswered at the end")."""
    outcome = "unanswered at the end"
    try:
        with trio.move_on_after(REQUEST_LIMIT_S) as scope:
            try:
                async with (
                    _client(edge) as client,
                    client.stream("POST", "/v1/chat/completions", json=body) as response,
                ):
                    async for _ in response.aiter_bytes():
                        pass
                    outcome = str(response.status_code)
            except httpx.HTTPError as exc:
                outcome = type(exc).__name__
        if scope.cancelled_caught:
            outcome = f"no answer within {REQUEST_LIMIT_S:g}s"
    finally:
        tally.outcomes[outcome] += 1


async def _post_raw(
    edge: EdgeProcess, path: str, data: bytes, tally: Tally, key: str = KEY
) -> None:
    """One POST of ready bytes (bodies a dict cannot hold: nesting past the recursion
    limit); its status (or failure) goes into `tally`."""
    outcome = "unanswered at the end"
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    try:
        with trio.move_on_after(REQUEST_LIMIT_S) as scope:
            try:
                async with httpx.AsyncClient(base_url=edge.url, timeout=REQUEST_LIMIT_S) as c:
                    response = await c.post(path, content=data, headers=headers)
                    outcome = str(response.status_code)
            except httpx.HTTPError as exc:
                outcome = type(exc).__name__
        if scope.cancelled_caught:
            outcome = f"no answer within {REQUEST_LIMIT_S:g}s"
    finally:
        tally.outcomes[outcome] += 1


def _repeat(body: Callable[[], dict[str, Any]]) -> Attack:
    async def attack(t: Target, tally: Tally) -> None:
        while True:
            await _post(t.edge, body(), tally)
            await trio.sleep(0.05)

    return attack


async def redos(t: Target, tally: Tally) -> None:
    """A `^(a+)+$` pattern and a model argument that backtracks, again and again."""
    await _repeat(lambda: payloads.redos(t.sizes.redos_a))(t, tally)


async def tool_flood(t: Target, tally: Tally) -> None:
    """Requests declaring `sizes.tools` tools with distinct schemas."""
    body = payloads.tool_flood(t.sizes.tools)
    await _repeat(lambda: body)(t, tally)


async def brace_text(t: Target, tally: Tally) -> None:
    """Model text of thousands of `{` lines, one tool declared."""
    await _repeat(lambda: payloads.brace_lines(t.sizes.brace_lines))(t, tally)


async def conn_flood(t: Target, tally: Tally) -> None:
    """`sizes.conns` connections that send nothing, held open until cancelled."""
    held: list[trio.SocketStream] = []
    try:
        for _ in range(t.sizes.conns):
            try:
                held.append(await trio.open_tcp_stream("127.0.0.1", t.edge.port))
                tally.outcomes["opened"] += 1
            except OSError as exc:
                tally.outcomes[f"refused ({exc.errno})"] += 1
                await trio.sleep(0.01)
        await trio.sleep_forever()
    finally:
        for stream in held:
            stream.socket.close()


async def _stalled_one(edge: EdgeProcess, body: bytes, held: list[trio.socket.SocketType]) -> bool:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALLED_RCVBUF)
    held.append(sock)
    try:
        await sock.connect(("127.0.0.1", edge.port))
        await sock.send(body)
    except OSError:
        return False
    return True


async def stalled_readers(t: Target, tally: Tally) -> None:
    """`sizes.stalled` clients ask for a long answer of 64 KiB deltas and never read it."""
    data = json.dumps(payloads.big_answer(t.sizes.stalled_deltas)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    held: list[trio.socket.SocketType] = []
    try:
        for _ in range(t.sizes.stalled):
            ok = await _stalled_one(t.edge, head + data, held)
            tally.outcomes["stalled" if ok else "refused"] += 1
        await trio.sleep_forever()
    finally:
        for sock in held:
            sock.close()


async def fuzz(t: Target, tally: Tally) -> None:
    """Seeded malformed HTTP/1.1 and HTTP/2 cases, one after another (the fuzz test's)."""
    for i in range(100_000):
        case = make_case(t.sizes.seed, KINDS[i % 2], i // 2, KEY)
        sent = await send_case(t.edge.port, case)
        tally.outcomes[sent.ended] += 1
        if not t.edge.alive():
            tally.notes.append(
                f"the edge exited after {case.kind} case {case.index} ({case.label}); replay: "
                f"HOSTILE_FUZZ_SEED={t.sizes.seed} HOSTILE_FUZZ_CASE={case.kind}:{case.index}"
            )
            await trio.sleep_forever()


async def one_packet(t: Target, tally: Tally) -> None:
    """Each known one-packet trigger once; a trigger that ends the edge is noted, and the
    edge restarted for the next one. Returns when all were sent (UNTIMED)."""
    for case in triggers():
        await send_case(t.edge.port, case)
        with trio.move_on_after(2.0):
            while t.edge.alive():  # noqa: ASYNC110 - another process's exit, bounded
                await trio.sleep(0.05)
        if t.edge.alive():
            tally.outcomes["survived"] += 1
        else:
            tally.outcomes[ENDED_THE_EDGE] += 1
            code = t.edge.process.returncode if t.edge.process else None
            tally.notes.append(f"ended the edge (exit code {code}): {case.label}")
            await t.restart()


async def nested(t: Target, tally: Tally) -> None:
    """975 levels of `[` in each free-form field that reaches the node, in turn (all APIs):
    each must be refused, and give its node slot back."""
    for i in range(1_000_000):
        path, data = payloads.nested(i)
        await _post_raw(t.edge, path, data, tally)
        await trio.sleep(0.05)


async def big_bodies(t: Target, tally: Tally) -> None:
    """Bodies under every size limit that are costly to build a run from, in turn: ~150,000
    one-character content parts, 4 MB of tool-call history, 16,000 messages."""
    bodies = (payloads.tiny_parts(), payloads.tool_history(), payloads.many_messages())
    for i in range(1_000_000):
        await _post_raw(t.edge, "/v1/chat/completions", bodies[i % len(bodies)], tally)
        await trio.sleep(0.05)


async def log_flood(t: Target, tally: Tally) -> None:
    """Eight at once, again and again: a Responses body whose dropped hosted tool carries
    3.7 MB (the edge logs what it dropped)."""
    data = payloads.hosted_tool()

    async def one() -> None:
        while True:
            await _post_raw(t.edge, "/v1/responses", data, tally)

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(one)


async def big_delta(t: Target, tally: Tally) -> None:
    """A node answer whose one delta is 3.8 MB of `<` (the stream filters' worst case)."""
    await _repeat(payloads.big_delta)(t, tally)


async def script_numbers(t: Target, tally: Tally) -> None:
    """Scripts with numbers a node must refuse (`nan`, infinite, huge, negative sleeps and
    repeats): the node's timers must keep serving everyone else."""
    for i in range(1_000_000):
        await _post(t.edge, payloads.bad_script(i), tally)
        await trio.sleep(0.05)


async def h2_stalled(t: Target, tally: Tally) -> None:
    """`sizes.h2_conns` HTTP/2 connections of `sizes.h2_streams` streams each asking for a
    1 MiB answer, with a stream window of 0 that is never opened; held until cancelled."""
    data = json.dumps(payloads.big_answer(16)).encode()
    preface = stalled_streams(KEY, data, t.sizes.h2_streams)
    held: list[trio.SocketStream] = []
    try:
        for _ in range(t.sizes.h2_conns):
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", t.edge.port)
                held.append(stream)
                await stream.send_all(preface)
                tally.outcomes["opened"] += 1
            except (OSError, trio.BrokenResourceError) as exc:
                tally.outcomes[f"refused ({type(exc).__name__})"] += 1
        await trio.sleep_forever()
    finally:
        for stream in held:
            stream.socket.close()


async def throttled(t: Target, tally: Tally) -> None:
    """`sizes.throttled` clients of a key over its rate limit, each sending 4 MB bodies in
    a loop: every one a 429, and no other key slowed by them."""
    data = payloads.tool_history()

    async def one() -> None:
        while True:
            await _post_raw(t.edge, "/v1/chat/completions", data, tally, key=THROTTLED_KEY)

    async with trio.open_nursery() as nursery:
        for _ in range(t.sizes.throttled):
            nursery.start_soon(one)


# Attacks that end on their own and get the time they need (the others run until cancelled).
UNTIMED = frozenset({"one_packet"})
ATTACKS: dict[str, Attack] = {
    "conn_flood": conn_flood,
    "stalled_readers": stalled_readers,
    "tool_flood": tool_flood,
    "brace_text": brace_text,
    "redos": redos,
    "fuzz": fuzz,
    "one_packet": one_packet,
    "nested": nested,
    "big_bodies": big_bodies,
    "log_flood": log_flood,
    "big_delta": big_delta,
    "script_numbers": script_numbers,
    "h2_stalled": h2_stalled,
    "throttled": throttled,
}


@dataclass
class Normal:
    """The normal traffic beside the attacks: streamed and not (`only_streams`: streamed
    only), each answer checked; `pace_ms` spaces the words of an answer."""

    pace_ms: int = 0
    only_streams: bool = False
    done: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def fail(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if len(self.examples) < 5:
            self.examples.append(detail[:200])

    async def worker(
        self, edge: EdgeProcess, w: int, stop: trio.Event, *, requests: float = math.inf
    ) -> None:
        """Normal requests one after another until `stop` (or `requests` of them)."""
        i = 0
        while not stop.is_set() and i < requests:
            stream = self.only_streams or i % 2 == 0
            body, words = payloads.normal(w * 1_000_000 + i, stream=stream, pace_ms=self.pace_ms)
            i += 1
            try:
                with trio.move_on_after(REQUEST_LIMIT_S) as scope:
                    try:
                        async with _client(edge) as client:
                            problem = await (self._stream if stream else self._plain)(
                                client, body, words
                            )
                    except httpx.HTTPError as exc:
                        problem = f"{type(exc).__name__}: {exc}"
            except trio.Cancelled:
                self.fail("unanswered at the end", f"worker {w} request {i}: unanswered")
                raise
            if scope.cancelled_caught:
                problem = f"no answer within {REQUEST_LIMIT_S:g}s"
            if problem:
                self.fail(problem.split(":", 1)[0], f"worker {w} request {i}: {problem}")
            else:
                self.done += 1
            await trio.sleep(0.05)  # a dead edge fails fast: do not spin

    async def _stream(self, client: httpx.AsyncClient, body: dict[str, Any], words: str) -> str:
        payloads_seen: list[str] = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    payloads_seen.append(line[6:])
        if response.status_code != 200:
            return f"status {response.status_code}"
        if not payloads_seen or payloads_seen[-1] != "[DONE]":
            return f"stream without [DONE]: last {payloads_seen[-1:]!r}"
        content = "".join(
            (c.get("delta") or {}).get("content") or ""
            for p in payloads_seen[:-1]
            for c in json.loads(p).get("choices") or ()
        )
        return "" if content.split() == words.split() else f"content {content[:80]!r}"

    async def _plain(self, client: httpx.AsyncClient, body: dict[str, Any], words: str) -> str:
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            return f"status {response.status_code}: {response.text[:100]}"
        content = response.json()["choices"][0]["message"]["content"] or ""
        return "" if content.split() == words.split() else f"content {content[:80]!r}"
