"""Fixtures for end-to-end tests: a real `iop-sim-node` process, a real edge.

The simulated node runs as a subprocess (one per test session) on an
ephemeral 127.0.0.1 port with a runs log; the edge runs inside the test's
trio loop, serving hypercorn on an ephemeral 127.0.0.1 port, so tests can
also look at its insides (runs in flight, outcomes) after the fact.

Node processes are started by their modules, `edge.nodes.sim` and
`edge.nodes.upstream` (`python -m edge.sim` / `edge.upstream` are kept for scripts;
test_cli.py checks that they start): the session's `sim`, a test's own `node`,
`named_sims` for tests that kill one of several, `start_upstream_node` for `iop-node`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from grpclib.client import Channel

from edge.config import Config, NodeConfig, ServerConfig, TimeoutsConfig
from edge.contract._proto.iop.node import v1 as pb
from edge.fleet.nodestate import NodeState
from edge.fleet.run import RunInfo
from edge.node.bridge import asyncio_loop, call_asyncio
from edge.node.client import RunHandle
from edge.process.daemon import Edge, serve
from edge.stream.events import NodeEvent
from edge.stream.output import Outcome

STARTUP_TIMEOUT_S = 30


@dataclass
class SimProcess:
    address: str
    runs_log: Path
    process: subprocess.Popen[str]

    def runs(self) -> list[dict[str, Any]]:
        if not self.runs_log.exists():
            return []
        # The node (another process) may be writing a line right now: only whole
        # lines, those ending in a newline, are records yet.
        text = self.runs_log.read_text()
        whole = text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in whole.splitlines() if line]

    def run(self, run_id: str) -> dict[str, Any] | None:
        for record in self.runs():
            if record.get("run_id") == run_id and "outcome" in record:
                return record
        return None

    async def wait_run(self, run_id: str, within_s: float = 10.0) -> dict[str, Any]:
        """The runs-log line of `run_id`, once the node (another process) has written it."""
        with trio.fail_after(within_s):
            while (record := self.run(run_id)) is None:  # noqa: ASYNC110 - a file, not an event
                await trio.sleep(0.01)
        return record


def start_node_process(
    module: str, runs_log: Path, *args: str, env: Mapping[str, str] | None = None
) -> SimProcess:
    """A node (`python -m MODULE --listen 127.0.0.1:0 --runs-log ...`), once it listens.

    Node processes print "... listening on HOST:PORT" first; that line gives the port.
    `env` is added to the process's environment.
    """
    command = [sys.executable, "-m", module, "--listen", "127.0.0.1:0"]
    process = subprocess.Popen(
        [*command, "--runs-log", str(runs_log), *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    assert process.stdout is not None
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    line = ""
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if "listening on" in line or not line:
            break
    if "listening on" not in line:
        stop_process(process)
        raise RuntimeError(f"{module} did not start: {line!r}")
    return SimProcess(line.rsplit(" ", 1)[1].strip(), runs_log, process)


def start_sim(tmp: Path, name: str = "sim", *args: str) -> SimProcess:
    """A simulated node whose runs log is `tmp/NAME-runs.jsonl`; `args` go to its command."""
    return start_node_process("edge.nodes.sim", tmp / f"{name}-runs.jsonl", *args)


@contextmanager
def named_sims(tmp: Path, *names: str) -> Iterator[tuple[SimProcess, ...]]:
    """One simulated node per name, each started with `--name NAME` (the name it gives
    its runs), all stopped on the way out: fresh nodes, for tests that kill one."""
    with ExitStack() as stack:
        nodes = []
        for name in names:
            node = start_sim(tmp, name, "--name", name)
            stack.callback(stop_process, node.process)
            nodes.append(node)
        yield tuple(nodes)


def start_upstream_node(
    runs_log: Path, upstream: str, *args: str, env: Mapping[str, str] | None = None
) -> SimProcess:
    """`iop-node` in front of the OpenAI-compatible `upstream` URL (it asks the upstream
    for nothing until a request comes); its runs log has the simulated node's format."""
    return start_node_process(
        "edge.nodes.upstream", runs_log, "--upstream", upstream, *args, env=env
    )


