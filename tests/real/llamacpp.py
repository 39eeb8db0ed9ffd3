"""llama.cpp's real `llama-server` as a process of a test: started, asked, killed.

The binary is the one `tests/real/build-llama-server` builds into the cache (its path
and the vocabulary and template files beside it); the model is `tinymodel`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILD = Path(__file__).parent / "build-llama-server"
MODEL_NAME = "tiny"
STARTUP_S = 60.0


def binary_path() -> Path:
    """Where the build script puts (or has put) llama-server."""
    out = subprocess.run([str(BUILD), "--path"], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LlamaServer:
    """One llama-server process on 127.0.0.1."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        """Its OpenAI API base."""
        return f"http://127.0.0.1:{self.port}/v1"

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            body = r.read()
        return json.loads(body) if path != "/metrics" else body.decode()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())

    def busy_slots(self) -> list[int]:
        """The slots generating now (`/slots`, `is_processing`)."""
        return [s["id"] for s in self.get("/slots") if s.get("is_processing")]

    def kill(self) -> None:
        """SIGKILL: the server dies mid-answer, as a crash."""
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start(
    binary: Path, model: Path, log: Path, *, context: int = 4096, slots: int = 2
) -> LlamaServer:
    """A llama-server serving `model` as MODEL_NAME, `slots` slots sharing `context`
    tokens, one thread, with its metrics and slots endpoints and Jinja templates; once
    its /health answers 200."""
    port = _free_port()
    args = [
        str(binary), "-m", str(model), "--alias", MODEL_NAME, "-c", str(context),
        "-np", str(slots), "-t", "1", "--metrics", "--slots", "--jinja",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with log.open("ab") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    server = LlamaServer(process, port, log)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited: {log.read_text()[-2000:]}")
        try:
            if server.get("/health").get("status") == "ok":
                return server
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"llama-server did not start in {STARTUP_S:g}s: {log.read_text()[-2000:]}")


def unread_bytes(pid: int, port: int) -> list[int]:
    """The bytes waiting unread on each connection process `pid` holds to `port` (`ss`):
    a connection whose answer nobody reads grows them while its server generates."""
    if shutil.which("ss") is None:
        raise RuntimeError("`ss` (iproute2) is missing: apt-get install iproute2")
    out = subprocess.run(
        ["ss", "-Htnp", "state", "established", f"( dport = :{port} )"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    queued = []
    for line in out.splitlines():
        if f"pid={pid}," in line:
            queued.append(int(line.split()[0]))
    return queued


def environment_note() -> str:
    """What the tests ran against (for failures): the build's version line."""
    out = subprocess.run(
        [str(binary_path()), "--version"], capture_output=True, text=True, env=os.environ
    )
    return (out.stdout + out.stderr).strip()
