"""Worker processes (`iop-edge --workers N`), over real processes and sockets.

The edge is the `iop-edge` console script in a subprocess: a supervisor and
its worker processes; the node is a real `iop-sim-node` process or the
edge's embedded one (one per worker). Which worker holds a connection is
read from the kernel (psutil: the worker process that owns the server end of
the client's TCP connection), not from anything the edge says about itself.
Waits on other processes are bounded; nothing here sleeps for timing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import psutil  # type: ignore[import-untyped]
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from edge.cli import main as cli_main
from edge.config import ConfigError, config_digest, parse_config
from tests.integration.conftest import SimProcess, chat_body, notify_lines, script
from tests.integration.edgeproc import EdgeProcess, edge_process

CHAT = "/v1/chat/completions"
COMPLETE = {"type": "complete", "metadata": {"finish_reason": "stop"}}
ALL_READY = r"serving on \S+ \(2 workers\)"


def sim_toml(sim: SimProcess, *, server: str = "") -> str:
    return (
        f'[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\nworkers = 2\n{server}\n'
        f'[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
    )


@asynccontextmanager
async def two_workers(
    tmp: Path, toml: str, env: dict[str, str] | None = None
) -> AsyncIterator[EdgeProcess]:
    """The edge with 2 workers, once the supervisor says both are ready (JSON logs)."""
    async with edge_process(tmp, toml, log_format="json", env=env) as edge:
        await edge.wait_line(ALL_READY)
        yield edge


def workers(edge: EdgeProcess) -> list[psutil.Process]:
    return psutil.Process(edge.process.pid).children()


def holder(pids: list[int], client_port: int, edge_port: int) -> int | None:
    """The pid among `pids` whose socket is the server end of the client's connection."""
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            ends = (conn.laddr and conn.laddr.port, conn.raddr and conn.raddr.port)
            if ends == (edge_port, client_port):
                return pid
    return None


