"""Nodes found by DNS, over real processes: an `iop-edge` whose `[[nodes]]` entry names a
DNS name (`discover`), real `iop-sim-node` processes as the nodes, and a small
authoritative DNS server in the test's loop (`tools.dnszone`, dnslib) whose records the
tests change while the edge serves.

What the edge knows of its nodes is read from its /metrics (`iop_edge_node_state`, one
series per node while it is in the pool) and its log; each wait is a bounded poll of
another process's state, never a sleep for timing.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import (
    SimProcess,
    chat_body,
    named_sims,
    poll,
    script,
    sse_content,
    sse_frames,
    stop_process,
)
from tests.integration.edgeproc import EdgeProcess, edge_process
from tools.dnszone import Zone, serve_zone

CHAT = "/v1/chat/completions"
COMPLETE = {"type": "complete", "metadata": {"finish_reason": "stop"}}
SRV_NAME = "_grpc._tcp.pool.test"
STATE = "iop_edge_node_state"
ERRORS = "iop_edge_discovery_errors_total"


def config(dns_port: int, discover: str, *, interval_s: float = 0.1, extra: str = "") -> str:
    """An edge whose one `[[nodes]]` entry, `pool`, finds its nodes at `discover`, asking
    the test's DNS server every `interval_s`."""
    return (
        '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\nnode_refresh_s = 0.2\n'
        f'[discovery]\nnameservers = ["127.0.0.1:{dns_port}"]\ntimeout_s = 1\n'
        f'[[nodes]]\nname = "pool"\ndiscover = "{discover}"\ndiscover_interval_s = {interval_s}\n'
        f"{extra}"
    )


def port_of(node: SimProcess) -> int:
    return int(node.address.rsplit(":", 1)[1])


def srv(zone: Zone, ports: list[int]) -> None:
    """`SRV_NAME` points at these ports of 127.0.0.1, one target name each."""
    zone.set_srv(SRV_NAME, [(f"n{port}.pool.test", port) for port in ports])
    for port in ports:
        zone.set_addresses(f"n{port}.pool.test", ["127.0.0.1"])


def name(port: int, host: str = "127.0.0.1") -> str:
    return f"pool/{host}:{port}"


@dataclass
class DnsServer:
    """`zone` served on 127.0.0.1 (UDP and TCP) in `nursery`, stopped and started again on
    the same port at will."""

    zone: Zone
    nursery: trio.Nursery
    port: int = 0
    _scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    async def start(self) -> int:
        self.port = await self.nursery.start(self._serve)
        return self.port

    def stop(self) -> None:
        self._scope.cancel()

    async def _serve(self, *, task_status: trio.TaskStatus[int]) -> None:
        with trio.CancelScope() as self._scope:
            await serve_zone(self.zone, self.port, task_status=task_status)


@asynccontextmanager
async def dns_server(zone: Zone) -> AsyncIterator[int]:
    """`zone` served until the block ends; its port."""
    async with trio.open_nursery() as nursery:
        yield await DnsServer(zone, nursery).start()
        nursery.cancel_scope.cancel()


async def metrics(url: str) -> list[tuple[str, dict[str, str], float]]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        response = await http.get("/metrics")
    assert response.status_code == 200
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    ]


async def states(url: str) -> dict[str, float]:
    """Each node in the edge's pool, by name: its iop_edge_node_state (1: up)."""
    return {labels["node"]: value for n, labels, value in await metrics(url) if n == STATE}


async def errors(url: str, reason: str) -> float:
    found = await metrics(url)
    return sum(v for n, labels, v in found if n == ERRORS and labels["reason"] == reason)


async def until(check: Callable[[], Awaitable[bool]], within_s: float = 30.0) -> None:
    """Wait for another process's state: `check` every 50 ms, for at most `within_s`."""
    with trio.fail_after(within_s):
        while not await check():  # noqa: ASYNC110 - another process's state: no event
            await trio.sleep(0.05)


async def up_exactly(url: str, names: set[str]) -> bool:
    now = await states(url)
    return set(now) == names and all(value == 1 for value in now.values())


def models(node: SimProcess) -> list[str]:
    """The model of each run the node finished."""
    return [record["model"] for record in node.runs() if "outcome" in record]


def finished(node: SimProcess) -> int:
    return sum("outcome" in record for record in node.runs())