def kill_process(process: subprocess.Popen[str]) -> None:
    """SIGKILL, as a crash: the process ends without a word to anyone; waited for."""
    process.kill()
    process.wait(10)


def stop_process(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    if process.stdout is not None:
        process.stdout.close()


@pytest.fixture(scope="session")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    node = start_sim(tmp_path_factory.mktemp("sim"))
    yield node
    stop_process(node.process)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimProcess]:
    """A simulated node of the test's own, for tests that fill its slots or read its runs
    log alone (the session's `sim` is shared by every test)."""
    own = start_sim(tmp_path)
    yield own
    stop_process(own.process)


async def node_events(handle: RunHandle) -> list[NodeEvent]:
    """Every event of a run started with a node client, to the node's end of the run,
    taken with `receive` as the edge's Run takes them."""
    events: list[NodeEvent] = []
    while True:
        try:
            events.append(await handle.events.receive())
        except trio.EndOfChannel:
            return events


async def describe_through_stub(address: str) -> pb.DescribeResponse:
    """A node's Describe answer through the generated stub, on a channel of its own (in an
    asyncio loop of its own: call outside the edge's)."""

    async def describe() -> pb.DescribeResponse:
        host, port = address.rsplit(":", 1)
        channel = Channel(host, int(port))
        try:
            return await pb.NodeServiceStub(channel).describe(pb.DescribeRequest())
        finally:
            channel.close()

    async with asyncio_loop():
        with trio.fail_after(10):
            return await call_asyncio(describe)


@dataclass
class RunningEdge:
    edge: Edge
    url: str
    outcomes: list[tuple[RunInfo, Outcome]] = field(default_factory=list)
    _recorded: trio.Event = field(default_factory=trio.Event)

    def record(self, info: RunInfo, outcome: Outcome) -> None:
        """The edge's outcome hook: one call per request that started a run."""
        self.outcomes.append((info, outcome))
        self._recorded.set()
        self._recorded = trio.Event()

    async def wait_outcome(self, run_id: str, within_s: float = 10.0) -> Outcome:
        """The outcome of `run_id`, once the edge has recorded it."""
        with trio.fail_after(within_s):
            while not any(info.run_id == run_id for info, _ in self.outcomes):
                await self._recorded.wait()
        return self.outcome(run_id)

    def outcome(self, run_id: str) -> Outcome:
        for info, outcome in self.outcomes:
            if info.run_id == run_id:
                return outcome
        raise AssertionError(f"no outcome recorded for run {run_id}")

    async def wait_idle(self, within_s: float = 10.0) -> None:
        """Every run has ended (its read task over, any CancelRun sent)."""
        with trio.fail_after(within_s):
            await self.edge.runs.wait_idle()

    def requests(self) -> dict[tuple[str, ...], float]:
        """iop_edge_requests_total by (model, node, stream, status), those counted (read
        in process)."""
        counts: dict[tuple[str, ...], float] = {}
        for family in self.edge.metrics.registry.collect():
            for s in family.samples:
                if s.name == "iop_edge_requests_total" and s.value:
                    labels = s.labels
                    key = (labels["model"], labels["node"], labels["stream"], labels["status"])
                    counts[key] = s.value
        return counts

    def node(self, name: str) -> NodeState:
        """The pool's state of the node named `name`."""
        return next(s for s in self.edge.pool.nodes if s.client.name == name)

    def counted(self, name: str, **labels: str) -> float:
        """The sum of the edge's samples `name` whose labels include `labels` (read in
        process; `name` as the sample is named, e.g. `..._total` for a counter)."""
        return sum(
            s.value
            for family in self.edge.metrics.registry.collect()
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )


def edge_config(sim: SimProcess, **timeouts: float) -> Config:
    return Config(
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=0),
        timeouts=replace(TimeoutsConfig(), **timeouts),
        nodes=(NodeConfig("sim", sim.address),),
    )


@pytest.fixture
async def edge(nursery: trio.Nursery, sim: SimProcess) -> AsyncIterator[RunningEdge]:
    running = await start_edge(nursery, edge_config(sim))
    yield running
    await stop_edge(running)


async def start_edge(nursery: trio.Nursery, config: Config) -> RunningEdge:
    hook: list[RunningEdge] = []
    edge: Edge = await nursery.start(
        lambda task_status: serve(
            config, on_outcome=lambda i, o: hook[0].record(i, o), task_status=task_status
        )
    )
    running = RunningEdge(edge, edge.url)
    hook.append(running)
    return running


async def stop_edge(running: RunningEdge) -> None:
    await running.wait_idle()
    running.edge.shutdown.set()


@pytest.fixture
async def http(edge: RunningEdge) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        yield client


# A declared tool the tests share: one required string, one enum, nothing else.
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def script(*events: dict[str, Any]) -> str:
    """A sim-script user message."""
    return json.dumps({"events": list(events)})


def chat_body(model: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


async def notify_lines(
    sock: trio.socket.SocketType, wanted: str, within_s: float = 15.0
) -> list[str]:
    """sd_notify datagrams received until one holds the line `wanted` (the others are
    returned too)."""
    seen: list[str] = []
    with trio.fail_after(within_s):
        while True:
            message = (await sock.recv(4096)).decode()
            seen.append(message)
            if wanted in message.splitlines():
                return seen


@asynccontextmanager
async def stalled_stream(
    url: str, body: dict[str, Any], *, rcvbuf: int = 0
) -> AsyncIterator[tuple[bytes, str, trio.socket.SocketType]]:
    """A client that POSTs a streamed chat request to the edge at `url`, reads up to the
    answer's whole id (in its first chunk), and then never reads again, its socket left
    open for the block: (what it read, the run id in the answer's id, the socket, for a
    test that reads on). `rcvbuf`: its receive buffer, in bytes (0: the system's). The
    socket is closed after the block."""
    request = json.dumps(body).encode()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with trio.socket.socket() as sock:
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        await sock.connect((host, int(port)))
        await sock.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(request)}\r\n\r\n".encode()
            + request
        )
        head = b""
        with trio.fail_after(10):
            while (found := re.search(rb'"id":"chatcmpl-([0-9a-f]+)"', head)) is None:
                head += await sock.recv(65536)
        yield head, found.group(1).decode(), sock


async def poll(condition: Callable[[], bool], within_s: float = 20.0) -> None:
    """Wait for state that has no event of its own (metrics, another process's log,
    in-process runs): checked every 10 ms, for at most `within_s`."""
    with trio.fail_after(within_s):
        while not condition():  # noqa: ASYNC110 - no event to wait on
            await trio.sleep(0.01)


async def node_that_ran(
    names: Sequence[str], nodes: Sequence[SimProcess], answer: httpx.Response
) -> str:
    """Which of `names` (one a node, in order) ran `answer`'s run: the node whose runs log
    has it (a chat completion's run id)."""
    run_id = answer.json()["id"].removeprefix("chatcmpl-")
    ran = [""]

    def found() -> bool:
        pairs = zip(names, nodes, strict=True)
        ran[0] = next((name for name, node in pairs if node.run(run_id)), "")
        return bool(ran[0])

    await poll(found)
    return ran[0]


def sse_frames(text: str) -> list[Any]:
    """The JSON frames of an SSE answer (its `data: [DONE]` left out)."""
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip


def sse_content(frames: list[Any]) -> str:
    """The content text of a chat completion's frames, joined."""
    return "".join(
        f["choices"][0]["delta"].get("content") or "" for f in frames if f.get("choices")
    )