def total(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def scrape(url: str) -> str:
    """/metrics on a connection of its own (so any worker may answer it)."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        response = await http.get("/metrics")
    assert response.status_code == 200
    return response.text


async def ask(url: str, text: str = "hello there") -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        response = await http.post(CHAT, json=chat_body("sim-echo", text))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize("mode", ["reuseport", "shared"])
async def test_both_workers_serve_and_one_scrape_counts_every_request(
    sim: SimProcess, tmp_path: Path, mode: str
) -> None:
    """16 client connections land on both workers (the kernel says which holds each), in
    either listen mode; any worker's /metrics counts all 16 requests exactly once, and
    every log line carries the id of the process that wrote it (0: the supervisor)."""
    env = {"IOP_EDGE_LISTEN_MODE": mode}
    async with two_workers(tmp_path, sim_toml(sim), env=env) as edge:
        port = int(edge.url.rsplit(":", 1)[1])
        pids = [p.pid for p in workers(edge)]
        assert len(pids) == 2
        holders: list[int | None] = []
        async with AsyncExitStack() as stack:
            for i in range(16):
                http = await stack.enter_async_context(
                    httpx.AsyncClient(base_url=edge.url, timeout=30)
                )
                response = await http.post(CHAT, json=chat_body("sim-echo", f"hi {i}"))
                assert response.status_code == 200
                # The connection is kept alive: find its server end.
                stream = response.extensions["network_stream"]
                client_port = stream.get_extra_info("client_addr")[1]
                holders.append(holder(pids, client_port, port))
        assert set(holders) == set(pids), holders
        # One shared directory for the edge, the same in every worker; gone after exit.
        shared = {Path(p.environ()["IOP_EDGE_SHARED_DIR"]) for p in workers(edge)}
        assert len(shared) == 1
        assert all(d.is_dir() for d in shared)
        for _ in range(4):  # whichever worker answers, it sees the whole edge
            text = await scrape(edge.url)
            assert total(text, "iop_edge_requests_total", status="success") == 16
            assert total(text, "iop_edge_workers") == 2
        edge.signal(signal.SIGTERM)
        assert await edge.wait_exit() == 0
    assert not any(d.exists() for d in shared)
    logged = edge.json_lines()
    assert {line.get("worker") for line in logged} == {0, 1, 2}


@pytest.mark.parametrize("mode", ["reuseport", "shared"])
async def test_a_killed_worker_is_restarted_and_the_edge_keeps_answering(
    sim: SimProcess, tmp_path: Path, mode: str
) -> None:
    """kill -9 of one worker (either listen mode): once the supervisor has seen it die,
    new requests are answered by the survivor while a new worker starts in its place;
    the restart is counted, and the dead worker's requests stay counted."""
    env = {"IOP_EDGE_LISTEN_MODE": mode}
    async with two_workers(tmp_path, sim_toml(sim), env=env) as edge:
        for i in range(6):
            await ask(edge.url, f"before {i}")
        victim = workers(edge)[0]
        victim.kill()
        await edge.wait_line(r"worker \d exited with signal SIGKILL: restarting it in")
        for i in range(6):
            await ask(edge.url, f"after {i}")
        await edge.wait_line(r"worker \d is serving again")
        now = [p.pid for p in workers(edge)]
        assert len(now) == 2
        assert victim.pid not in now
        text = await scrape(edge.url)
        assert total(text, "iop_edge_worker_restarts_total") == 1
        assert total(text, "iop_edge_requests_total", status="success") == 12
        assert total(text, "iop_edge_workers") == 2
        edge.signal(signal.SIGTERM)
        assert await edge.wait_exit() == 0


async def test_a_restarted_worker_runs_the_keys_its_supervisor_read(
    sim: SimProcess, tmp_path: Path
) -> None:
    """A key file changed on disk (no reload): a worker killed and restarted still
    takes the key the supervisor read and checked, as its sibling does, and refuses
    the one now on disk; both report the same configuration digest, which is not the
    configuration file's alone (it covers the key file)."""
    (tmp_path / "team-a.key").write_text("sk-a\n")
    toml = sim_toml(sim) + '[[keys]]\nname = "team-a"\nkey_file = "team-a.key"\n'

    async def status(url: str, key: str) -> int:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = chat_body("sim-echo", "hello")
            answer = await http.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})
        return answer.status_code

    async with two_workers(tmp_path, toml) as edge:
        (tmp_path / "team-a.key").write_text("sk-a-on-disk\n")
        victim = workers(edge)[0]
        victim.kill()
        await edge.wait_line(r"worker \d is serving again")
        for _ in range(6):  # whichever worker takes each connection
            assert await status(edge.url, "sk-a") == 200
            assert await status(edge.url, "sk-a-on-disk") == 401
        text = await scrape(edge.url)
        digests = {
            s.labels["digest"]
            for family in text_string_to_metric_families(text)
            if family.name == "iop_edge_config_info"
            for s in family.samples
        }
        config_file = (tmp_path / "edge.toml").read_bytes()
        assert len(digests) == 1
        assert digests != {config_digest(config_file)}
        edge.signal(signal.SIGTERM)
        assert await edge.wait_exit() == 0


def _notify_path(tmp_path: Path) -> Path:
    directory = tmp_path
    if len(str(tmp_path / "notify.sock")) > 100:  # AF_UNIX paths are short
        directory = Path(tempfile.mkdtemp(prefix="iop-notify-"))
    return directory / "notify.sock"


async def _pings_stop(sock: trio.socket.SocketType, gap_s: float, within_s: float) -> None:
    """WATCHDOG=1 pings stop: a gap of `gap_s` without one, within `within_s`."""
    with trio.fail_after(within_s):
        while True:
            with trio.move_on_after(gap_s):
                while "WATCHDOG=1" not in (await sock.recv(4096)).decode().splitlines():
                    pass
                continue
            return