async def complete(http: httpx.AsyncClient, text: str) -> None:
    response = await http.post(CHAT, json=chat_body("sim-echo", text))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == text


async def test_nodes_join_and_leave_under_streams(tmp_path: Path) -> None:
    """An SRV name gives n1 and n2 (the answer without their addresses: the edge looks up
    each target). 12 streams are in flight when the name changes to n2 and n3: n3 joins,
    n1 leaves with its runs in flight and closes once they finished; every stream gets its
    whole answer and one end; new requests run on n2 and n3 only. Then n1 comes back
    under the same name and takes runs again."""
    zone = Zone(additional=False)
    with named_sims(tmp_path, "n1", "n2", "n3") as (n1, n2, n3):
        p1, p2, p3 = port_of(n1), port_of(n2), port_of(n3)
        srv(zone, [p1, p2])
        async with dns_server(zone) as dns_port:
            text = config(dns_port, f"dns+srv://{SRV_NAME}")
            async with edge_process(tmp_path, text) as edge:
                await until(lambda: up_exactly(edge.url, {name(p1), name(p2)}))
                words = [f"w{i} " for i in range(4)]
                items: list[dict[str, Any]] = [{"type": "delta", "delta": "start "}]
                items += [{"sleep_ms": 2000}]
                items += [{"type": "delta", "delta": word} for word in words]
                body = chat_body("sim-script", script(*items, COMPLETE), stream=True)
                answers: list[str] = []
                started = 0

                async def one_stream(http: httpx.AsyncClient) -> None:
                    nonlocal started
                    async with http.stream("POST", CHAT, json=body) as response:
                        assert response.status_code == 200
                        text = ""
                        async for chunk in response.aiter_text():
                            if not text:
                                started += 1
                            text += chunk
                    answers.append(text)

                limits = httpx.Limits(max_connections=20)
                async with (
                    httpx.AsyncClient(base_url=edge.url, timeout=30, limits=limits) as http,
                    trio.open_nursery() as nursery,
                ):
                    for _ in range(12):
                        nursery.start_soon(one_stream, http)
                    await poll(lambda: started == 12)
                    srv(zone, [p2, p3])
                    await until(lambda: up_exactly(edge.url, {name(p2), name(p3)}))
                    for i in range(6):
                        await complete(http, f"after {i}")
                assert len(answers) == 12
                for answer in answers:
                    frames = sse_frames(answer)
                    assert sse_content(frames) == "start " + "".join(words)
                    assert answer.count("data: [DONE]") == 1
                    ends = [f for f in frames if f.get("choices") and
                            f["choices"][0].get("finish_reason")]  # fmt: skip
                    assert len(ends) == 1
                await edge.wait_line(rf"node {name(p1)} closed")
                removed = next(line for line in edge.lines if f"node {name(p1)} removed" in line)
                assert "its 0 run(s)" not in removed  # it left with runs in flight
                # n1 ran streams only: no request sent after it left.
                assert set(models(n1)) == {"sim-script"}
                assert models(n2).count("sim-echo") + models(n3).count("sim-echo") == 6
                assert sum(models(n).count("sim-script") for n in (n1, n2, n3)) == 12
                srv(zone, [p1, p2, p3])
                await until(lambda: up_exactly(edge.url, {name(p1), name(p2), name(p3)}))
                async with httpx.AsyncClient(base_url=edge.url, timeout=30) as http:
                    for i in range(9):
                        await complete(http, f"back {i}")
                assert "sim-echo" in models(n1)


