"""The cache hold over real processes: an edge in front of two simulated nodes of one
slot each (the edge holds the queue), cache_aware.

A queued request whose prompt one busy node holds passes up the other node's slot
when it frees, and runs on its own node once that one frees; with `cache_hold_s = 0`
it takes the first slot freed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.integration.conftest import SimProcess, named_sims, node_that_ran, script
from tests.integration.edgeproc import edge_process
from tests.integration.test_cacheaware_e2e import CHAT, WAIT_S, _conversation

NAMES = ("n1", "n2")


def _toml(nodes: tuple[SimProcess, ...], hold_s: float) -> str:
    listed = "".join(
        f'[[nodes]]\nname = "{name}"\naddress = "{node.address}"\nmax_runs = 1\n'
        for name, node in zip(NAMES, nodes, strict=True)
    )
    return (
        '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n'
        f'[routing]\npolicy = "cache_aware"\ncache_hold_s = {hold_s}\n' + listed
    )


def _request(group: int, *events: dict[str, Any]) -> dict[str, Any]:
    body = _conversation(group, script(*events))
    body["model"] = "sim-script"
    return body


ANSWER = ({"type": "delta", "delta": "ok"}, {"type": "complete"})
HANG = ({"type": "hang"},)


async def _readyz(http: httpx.AsyncClient) -> dict[str, Any]:
    answer = await http.get("/readyz")
    result: dict[str, Any] = answer.json()
    return result


async def _until(http: httpx.AsyncClient, ready: Any) -> dict[str, Any]:
    """/readyz once `ready(it)` holds (polled: another process's state, bounded)."""
    with trio.fail_after(WAIT_S):
        while True:
            if ready(state := await _readyz(http)):
                return state
            await trio.sleep(0.02)


def _in_flight(state: dict[str, Any]) -> dict[str, int]:
    return {n["name"]: n["in_flight"] for n in state["nodes"]}


@pytest.mark.parametrize("hold_s", [30.0, 0.0])
async def test_a_queued_request_waits_for_the_node_holding_its_prompt(
    tmp_path: Path, hold_s: float
) -> None:
    """Group 0's prompt on node A, both nodes busy (A with group 0, B with group 1), a
    request of group 0 queued. B frees first: with a hold, the request passes B's slot
    up (B idle, the request still queued), runs on A once A frees, and the edge counts
    a hold served; without one, it runs on B at once."""
    with named_sims(tmp_path, *NAMES) as nodes:
        async with (
            edge_process(tmp_path, _toml(nodes, hold_s)) as edge,
            httpx.AsyncClient(base_url=edge.url, timeout=WAIT_S) as http,
            trio.open_nursery() as nursery,
        ):
            first = await http.post(CHAT, json=_request(0, *ANSWER))
            assert first.status_code == 200, first.text
            a = await node_that_ran(NAMES, nodes, first)
            b = next(n for n in NAMES if n != a)
            hangs: dict[str, trio.CancelScope] = {}

            async def hang(group: int, node: str) -> None:
                with trio.CancelScope() as hangs[node]:
                    await http.post(CHAT, json=_request(group, *HANG))

            nursery.start_soon(hang, 0, a)  # a hit on A
            await _until(http, lambda s: _in_flight(s)[a] == 1)
            nursery.start_soon(hang, 1, b)  # A is full: B
            await _until(http, lambda s: _in_flight(s)[b] == 1)
            answers: list[httpx.Response] = []
            answered = trio.Event()

            async def queued() -> None:
                answers.append(await http.post(CHAT, json=_request(0, *ANSWER)))
                answered.set()

            nursery.start_soon(queued)
            await _until(http, lambda s: s["queue"]["depth"] == 1)
            hangs[b].cancel()  # its client gone: B's run ends, its slot is free
            if hold_s:
                state = await _until(http, lambda s: _in_flight(s)[b] == 0)
                assert state["queue"]["depth"] == 1  # B's slot passed up
                assert not answers
                hangs[a].cancel()
            with trio.fail_after(WAIT_S):
                await answered.wait()
            assert answers[0].status_code == 200, answers[0].text
            assert await node_that_ran(NAMES, nodes, answers[0]) == (a if hold_s else b)
            hangs[a].cancel()
            metrics = (await http.get("/metrics")).text
            served = 'iop_edge_cache_holds_total{outcome="served"} ' + ("1.0" if hold_s else "0.0")
            assert served in metrics
