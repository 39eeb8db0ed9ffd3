"""End to end: `iop-node` (a process) reads its upstream's load and says it in Describe.

The upstream is a small HTTP server on 127.0.0.1 serving vLLM's `/v1/models`
and, at `/metrics`, one of the recorded bodies of
`upstream_fixtures/metrics` (vLLM old and new, SGLang, llama.cpp old and
new), or a failure: a 404 (Ollama, a server without `--metrics`), a body that
is not metrics, one past the node's limit.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import h11
import pytest
import trio
from grpclib.client import Channel

from edge.contract._proto.iop.node import v1 as pb
from edge.node.bridge import asyncio_loop, call_asyncio
from edge.nodes.upstream.load import MAX_METRICS_BYTES
from edge.nodes.upstream.loadpoll import FAILURES_UNSET
from tests.integration.conftest import STARTUP_TIMEOUT_S, stop_process
from tests.integration.rawhttp import read_request, send_events, serve_upstream

FIXTURES = Path(__file__).parent / "upstream_fixtures" / "metrics"
WAIT_S = 10.0
POLL_S = 0.02
INTERVAL_S = "0.05"

# fixture -> (active_runs, waiting_runs, kv_cache_tokens, kv_cache_used_tokens)
EXPECTED = {
    "vllm": (4, 2, 881152, 165216),
    "vllm-v0": (2, 5, 1308272, 654136),
    "sglang": (6, 4, 160716, 48213),
    "llamacpp": (2, 1, 32768, 6144),
    "llamacpp-current": (1, 0, None, None),
}


@dataclass
class MetricsUpstream:
    """vLLM's /v1/models, and at /metrics whatever `status` and `body` say now."""

    url: str = ""
    status: int = 404
    body: bytes = b"Not Found"
    scrapes: int = 0
    _scraped: trio.Event = field(default_factory=trio.Event)

    def serve(self, fixture: str) -> None:
        self.status, self.body = 200, (FIXTURES / f"{fixture}.prom").read_bytes()

    async def wait_scrapes(self, count: int) -> None:
        """Until `count` GET /metrics have come (the one before the last was read whole)."""
        with trio.fail_after(WAIT_S):
            while self.scrapes < count:
                await self._scraped.wait()

    async def answer(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            try:
                while (received := await read_request(stream, conn)) is not None:
                    request, _ = received
                    if request.target == b"/metrics":
                        self.scrapes += 1
                        self._scraped.set()
                        self._scraped = trio.Event()
                        status, body, kind = self.status, self.body, "text/plain; version=0.0.4"
                    else:
                        status, kind = 200, "application/json"
                        body = (FIXTURES / "vllm-models.json").read_bytes()
                    headers = [("content-type", kind), ("content-length", str(len(body)))]
                    await send_events(
                        stream,
                        conn,
                        h11.Response(status_code=status, headers=headers),
                        h11.Data(body),
                        h11.EndOfMessage(),
                    )
                    conn.start_next_cycle()
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
                return  # the node hung up (a body past its limit)


@dataclass
class Node:
    address: str
    process: subprocess.Popen[str]
    log: Path

    def warnings(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if "load from" in line]


@pytest.fixture
async def upstream(nursery: trio.Nursery) -> MetricsUpstream:
    server = MetricsUpstream()
    server.url = await serve_upstream(nursery, server.answer)
    return server


def _start(tmp: Path, url: str, *args: str) -> Node:
    """`iop-node --upstream URL ARGS`, its stderr (the log) to a file, once it listens."""
    log = tmp / "iop-node.log"
    command = [sys.executable, "-m", "edge.nodes.upstream", "--listen", "127.0.0.1:0"]
    with log.open("w") as err:
        process = subprocess.Popen(
            [*command, "--upstream", url, *args], stdout=subprocess.PIPE, stderr=err, text=True
        )
    assert process.stdout is not None
    line = process.stdout.readline()
    if "listening on" not in line:
        stop_process(process)
        raise RuntimeError(f"iop-node did not start: {line!r}")
    return Node(line.rsplit(" ", 1)[1].strip(), process, log)


@pytest.fixture
async def node(upstream: MetricsUpstream, tmp_path: Path) -> AsyncIterator[Node]:
    started = await trio.to_thread.run_sync(
        _start, tmp_path, upstream.url, "--load-interval-s", INTERVAL_S
    )
    try:
        yield started
    finally:
        await trio.to_thread.run_sync(stop_process, started.process)


async def _describe(
    address: str, ready: Callable[[pb.DescribeResponse], bool] = lambda _: True
) -> pb.DescribeResponse:
    """Describe, asked again until `ready` holds (the node reads its upstream meanwhile)."""

    async def ask() -> pb.DescribeResponse:
        host, port = address.rsplit(":", 1)
        channel = Channel(host, int(port))
        try:
            stub = pb.NodeServiceStub(channel)
            async with asyncio.timeout(WAIT_S):
                while not ready(described := await stub.describe(pb.DescribeRequest())):  # noqa: ASYNC110 - another process's state
                    await asyncio.sleep(POLL_S)
            return described
        finally:
            channel.close()

    async with asyncio_loop():
        with trio.fail_after(STARTUP_TIMEOUT_S):
            return await call_asyncio(ask)


def _load(d: pb.DescribeResponse) -> tuple[int, int | None, int | None, int | None]:
    return d.active_runs, d.waiting_runs, d.kv_cache_tokens, d.kv_cache_used_tokens


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
async def test_describe_says_the_upstream_load(
    upstream: MetricsUpstream, node: Node, fixture: str
) -> None:
    """In front of each recorded server, Describe says its running and waiting requests
    and its KV cache (unset where the server does not say), and the model's context
    length from vLLM's /v1/models."""
    upstream.serve(fixture)
    described = await _describe(node.address, lambda d: d.waiting_runs is not None)
    assert _load(described) == EXPECTED[fixture]
    assert described.max_runs == 0
    (model,) = described.models
    assert (model.id, model.max_context_tokens) == ("Qwen/Qwen3-8B", 40960)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (404, b"404 page not found"),
        (200, b"<!doctype html><title>Web UI</title>"),
        (200, b"vllm:num_requests_running 1\n" * (MAX_METRICS_BYTES // 28 + 1)),
    ],
    ids=["404", "garbage", "huge"],
)
async def test_a_load_no_longer_read_becomes_unknown(
    upstream: MetricsUpstream, node: Node, status: int, body: bytes
) -> None:
    """When /metrics stops answering metrics (a 404, a page that is not metrics, a body
    past the node's 4 MiB limit), the load fields are unset after a few failed reads
    (active_runs is then the node's own runs: none), and the node logs one line for
    the failure, not one per read."""
    upstream.serve("vllm")
    await _describe(node.address, lambda d: d.waiting_runs is not None)
    upstream.status, upstream.body = status, body
    await upstream.wait_scrapes(upstream.scrapes + FAILURES_UNSET + 3)
    described = await _describe(node.address)
    assert _load(described) == (0, None, None, None)
    assert described.models[0].max_context_tokens == 40960
    lines = node.warnings()
    assert len(lines) == 2, lines  # it reads vllm, then it cannot: once each
    assert "cannot read its load from" in lines[1]


async def test_a_node_told_not_to_read_the_load_asks_nothing(
    upstream: MetricsUpstream, tmp_path: Path
) -> None:
    """With --load-source none, /metrics is never asked, and the load fields stay unset."""
    upstream.serve("vllm")
    node = await trio.to_thread.run_sync(
        _start, tmp_path, upstream.url, "--load-source", "none", "--load-interval-s", INTERVAL_S
    )
    try:
        first = await _describe(node.address)
        # Describes enough for several reads, had there been any.
        for _ in range(5):
            await _describe(node.address)
        assert upstream.scrapes == 0
    finally:
        await trio.to_thread.run_sync(stop_process, node.process)
    assert _load(first) == (0, None, None, None)


def test_bad_load_settings_are_refused() -> None:
    """A load interval out of range or an unknown source is a usage error naming it."""
    for args, expected in [
        (["--load-interval-s", "0.001"], "load_interval_s"),
        (["--load-interval-s", "nan"], "load_interval_s"),
        (["--load-source", "ollama"], "invalid choice"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "edge.nodes.upstream", "--upstream", "http://127.0.0.1:9/v1",
             *args],
            capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S, check=False,
        )  # fmt: skip
        assert result.returncode == 2, result
        assert expected in result.stderr
