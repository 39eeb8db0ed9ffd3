"""No packet ends the edge: seeded malformed HTTP/1.1 and HTTP/2 against a real edge process.

A real `iop-edge` subprocess (API keys on) in front of a real `iop-sim-node`
gets 200 mutated HTTP/1.1 requests and 200 random HTTP/2 frame sequences
(tests/hostile), then the known one-packet triggers, one connection each,
32 at a time, while normal
authenticated streams run beside them. After every batch the edge must
still answer /healthz, and every normal stream must end with `data: [DONE]`.

When a batch ends the edge, its cases are sent again one at a time to a
fresh edge, and the failure names the first that ends it (seed, kind,
index, label, bytes). Replay:

    HOSTILE_FUZZ_SEED=N            another seed (default below)
    HOSTILE_FUZZ_CASE=h2:17        only that case (kind h1, h2 or trigger, index)
"""

from __future__ import annotations

import os
from pathlib import Path

import trio

from tests.chaos.attacks import Normal
from tests.chaos.procs import EdgeProcess, SimNode, healthz
from tests.hostile.cases import KEY, interleaved, make_case
from tests.hostile.triggers import triggers
from tests.hostile.wire import Case, send_case

SEED = int(os.environ.get("HOSTILE_FUZZ_SEED", "20261130"))
ONLY = os.environ.get("HOSTILE_FUZZ_CASE", "")
CASES_PER_KIND = 200  # h1 and h2 each
STREAM_WORKERS = 2
# Cases sent at once; the edge must still serve after each batch.
BATCH = 32
# How long a process that is going down may take to exit, once its socket closed.
EXIT_WAIT_S = 2.0
# Generous: the edge answers /healthz in milliseconds, but the machine may be busy.
HEALTHZ_LIMIT_S = 10.0
# Normal streams write a word every PACE_MS, so they are in flight while cases go in.
PACE_MS = 25


def all_cases(seed: int) -> list[Case]:
    if ONLY:
        kind, _, index = ONLY.partition(":")
        return [make_case(seed, kind, int(index), KEY)]
    return interleaved(seed, CASES_PER_KIND, KEY) + triggers()


async def _alive(edge: EdgeProcess) -> bool:
    """The process runs and answers /healthz (a process going down may still run a moment)."""
    if not edge.alive():
        return False
    if not await healthz(edge.port, HEALTHZ_LIMIT_S):
        return True
    assert edge.process is not None
    with trio.move_on_after(EXIT_WAIT_S):
        await edge.process.wait()
    return False


async def _culprit(batch: list[Case], workdir: Path, node: SimNode) -> tuple[Case, str]:
    """The first case of `batch` that ends a fresh edge when the batch's cases are sent to
    it one at a time; the batch's first case if none does, with a verdict saying so."""
    await trio.to_thread.run_sync(workdir.mkdir)
    edge = EdgeProcess(workdir, api_keys=(KEY,))
    await edge.start([node])
    try:
        for case in batch:
            await send_case(edge.port, case)
            if not await _alive(edge):
                code = edge.process.returncode if edge.process else None
                return case, (
                    f"sent one at a time to a fresh edge, this case ends it (exit code {code})"
                )
    finally:
        await edge.stop()
    names = ", ".join(f"{c.kind}:{c.index}" for c in batch)
    return batch[0], f"sent one at a time to a fresh edge, no case of {names} ends it; the first"


async def test_fuzzed_http1_and_http2_input_never_ends_the_edge(tmp_path: Path) -> None:
    """Malformed HTTP/1.1 and HTTP/2 cases, a batch at a time, while normal streams run:
    after each batch the edge still serves, and every normal stream ends with [DONE]."""
    node = SimNode("n0", tmp_path)
    edge = EdgeProcess(tmp_path, api_keys=(KEY,))
    cases = all_cases(SEED)
    dead_after: list[Case] = []
    sent = 0
    try:
        await node.start()
        await edge.start([node])
        streams = Normal(pace_ms=PACE_MS, only_streams=True)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            for w in range(STREAM_WORKERS):
                nursery.start_soon(streams.worker, edge, w, stop)
            for first in range(0, len(cases), BATCH):
                batch = cases[first : first + BATCH]
                async with trio.open_nursery() as senders:
                    for case in batch:
                        senders.start_soon(send_case, edge.port, case)
                sent += len(batch)
                if not await _alive(edge):
                    dead_after = batch
                    break
            stop.set()
        if dead_after:
            killer, verdict = await _culprit(dead_after, tmp_path / "replay", node)
            exit_code = edge.process.returncode if edge.process else None
            raise AssertionError(
                f"the edge exited (code {exit_code}) after {sent} of {len(cases)} cases; "
                f"seed {SEED}; {verdict}:\n{killer.show()}\n"
                f"replay: HOSTILE_FUZZ_SEED={SEED} HOSTILE_FUZZ_CASE={killer.kind}:{killer.index}"
                f" .venv/bin/python -m pytest -q tests/integration/test_hostile_fuzz_e2e.py\n"
                f"normal streams: {streams.done} ended with [DONE], "
                f"{sum(streams.errors.values())} did not, e.g. {streams.examples}\n"
                f"edge output (from its first traceback):\n{edge.log_tail()}"
            )
        assert not streams.errors, (streams.done, dict(streams.errors), streams.examples)
        assert streams.done, "no normal stream ran beside the fuzz"
    finally:
        await edge.stop()
        await node.stop()


def test_each_case_replays_alone_from_its_seed_kind_and_index() -> None:
    """The replay hint in a failure is enough: a case's bytes depend only on (seed, kind,
    index), not on the cases drawn before it."""
    cases = interleaved(SEED, CASES_PER_KIND, KEY) + triggers()
    for case in cases[::37]:
        again = make_case(SEED, case.kind, case.index, KEY)
        assert again.parts == case.parts, case.show(80)
    assert len({c.parts for c in cases}) > 0.95 * len(cases), "the generators repeat themselves"
