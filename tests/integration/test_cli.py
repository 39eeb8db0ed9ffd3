"""`iop-edge` and `iop-sim-node` as a user runs them: real processes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import trio

from tests.integration.conftest import start_node_process, stop_process
from tests.integration.edgeproc import EdgeProcess, free_port


def test_config_mistake_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A config mistake: exit code 2 and one stderr line naming the file and the key."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nlisten = 12\n")
    result = subprocess.run(
        [sys.executable, "-m", "edge", "--config", str(bad)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [f"iop-edge: {bad}: server.listen: expected a string, got int"]


def test_missing_explicit_config_is_exit_2(tmp_path: Path) -> None:
    """--config naming a file that does not exist is a mistake, not a silent default."""
    result = subprocess.run(
        [sys.executable, "-m", "edge", "--config", str(tmp_path / "nope.toml")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "cannot read" in result.stderr


def test_bad_flag_is_a_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "edge", "--listen", "nope"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "expected HOST:PORT" in result.stderr


@pytest.mark.parametrize(
    ("module", "args"),
    [("edge.sim", ()), ("edge.upstream", ("--upstream", "http://127.0.0.1:9/v1"))],
)
def test_the_entry_points_kept_for_scripts_still_start(
    tmp_path: Path, module: str, args: tuple[str, ...]
) -> None:
    """`python -m edge.sim` and `python -m edge.upstream` (the nodes are `edge.nodes.sim`
    and `edge.nodes.upstream`, which the other tests start) still start a node that listens."""
    node = start_node_process(module, tmp_path / "runs.jsonl", *args)
    try:
        assert node.process.poll() is None
        assert node.address.startswith("127.0.0.1:")
    finally:
        stop_process(node.process)


async def test_default_config_answers_with_embedded_node(tmp_path: Path) -> None:
    """The shipped config.toml (as `make run` uses it), on another port, answers a chat request
    from its embedded simulated node, and SIGTERM stops it with exit code 0."""
    repo = Path(__file__).parents[2]
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with (tmp_path / "edge.log").open("w") as log:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "edge", "--config", str(repo / "config.toml"),
             "--listen", f"127.0.0.1:{port}", "--log-format", "json"],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            with trio.fail_after(30):
                while True:
                    try:
                        if (await client.get("/readyz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.05)
            response = await client.post(
                "/v1/chat/completions",
                json={"model": "sim-echo", "messages": [{"role": "user", "content": "hi"}]},
            )
        assert response.json()["choices"][0]["message"]["content"] == "hi"
        process.terminate()
        with trio.fail_after(30):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(10):
                await process.wait()


def _make_run(port: int) -> subprocess.Popen[str]:
    """`make run LISTEN=127.0.0.1:PORT` in the repository, in a session of its own, its
    stderr a pipe; make's own variables of an outer make left out."""
    return subprocess.Popen(
        ["make", "--no-print-directory", "-o", ".venv/.installed", "run",
         f"LISTEN=127.0.0.1:{port}"],
        cwd=Path(__file__).parents[2], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")},
    )  # fmt: skip


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
async def test_make_run_listens_where_told_and_prints_the_pid_to_signal() -> None:
    """`make run LISTEN=127.0.0.1:PORT` (the virtualenv taken as set up: `-o` keeps make from
    installing) serves on that address; its log gives the edge's pid, and `kill -HUP` that
    pid reloads the configuration, SIGTERM drains and stops it (make exits 0)."""
    port = free_port()
    process = _make_run(port)
    edge = EdgeProcess(process)
    edge.resume_reading()
    edge._reader = threading.Thread(target=edge._read, daemon=True)
    edge._reader.start()
    try:
        served = await edge.wait_line(r"serving on http://\S+")
        assert f"serving on http://127.0.0.1:{port} " in served
        said = re.search(r"iop-edge pid (\d+) \(kill -HUP (\d+) reloads", edge.stderr)
        assert said is not None, edge.stderr
        assert said.group(1) == said.group(2)
        pid = int(said.group(1))
        assert pid != process.pid  # the edge, not make
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            assert (await client.get("/healthz")).status_code == 200
        os.kill(pid, signal.SIGHUP)
        await edge.wait_line("configuration reloaded")
        os.kill(pid, signal.SIGTERM)
        assert await edge.wait_exit() == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # make and the edge it started, ours
        process.wait(10)
        edge.resume_reading()
        edge._reader.join(10)
        assert process.stderr is not None
        process.stderr.close()