async def test_sd_notify_speaks_for_every_worker_and_sigterm_drains_a_stream(
    tmp_path: Path,
) -> None:
    """On a NOTIFY_SOCKET the test owns, with embedded nodes (one per worker): one READY=1
    (from the supervisor only, once both workers are ready), WATCHDOG=1 pings that stop
    while a worker is stopped and come back when it runs; SIGTERM with a stream in flight
    sends STOPPING=1, the stream completes with [DONE], and the edge exits 0."""
    path = _notify_path(tmp_path)
    steps = [{"type": "delta", "delta": c} for c in "abc"]
    items = [item for step in steps for item in (step, {"sleep_ms": 300})]
    body = chat_body("sim-script", script(*items, COMPLETE), stream=True)
    with trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        await sock.bind(str(path))
        env = {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000", "WATCHDOG_PID": ""}
        toml = '[server]\nlisten = "127.0.0.1:0"\ndrain_timeout_s = 20\nworkers = 2\n'
        async with two_workers(tmp_path, toml, env=env) as edge:
            first = await notify_lines(sock, "READY=1")
            await notify_lines(sock, "WATCHDOG=1")
            stopped = workers(edge)[1]
            stopped.suspend()
            try:
                await _pings_stop(sock, gap_s=0.6, within_s=10)
            finally:
                stopped.resume()
            await notify_lines(sock, "WATCHDOG=1")
            async with (
                httpx.AsyncClient(base_url=edge.url, timeout=30) as http,
                http.stream("POST", CHAT, json=body) as response,
            ):
                lines = response.aiter_lines()
                async for line in lines:
                    if line.startswith("data: ") and '"content":"a"' in line:
                        break
                edge.signal(signal.SIGTERM)
                rest = await notify_lines(sock, "STOPPING=1")
                data = [line async for line in lines if line.startswith("data: ")]
            assert data[-1] == "data: [DONE]"
            text = "a" + "".join(
                json.loads(d.removeprefix("data: "))["choices"][0]["delta"].get("content") or ""
                for d in data[:-1]
            )
            assert text == "abc"
            assert await edge.wait_exit() == 0
    messages = "\n".join(first + rest).splitlines()
    assert messages.count("READY=1") == 1  # the workers never spoke to systemd
    assert edge.stderr.count('"supervisor gone') == 0


async def test_workers_drain_when_the_supervisor_is_killed(sim: SimProcess, tmp_path: Path) -> None:
    """kill -9 of the supervisor: each worker sees its end of the control socket close,
    drains and exits (no orphan keeps serving)."""
    async with two_workers(tmp_path, sim_toml(sim, server="drain_timeout_s = 2")) as edge:
        children = workers(edge)
        shared = {Path(p.environ()["IOP_EDGE_SHARED_DIR"]) for p in children}
        edge.process.kill()
        _, alive = await trio.to_thread.run_sync(lambda: psutil.wait_procs(children, 15))
        assert not alive
        await edge.wait_exit()  # and its stderr, which the workers shared, read to the end
    assert edge.stderr.count("supervisor gone: draining") == 2
    assert edge.stderr.count("iop-edge stopped") == 2  # each worker's drain ran to its end
    for directory in shared:  # a killed supervisor cannot remove it: the harness did
        assert not directory.exists()


# --- configuration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "server.workers: must be between 1 and 256, got 0"),
        ('"many"', "server.workers: expected a number of processes or \"auto\", got 'many'"),
        ("true", "server.workers: expected a number of processes"),
        ("1.5", "server.workers: expected a number of processes"),
    ],
)
def test_bad_workers_values_are_config_errors(value: str, message: str) -> None:
    """A workers value that is not 1..256 or "auto" is one config error naming the key."""
    import tomllib

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(tomllib.loads(f"[server]\nworkers = {value}\n"), "edge.toml")


def test_workers_auto_is_the_usable_cpus() -> None:
    """workers = "auto" is the CPUs this process may run on; absent, 1."""
    import tomllib

    auto = parse_config(tomllib.loads('[server]\nworkers = "auto"\n'), "edge.toml")
    assert auto.server.workers == len(os.sched_getaffinity(0))
    assert parse_config({}, "edge.toml").server.workers == 1


def test_bad_workers_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """`--workers 0` is refused by the command line, naming the flag."""
    with pytest.raises(SystemExit) as exited:
        cli_main(["--workers", "0"])
    assert exited.value.code == 2
    assert "--workers: must be between 1 and 256" in capsys.readouterr().err


def test_shared_dir_is_none_in_a_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """`edge.process.supervisor.shared_dir()`: None without a supervisor, else its directory."""
    from edge.process.supervisor import SHARED_DIR_ENV, shared_dir

    monkeypatch.delenv(SHARED_DIR_ENV, raising=False)
    assert shared_dir() is None
    monkeypatch.setenv(SHARED_DIR_ENV, "/somewhere/iop-edge-x")
    assert shared_dir() == Path("/somewhere/iop-edge-x")