async def test_a_dead_address_is_probed_and_takes_no_run(tmp_path: Path) -> None:
    """`dns://` with two A records: 127.0.0.1, where the node listens, and 127.0.0.2,
    where nothing does on that port. Both are nodes of the pool; the dead one is probed
    (a state RPC sent), stays down, and takes none of 20 requests: all run on the live
    one, all answered."""
    zone = Zone()
    with named_sims(tmp_path, "n1") as (n1,):
        port = port_of(n1)
        zone.set_addresses("pool.test", ["127.0.0.1", "127.0.0.2"])
        async with dns_server(zone) as dns_port:
            text = config(dns_port, f"dns://pool.test:{port}")
            async with edge_process(tmp_path, text) as edge:
                live, dead = name(port), name(port, "127.0.0.2")

                async def probed() -> bool:
                    found = await metrics(edge.url)
                    rpcs = sum(v for n, labels, v in found if n.startswith(
                        "iop_edge_node_state_rpcs") and labels["node"] == dead)  # fmt: skip
                    now = await states(edge.url)
                    return rpcs > 0 and now.get(live) == 1 and now.get(dead) == 0

                await until(probed)
                async with (
                    httpx.AsyncClient(base_url=edge.url, timeout=30) as http,
                    trio.open_nursery() as nursery,
                ):
                    for i in range(20):
                        nursery.start_soon(complete, http, f"hello {i}")
                assert finished(n1) == 20
                counted = await metrics(edge.url)
                nodes = {labels["node"] for n, labels, v in counted
                         if n == "iop_edge_requests_total" and v}  # fmt: skip
                assert nodes == {live}
                assert (await states(edge.url)).get(dead) == 0


async def test_dns_down_keeps_the_fleet(tmp_path: Path) -> None:
    """The name answers n1 and n2; then the server answers SERVFAIL, then nothing, then is
    stopped: each failure is counted (servfail, timeout), logged once when the failures
    begin, and both nodes stay and serve. Once the server answers again (on the same
    port) with n2 alone, that is logged once, and n1 leaves."""
    zone = Zone()
    with named_sims(tmp_path, "n1", "n2") as (n1, n2):
        p1, p2 = port_of(n1), port_of(n2)
        srv(zone, [p1, p2])
        both = {name(p1), name(p2)}
        async with trio.open_nursery() as nursery:
            server = DnsServer(zone, nursery)
            text = config(await server.start(), f"dns+srv://{SRV_NAME}")
            async with edge_process(tmp_path, text) as edge:
                await until(lambda: up_exactly(edge.url, both))
                zone.mode = "servfail"
                await until(lambda: failures(edge.url, 3, "servfail"))
                zone.mode = "silent"
                await until(lambda: failures(edge.url, 1, "timeout"))
                assert await up_exactly(edge.url, both)
                await serve_some(edge.url, 4)
                server.stop()
                before = await errors(edge.url, "timeout") + await errors(edge.url, "servfail")
                await until(lambda: failures(edge.url, before + 2, "timeout", "servfail"))
                assert await up_exactly(edge.url, both)
                await serve_some(edge.url, 4)
                zone.mode = "answer"
                srv(zone, [p2])
                await server.start()
                await until(lambda: up_exactly(edge.url, {name(p2)}))
                await edge.wait_line(rf"node {name(p1)} closed")
            nursery.cancel_scope.cancel()
        assert finished(n1) + finished(n2) == 8
        failed = [line for line in edge.lines if "the look-up failed" in line]
        assert len(failed) == 1  # once when the failures began, not at each one
        assert "servfail" in failed[0]
        assert "the last answer's 2 node(s) stay" in failed[0]
        assert sum("the look-up answers again" in line for line in edge.lines) == 1


async def failures(url: str, count: float, *reasons: str) -> bool:
    """At least `count` failed look-ups, of these reasons together."""
    total = 0.0
    for reason in reasons:
        total += await errors(url, reason)
    return total >= count


