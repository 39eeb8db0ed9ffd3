"""The simulated node's KV cache model over real gRPC to a node process
(`iop-sim-node --kv-tokens ...`): cached tokens in a run's usage, the blocks a
watcher is told of, the prefill time of uncached tokens, the decode pace.

The runs carry made-up fingerprints (`prefix_blocks`, `prompt_chars`), as the
edge would send them. Orderings and counts are asserted, never a duration;
the only timing bound is a lower one (a paced run takes at least its tokens'
time, whatever the machine).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio
from grpclib.client import Channel
from grpclib.const import Cardinality

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import BLOCK_TOKENS, PREFIX_BLOCK_CHARS
from edge.contract.routes import RUN_ROUTE, WATCH_ROUTE
from edge.node.bridge import asyncio_loop, call_asyncio
from tests.integration.conftest import SimProcess, script, start_sim, stop_process

WAIT_S = 20.0
T = TypeVar("T")
# The node of these tests: 8 blocks of cache, 1 ms of prefill per uncached token.
CAPACITY_BLOCKS = 8
PREFILL_US = 1000
KV_FLAGS = ("--kv-tokens", "4096", "--prefill-us-per-token", str(PREFILL_US))


def _channel(address: str) -> Channel:
    host, port = address.rsplit(":", 1)
    return Channel(host, int(port))


async def _on_node(
    tmp_path: Path,
    name: str,
    flags: tuple[str, ...],
    scenario: Callable[..., Awaitable[T]],
    *args: Any,
) -> T:
    """`scenario(address, *args)` on the asyncio loop, against a node process started
    with `flags` (bounded in time); the node is stopped whatever happens."""
    node = await trio.to_thread.run_sync(start_sim, tmp_path, name, *flags)
    try:
        async with asyncio_loop():
            with trio.fail_after(WAIT_S * 3):
                return await call_asyncio(scenario, node.address, *args)
    finally:
        await trio.to_thread.run_sync(stop_process, node.process)


def _request(
    run_id: str, blocks: list[int], *, model: str = "sim-echo", text: str = "hi", chars: int = 0
) -> pb.RunRequest:
    """A run whose prompt is `blocks` whole blocks (and `chars` more characters)."""
    return pb.RunRequest(
        run_id=run_id,
        model=model,
        messages=[pb.Message(role="user", content=text)],
        prefix_blocks=blocks,
        prompt_chars=len(blocks) * PREFIX_BLOCK_CHARS + chars,
    )


async def _usage(stub: pb.NodeServiceStub, request: pb.RunRequest) -> pb.Usage:
    """Play a run to its end; its complete event's usage."""
    async with asyncio.timeout(WAIT_S):
        events = [event async for event in stub.run(request)]
    assert events[-1].type == "complete", events[-1]
    return events[-1].usage