async def serve_some(url: str, count: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for i in range(count):
            await complete(http, f"served {i}")


@contextmanager
def many_sims(tmp: Path, count: int) -> Iterator[list[int]]:
    """One `iop-sim-node --nodes COUNT` process: COUNT nodes, a port each; their ports."""
    process = subprocess.Popen(
        [sys.executable, "-m", "edge.nodes.sim", "--listen", "127.0.0.1:0", "--name", "many",
         "--nodes", str(count), "--runs-log", str(tmp / "many-runs.jsonl")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        ports = []
        while len(ports) < count:
            line = process.stdout.readline()
            assert "listening on" in line, line
            ports.append(int(line.rsplit(":", 1)[1]))
        yield ports
    finally:
        stop_process(process)


async def test_a_hundred_nodes_behind_one_name(tmp_path: Path) -> None:
    """An SRV name gives 100 nodes (100 ports of one simulated node process; the answer
    carries their addresses, over TCP once UDP's is too small): all 100 join and are up,
    200 requests at once are all answered, spread over the nodes. The name then gives 50
    of them: 50 leave (their series leave /metrics) and the rest serve; the server then
    fails, and the 50 stay."""
    zone = Zone()
    with many_sims(tmp_path, 100) as ports:
        srv(zone, ports)
        async with dns_server(zone) as dns_port:
            text = config(dns_port, f"dns+srv://{SRV_NAME}", interval_s=0.5)
            async with edge_process(tmp_path, text) as edge:
                every = {name(port) for port in ports}
                await until(lambda: up_exactly(edge.url, every), within_s=60)
                limits = httpx.Limits(max_connections=200)
                async with (
                    httpx.AsyncClient(base_url=edge.url, timeout=60, limits=limits) as http,
                    trio.open_nursery() as nursery,
                ):
                    for i in range(200):
                        nursery.start_soon(complete, http, f"hello {i}")
                counted = await metrics(edge.url)
                used = {labels["node"] for n, labels, v in counted
                        if n == "iop_edge_requests_total" and v}  # fmt: skip
                assert used <= every
                assert len(used) >= 10
                half = {name(port) for port in ports[:50]}
                srv(zone, ports[:50])
                await until(lambda: up_exactly(edge.url, half), within_s=60)
                zone.mode = "servfail"
                await until(lambda: failures(edge.url, 2, "servfail"))
                assert await up_exactly(edge.url, half)
                await serve_some(edge.url, 5)


async def test_a_reload_looks_up_at_once(tmp_path: Path) -> None:
    """A reload that adds a discover entry whose interval is an hour: the reload itself
    looks the name up, so once it is logged the nodes found are in the pool (probed
    before it applied) and take runs. A reload that removes the entry drains them."""
    zone = Zone()
    with named_sims(tmp_path, "n1", "n2") as (n1, n2):
        zone.set_addresses("pool.test", ["127.0.0.1"])
        async with dns_server(zone) as dns_port:
            static = f'[[nodes]]\nname = "n1"\naddress = "{n1.address}"\n'
            head = (
                '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n'
                f'[discovery]\nnameservers = ["127.0.0.1:{dns_port}"]\n'
            )
            async with edge_process(tmp_path, head + static) as edge:
                await until(lambda: up_exactly(edge.url, {"n1"}))
                found = name(port_of(n2))
                entry = (
                    f'[[nodes]]\nname = "pool"\ndiscover = "dns://pool.test:{port_of(n2)}"\n'
                    "discover_interval_s = 3600\n"
                )
                await reload(edge, tmp_path / "edge.toml", head + static + entry)
                assert await up_exactly(edge.url, {"n1", found})
                line = next(line for line in edge.lines if "configuration reloaded" in line)
                assert "nodes +pool" in line
                await serve_some(edge.url, 6)
                assert finished(n2) > 0
                await reload(edge, tmp_path / "edge.toml", head + static)
                await edge.wait_line(rf"node {found} closed")
                assert await up_exactly(edge.url, {"n1"})


async def reload(edge: EdgeProcess, path: Path, text: str) -> None:
    """Write `text` as the configuration, SIGHUP, and wait until the reload is logged."""
    done = sum("configuration reloaded" in line for line in edge.lines)
    await trio.Path(path).write_text(text)
    edge.signal(signal.SIGHUP)
    await poll(lambda: sum("configuration reloaded" in line for line in edge.lines) > done)


async def test_a_name_that_never_answered_has_no_node_yet(tmp_path: Path) -> None:
    """The name does not exist when the edge starts: the edge serves with no node,
    `/readyz` says 503 and the failure is counted; once the name answers, its node joins
    and `/readyz` says 200."""
    zone = Zone()
    with named_sims(tmp_path, "n1") as (n1,):
        async with dns_server(zone) as dns_port:
            text = config(dns_port, f"dns://pool.test:{port_of(n1)}")
            async with edge_process(tmp_path, text) as edge:
                async with httpx.AsyncClient(base_url=edge.url, timeout=10) as http:
                    assert (await http.get("/readyz")).status_code == 503
                    assert await states(edge.url) == {}
                    await until(lambda: failures(edge.url, 1, "nxdomain"))
                    zone.set_addresses("pool.test", ["127.0.0.1"])
                    await until(lambda: up_exactly(edge.url, {name(port_of(n1))}))
                    assert (await http.get("/readyz")).status_code == 200
                await serve_some(edge.url, 2)
        assert any("no node yet" in line for line in edge.lines)