class Watcher:
    """A Watch stream whose reports are applied, as the edge's index would: a snapshot
    replaces the set, otherwise stored blocks are added, then evicted ones removed."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.held: set[int] = set()
        self.reports: list[pb.DescribeResponse] = []
        self.evicted: set[int] = set()

    async def next(self) -> pb.DescribeResponse:
        async with asyncio.timeout(WAIT_S):
            report: pb.DescribeResponse | None = await self.stream.recv_message()
        assert report is not None
        self.reports.append(report)
        if report.kv_blocks_snapshot:
            self.held = set(report.kv_blocks_stored)
        else:
            self.held.update(report.kv_blocks_stored)
            self.held.difference_update(report.kv_blocks_evicted)
            self.evicted.update(report.kv_blocks_evicted)
        return report

    async def until(self, ready: Callable[[Watcher], bool]) -> None:
        while not ready(self):
            await self.next()


@contextlib.asynccontextmanager
async def _watching(address: str) -> AsyncIterator[Watcher]:
    channel = _channel(address)
    try:
        stream = channel.request(
            WATCH_ROUTE, Cardinality.UNARY_STREAM, pb.WatchRequest, pb.DescribeResponse
        )
        async with stream:
            await stream.send_message(pb.WatchRequest(heartbeat_ms=100), end=True)
            try:
                yield Watcher(stream)
            finally:
                channel.close()
    finally:
        channel.close()


async def _cache_scenario(address: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    channel = _channel(address)
    stub = pb.NodeServiceStub(channel)
    try:
        async with _watching(address) as watcher:
            first = await watcher.next()
            seen["first"] = (
                first.kv_blocks_snapshot,
                list(first.kv_blocks_stored),
                first.kv_cache_tokens,
                first.kv_cache_used_tokens,
            )
            # An older edge: no prompt_chars, so no caching, whatever the blocks (first: the
            # blocks of its own it frees are evicted before a's).
            older = pb.RunRequest(
                run_id="old", model="sim-echo", prefix_blocks=[101, 102],
                messages=[pb.Message(role="user", content="x" * 400)],
            )  # fmt: skip
            seen["older"] = await _usage(stub, older)
            a = [101, 102, 103, 104]
            seen["a1"] = await _usage(stub, _request("a1", a, chars=10))
            seen["a2"] = await _usage(stub, _request("a2", a, chars=10))
            # A script without usage gets the model's; one with its own keeps it.
            plain = script({"type": "delta", "delta": "ok"}, {"type": "complete"})
            seen["script"] = await _usage(
                stub, _request("s1", a, model="sim-script", text=plain, chars=10)
            )
            own = script({"type": "complete", "usage": {"input_tokens": 7}})
            seen["own"] = await _usage(stub, _request("s2", a, model="sim-script", text=own))
            await watcher.until(lambda w: w.held >= set(a))
            seen["snapshots"] = sum(r.kv_blocks_snapshot for r in watcher.reports)
            # Five new blocks and one of b's own (its partial block) into a cache of eight
            # whose free queue holds, least recently freed first, the blocks of their own
            # the runs before freed and a's blocks, last to first: those four, then a's two
            # last blocks go.
            b = [201, 202, 203, 204, 205]
            seen["b"] = await _usage(stub, _request("b", b))
            await watcher.until(lambda w: w.held >= set(b))
            seen["held"] = set(watcher.held)
            seen["evicted"] = set(watcher.evicted)
            seen["snapshots_after"] = sum(r.kv_blocks_snapshot for r in watcher.reports)
            # Once b is over, its report says the cache full of blocks (7 held, and b's own
            # block, free) and none of it in use: no run is in flight (bounded: the
            # scenario's fail_after).
            await watcher.until(lambda w: w.reports[-1].kv_cache_used_tokens == 0)
            seen["used_when_idle"] = (len(watcher.held), watcher.reports[-1].kv_cache_tokens)
            seen["a_again"] = await _usage(stub, _request("a3", a))
        return seen
    finally:
        channel.close()


async def test_a_repeated_prefix_is_cached_and_a_watcher_sees_its_blocks_come_and_go(
    tmp_path: Path,
) -> None:
    """On a node with --kv-tokens (8 blocks): a run's usage says its prompt tokens and, on
    its second time, the cached ones; a script's complete gets the same unless it gives
    its own usage; an older edge's run (no prompt_chars) counts its messages, uncached. A
    watcher's first report is a snapshot (empty), then the run's blocks arrive as stored;
    a run of five new blocks and one of its own evicts the blocks of their own earlier
    runs freed (each run's partial block and answer, freed before the first run's blocks
    were last freed), then the first run's two last blocks (ends of chains first), which
    the next run of the first prefix then misses."""
    flags = (
        "--kv-tokens",
        str(CAPACITY_BLOCKS * BLOCK_TOKENS + 10),
        "--prefill-us-per-token",
        "10",
    )
    seen = await _on_node(tmp_path, "kv", flags, _cache_scenario)
    prompt_tokens = (4 * PREFIX_BLOCK_CHARS + 10) // 4
    assert seen["first"] == (True, [], CAPACITY_BLOCKS * BLOCK_TOKENS, 0)
    assert (seen["a1"].input_tokens, seen["a1"].cached_input_tokens) == (prompt_tokens, 0)
    assert (seen["a2"].input_tokens, seen["a2"].cached_input_tokens) == (
        prompt_tokens,
        4 * BLOCK_TOKENS,
    )
    assert seen["a2"].output_tokens == 1
    assert (seen["script"].input_tokens, seen["script"].cached_input_tokens) == (
        prompt_tokens,
        4 * BLOCK_TOKENS,
    )
    assert (seen["own"].input_tokens, seen["own"].cached_input_tokens) == (7, 0)
    assert (seen["older"].input_tokens, seen["older"].cached_input_tokens) == (100, 0)
    assert seen["snapshots"] == 1
    assert (seen["b"].input_tokens, seen["b"].cached_input_tokens) == (5 * BLOCK_TOKENS, 0)
    assert seen["held"] == {101, 102, 201, 202, 203, 204, 205}
    assert seen["evicted"] == {103, 104}
    assert seen["snapshots_after"] == 1
    assert seen["used_when_idle"] == (CAPACITY_BLOCKS - 1, CAPACITY_BLOCKS * BLOCK_TOKENS)
    assert seen["a_again"].cached_input_tokens == 2 * BLOCK_TOKENS


async def _prefill_scenario(address: str) -> dict[str, Any]:
    """A long uncached run accepted first, a cached one after it: which speaks first."""
    seen: dict[str, Any] = {}
    channel = _channel(address)
    stub = pb.NodeServiceStub(channel)
    order: list[str] = []
    accepted = asyncio.Event()

    async def long_run(request: pb.RunRequest) -> None:
        route = (RUN_ROUTE, Cardinality.UNARY_STREAM, pb.RunRequest, pb.RunEvent)
        async with channel.request(*route) as stream:
            await stream.send_message(request, end=True)
            await stream.recv_initial_metadata()  # accepted: its prefill begins
            accepted.set()
            await stream.recv_message()
            order.append("long")

    try:
        warm = [301, 302]
        await _usage(stub, _request("warm", warm))
        # 3,564 uncached tokens at 1 ms each: 3.5 s of prefill (it is cancelled long before),
        # 56 blocks in a cache of 64, beside warm's 3.
        long = asyncio.create_task(long_run(_request("long", [401], chars=14_000)))
        try:
            async with asyncio.timeout(WAIT_S):
                await accepted.wait()
            seen["cached"] = await _usage(stub, _request("cached", warm))
            order.append("cached")
            seen["order"] = list(order)
        finally:
            long.cancel()
            await asyncio.gather(long, return_exceptions=True)
        return seen
    finally:
        channel.close()


async def test_an_uncached_prompts_prefill_delays_its_first_event_past_a_cached_ones(
    tmp_path: Path,
) -> None:
    """With --prefill-us-per-token, a run of 3,564 uncached tokens started first is still
    in its prefill when a run whose prompt is all cached, started after it, has ended."""
    seen = await _on_node(tmp_path, "kv", KV_FLAGS, _prefill_scenario)
    assert seen["cached"].cached_input_tokens == seen["cached"].input_tokens == 2 * BLOCK_TOKENS
    assert seen["order"] == ["cached"]


# The shared prefix's prefill in the test below: 4 blocks and 2,500 tokens more at 1 ms a
# token, long enough for a watcher's report (every 100 ms) to come well before it ends.
SHARED_PREFILL_S = (4 * BLOCK_TOKENS + 2_500) * PREFILL_US / 1e6


async def _shared_prefill_scenario(address: str) -> dict[str, Any]:
    """A run with a new prefix, and a run with the same prefix started once a watcher was
    told of its blocks: what each saw, and when."""
    seen: dict[str, Any] = {}
    channel = _channel(address)
    stub = pb.NodeServiceStub(channel)
    loop = asyncio.get_running_loop()
    prefix = [601, 602, 603, 604]
    first: dict[str, float] = {}

    async def play(name: str, request: pb.RunRequest) -> None:
        async for event in stub.run(request):
            first.setdefault(name, loop.time())
            if event.type == "complete":
                seen[name] = event.usage

    try:
        async with _watching(address) as watcher:
            await watcher.next()
            started = loop.time()
            a = asyncio.create_task(play("a", _request("a", prefix, chars=10_000)))
            try:
                async with asyncio.timeout(WAIT_S):
                    await watcher.until(lambda w: w.held >= set(prefix))
                    seen["a_spoke_before_its_blocks_were_told"] = "a" in first
                    await play("b", _request("b", prefix, chars=10))
                    await a
            finally:
                a.cancel()
                await asyncio.gather(a, return_exceptions=True)
        seen["b_first_after_s"] = first["b"] - started
        return seen
    finally:
        channel.close()


async def test_a_prefix_is_stored_when_its_prefill_starts_and_shared_once_computed(
    tmp_path: Path,
) -> None:
    """A run's blocks are stored (and told to watchers) when its prefill starts, as vLLM
    commits a step's blocks when it schedules it: a run with the same prefix that comes
    meanwhile counts them as cached, and its first event waits until they are computed
    (a lower bound only: the first run's prefill time)."""
    seen = await _on_node(tmp_path, "kv", KV_FLAGS, _shared_prefill_scenario)
    assert seen["a_spoke_before_its_blocks_were_told"] is False
    assert seen["a"].cached_input_tokens == 0
    assert seen["b"].cached_input_tokens == 4 * BLOCK_TOKENS
    assert seen["b_first_after_s"] >= SHARED_PREFILL_S


async def _queued_behind_prefill(address: str) -> tuple[int, int | None, bool]:
    """On a node that plays one run at a time: a long prefill accepted, then a cached run;
    the load once the second one waits, and whether it was accepted by then."""
    channel = _channel(address)
    stub = pb.NodeServiceStub(channel)
    route = (RUN_ROUTE, Cardinality.UNARY_STREAM, pb.RunRequest, pb.RunEvent)
    accepted = {"long": asyncio.Event(), "next": asyncio.Event()}

    async def run(name: str, request: pb.RunRequest) -> None:
        async with channel.request(*route) as stream:
            await stream.send_message(request, end=True)
            await stream.recv_initial_metadata()
            accepted[name].set()
            await stream.recv_message()

    tasks = [asyncio.create_task(run("long", _request("long", [501], chars=100_000)))]
    try:
        async with asyncio.timeout(WAIT_S):
            await accepted["long"].wait()
            tasks.append(asyncio.create_task(run("next", _request("next", []))))
            while (described := await stub.describe(pb.DescribeRequest())).waiting_runs != 1:  # noqa: ASYNC110 - another process's state
                await asyncio.sleep(0.01)
        return described.active_runs, described.waiting_runs, accepted["next"].is_set()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        channel.close()


async def test_a_prefill_holds_the_runs_place_so_the_queue_waits(tmp_path: Path) -> None:
    """With --max-runs 1, a run in its prefill holds the node's one place: a run that comes
    next waits in the queue, not accepted (as a GPU busy with a prefill)."""
    seen = await _on_node(tmp_path, "kv", (*KV_FLAGS, "--max-runs", "1"), _queued_behind_prefill)
    assert seen == (1, 1, False)


async def _paced(address: str, words: int) -> tuple[float, int]:
    channel = _channel(address)
    stub = pb.NodeServiceStub(channel)
    request = pb.RunRequest(
        run_id="paced",
        model="sim-echo",
        messages=[pb.Message(role="user", content=" ".join(["w"] * words))],
    )
    try:
        loop = asyncio.get_running_loop()
        deltas = 0
        first = 0.0
        async with asyncio.timeout(WAIT_S):
            async for event in stub.run(request):
                if event.type == "delta":
                    deltas += 1
                    if deltas == 1:
                        first = loop.time()
        return loop.time() - first, deltas
    finally:
        channel.close()


async def test_deltas_are_paced_at_the_decode_rate(tmp_path: Path) -> None:
    """With --decode-tokens-per-s 100, 21 one-token deltas take at least 20 tokens' time
    (0.2 s) from the first to the end: a lower bound, whatever the machine's speed."""
    flags = ("--decode-tokens-per-s", "100")
    elapsed, deltas = await _on_node(tmp_path, "paced", flags, _paced, 21)
    assert deltas == 21
    assert elapsed >= 0.19


async def test_a_node_without_the_cache_model_reports_no_cache(sim: SimProcess) -> None:
    """Without --kv-tokens, Describe and Watch leave the KV fields unset and send no
    blocks, and a run's usage is as before (no cached tokens)."""

    async def main() -> tuple[pb.DescribeResponse, pb.Usage]:
        async with _watching(sim.address) as watcher:
            report = await watcher.next()
        channel = _channel(sim.address)
        try:
            usage = await _usage(pb.NodeServiceStub(channel), _request("nokv", [1, 2, 3]))
        finally:
            channel.close()
        return report, usage

    async with asyncio_loop():
        with trio.fail_after(WAIT_S):
            report, usage = await call_asyncio(main)
    assert (report.kv_cache_tokens, report.kv_cache_used_tokens) == (None, None)
    assert (list(report.kv_blocks_stored), report.kv_blocks_snapshot) == ([], False)
    assert usage.cached_input_tokens == 0


async def _no_reports_scenario(address: str) -> dict[str, Any]:
    """A run of two blocks twice under a watcher; what the watcher was told."""
    channel = _channel(address)
    stub = pb.NodeServiceStub(channel)
    try:
        async with _watching(address) as watcher:
            await watcher.next()
            blocks = [701, 702]
            first = await _usage(stub, _request("r1", blocks))
            second = await _usage(stub, _request("r2", blocks))
            # Reports until one says no run is in flight: the runs' changes were reported.
            await watcher.next()
            await watcher.until(lambda w: w.reports[-1].kv_cache_used_tokens == 0)
        return {"usage": (first, second), "reports": watcher.reports}
    finally:
        channel.close()


async def test_a_node_without_kv_reports_caches_but_tells_no_blocks(tmp_path: Path) -> None:
    """With --no-kv-reports the cache model runs (a repeated prefix is cached, its prefill
    skipped) and Describe and Watch say its capacity and use, but no report carries a
    block, stored, evicted or as a snapshot: the edge keeps an approximate index of it."""
    flags = (*KV_FLAGS, "--no-kv-reports")
    seen = await _on_node(tmp_path, "noreports", flags, _no_reports_scenario)
    first, second = seen["usage"]
    assert (first.cached_input_tokens, second.cached_input_tokens) == (0, 2 * BLOCK_TOKENS)
    reports = seen["reports"]
    assert all(r.kv_cache_tokens == 4096 for r in reports)
    assert not any(r.kv_blocks_snapshot for r in reports)
    assert [b for r in reports for b in [*r.kv_blocks_stored, *r.kv_blocks_evicted]] == []
