"""Operability, over real processes: metrics, logs, health, systemd, drain, API keys.

The node is always a real `iop-sim-node` process (or the edge's embedded
one); where the edge's own process behaviour is the subject (logs, signals,
sd_notify) the edge is the `iop-edge` console script in a subprocess too.
Waits on other processes are bounded polls; nothing here sleeps for timing.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from edge.config import load_config
from tests.integration.conftest import (
    SimProcess,
    chat_body,
    edge_config,
    notify_lines,
    script,
    start_edge,
    stop_edge,
)
from tests.integration.edgeproc import edge_process, free_port, kill, start_sim_on

CHAT = "/v1/chat/completions"
DELTA_X = {"type": "delta", "delta": "x"}
HANG = {"type": "hang"}
COMPLETE = {"type": "complete", "metadata": {"finish_reason": "stop"}}


# --- helpers ------------------------------------------------------------------


class Metrics:
    """The samples of one /metrics scrape, parsed by prometheus_client's own parser."""

    def __init__(self, text: str) -> None:
        families = text_string_to_metric_families(text)
        self.samples = [sample for family in families for sample in family.samples]

    def value(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
        return sum(
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def label_values(self) -> set[str]:
        return {v for s in self.samples for v in s.labels.values()}


async def scrape(http: httpx.AsyncClient) -> Metrics:
    response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return Metrics(response.text)


def data_lines(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


async def first_content(lines: AsyncIterator[str]) -> dict[str, Any]:
    """Read an SSE body up to its first chunk with content (so the node's first event has
    reached the edge), which is returned parsed."""
    async for line in lines:
        if line.startswith("data: "):
            chunk: dict[str, Any] = json.loads(line.removeprefix("data: "))
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                return chunk
    raise AssertionError("the stream ended before its first content")


def assert_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == code


def node_toml(sim: SimProcess, *, server: str = "") -> str:
    """A config.toml whose one node is `sim`; `server` adds lines to [server]."""
    return (
        f'[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n{server}\n'
        f'[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
    )


# --- metrics --------------------------------------------------------------------


async def test_metrics_count_every_request_once_by_how_it_ended(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """After successes, a node error, a client that left, a timeout, a 400 and a 404, the
    requests counter holds exactly one sample per request under bounded labels, tokens match
    the usage the client saw, and every cancelled or timed-out run sent one CancelRun."""
    running = await start_edge(nursery, edge_config(sim, first_event_s=0.5))
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        plain = await http.post(CHAT, json=chat_body("sim-echo", "one two three"))
        assert plain.status_code == 200
        streamed = await http.post(
            CHAT,
            json=chat_body(
                "sim-echo", "four five", stream=True, stream_options={"include_usage": True}
            ),
        )
        usage_chunk = json.loads(data_lines(streamed.text.splitlines())[-2])
        usages = [plain.json()["usage"], usage_chunk["usage"]]

        failed = await http.post(
            CHAT,
            json=chat_body(
                "sim-script",
                # Two writes a pause apart: an inter-chunk gap to observe.
                script(DELTA_X, {"sleep_ms": 200}, DELTA_X, {"type": "error", "error": "boom"}),
                stream=True,
            ),
        )
        assert json.loads(data_lines(failed.text.splitlines())[-1])["error"]["type"] == "run_error"

        body = chat_body("sim-script", script(DELTA_X, HANG), stream=True)
        async with http.stream("POST", CHAT, json=body) as response:
            run_id = (await first_content(response.aiter_lines()))["id"].removeprefix("chatcmpl-")
        # Leaving the block closed the connection mid-stream: the edge cancels the run.
        left = await sim.wait_run(run_id)
        assert (left["outcome"], left["cancel_rpc"]) == ("cancelled", True)

        timed_out = await http.post(CHAT, json=chat_body("sim-script", script(HANG), stream=True))
        # Before the first byte: a real status, not 200 and an error frame.
        assert timed_out.status_code == 504
        assert timed_out.json()["error"]["type"] == "timeout"

        bad = await http.post(CHAT, content=b"{nope", headers={"content-type": "application/json"})
        assert bad.status_code == 400
        unknown = await http.post(CHAT, json=chat_body("user-chosen-model-xyz", "hi"))
        assert unknown.status_code == 404

        timeout_run = next(i.run_id for i, o in running.outcomes if o.status == "timeout")
        timed = await sim.wait_run(timeout_run)
        assert (timed["outcome"], timed["cancel_rpc"]) == ("cancelled", True)
        await running.wait_idle()
        m = await scrape(http)

    requests = "iop_edge_requests_total"
    expected = {
        ("sim-echo", "sim", "false", "success"): 1,
        ("sim-echo", "sim", "true", "success"): 1,
        ("sim-script", "sim", "true", "error"): 1,
        ("sim-script", "sim", "true", "cancelled"): 1,
        ("sim-script", "sim", "true", "timeout"): 1,
        ("unknown", "none", "false", "error"): 2,
    }
    for (model, node, stream, status), count in expected.items():
        got = m.value(requests, model=model, node=node, stream=stream, status=status)
        assert got == count, (model, node, stream, status)
    assert m.value(requests) == 7
    assert "user-chosen-model-xyz" not in m.label_values()

    tokens = "iop_edge_tokens_total"
    assert m.value(tokens, type="input") == sum(u["prompt_tokens"] for u in usages)
    assert m.value(tokens, type="output") == sum(u["completion_tokens"] for u in usages)
    assert m.value(tokens, type="cached_input") == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages
    )
    assert m.value(tokens, model="sim-script") == 0  # no run of it succeeded

    # Runs with a first event: both echoes, the failed one, the abandoned one.
    assert m.value("iop_edge_time_to_first_token_seconds_count", model="sim-echo") == 2
    assert m.value("iop_edge_time_to_first_token_seconds_count", model="sim-script") == 2
    assert m.value("iop_edge_inter_chunk_seconds_count") > 0
    assert m.value("iop_edge_added_latency_seconds_count") > 0
    assert m.value("iop_edge_active_streams") == 0
    assert m.value("iop_edge_node_cancels_total", node="sim") == 2
    assert m.value("iop_edge_node_errors_total", node="sim", kind="error_event") == 1
    assert m.value("iop_edge_node_errors_total") == 1
    await stop_edge(running)


# --- API keys -------------------------------------------------------------------


async def test_api_keys_guard_v1_and_leave_health_and_metrics_open(
    nursery: trio.Nursery, sim: SimProcess, tmp_path: Path
) -> None:
    """With keys from `api_keys` and `api_keys_file` (relative to the config file), every
    /v1/* call needs `Authorization: Bearer <a key>`: a missing or wrong one is an
    OpenAI-shaped 401 invalid_api_key (counted once as a rejected request); health and
    metrics answer without a key."""
    conf = tmp_path / "conf"
    (conf / "keys").mkdir(parents=True)
    (conf / "keys" / "edge.keys").write_text("# one key per line\n\nkey-from-file\n")
    path = conf / "config.toml"
    path.write_text(node_toml(sim, server='api_keys = ["key-a"]\napi_keys_file = "keys/edge.keys"'))
    config = load_config(path)
    assert config.server.api_keys == ("key-a", "key-from-file")

    running = await start_edge(nursery, config)
    chat = chat_body("sim-echo", "hi")
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        rejected = [
            await http.get("/v1/models"),
            await http.post(CHAT, json=chat),
            await http.post(CHAT, json=chat, headers={"Authorization": "Bearer key-b"}),
            await http.post(CHAT, json=chat, headers={"Authorization": "Bearer key-a-longer"}),
            await http.post(CHAT, json=chat, headers={"Authorization": "Bearer key-"}),
            await http.post(CHAT, json=chat, headers={"Authorization": "key-a"}),
            await http.post(CHAT, json=chat, headers={"Authorization": "Basic key-a"}),
        ]
        for response in rejected:
            assert_openai_error(response, 401, "invalid_api_key")
        for key in ("key-a", "key-from-file"):
            auth = {"Authorization": f"Bearer {key}"}
            assert (await http.get("/v1/models", headers=auth)).status_code == 200
            answer = await http.post(CHAT, json=chat, headers=auth)
            assert answer.status_code == 200
            assert answer.json()["choices"][0]["message"]["content"] == "hi"
        for open_path in ("/healthz", "/readyz", "/metrics"):
            assert (await http.get(open_path)).status_code == 200, open_path
        m = await scrape(http)
    assert m.value("iop_edge_requests_total", model="unknown", status="error") == 6
    assert m.value("iop_edge_requests_total", model="sim-echo", status="success") == 2
    await stop_edge(running)


# --- health -----------------------------------------------------------------------


async def _wait_ready(http: httpx.AsyncClient, status: int, within_s: float = 20.0) -> Any:
    """/readyz's body once it answers `status` (the pool notices on its next refresh)."""
    with trio.fail_after(within_s):
        while (response := await http.get("/readyz")).status_code != status:  # noqa: ASYNC110
            await trio.sleep(0.05)  # the node pool's state (no event to await): poll, bounded
    return response.json()


async def test_readiness_follows_the_node_going_down_and_up(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """/readyz is 503 with a reason while the only node is stopped, and 200 again once a node
    listens on the same address; a request then succeeds over the reconnected channel."""
    port = free_port()
    runs_log = tmp_path / "runs.jsonl"
    node = await trio.to_thread.run_sync(start_sim_on, port, runs_log)
    try:
        sim = SimProcess(f"127.0.0.1:{port}", runs_log, node)
        config = edge_config(sim)
        config = replace(config, server=replace(config.server, node_refresh_s=0.1))
        running = await start_edge(nursery, config)
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            assert (await _wait_ready(http, 200))["status"] == "ready"
            assert (await http.post(CHAT, json=chat_body("sim-echo", "before"))).status_code == 200

            node.terminate()
            await trio.to_thread.run_sync(node.wait, 10)
            down = await _wait_ready(http, 503)
            assert down["status"] == "not ready"
            assert down["reason"]
            assert down["nodes"][0]["healthy"] is False
            assert down["nodes"][0]["error"]
            refused = await http.post(CHAT, json=chat_body("sim-echo", "while down"))
            assert refused.status_code == 503

            kill(node)
            node = await trio.to_thread.run_sync(start_sim_on, port, runs_log)
            assert (await _wait_ready(http, 200))["status"] == "ready"
            again = await http.post(CHAT, json=chat_body("sim-echo", "after restart"))
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["message"]["content"] == "after restart"
        await stop_edge(running)
    finally:
        kill(node)


# --- logs -------------------------------------------------------------------------


async def test_json_logs_carry_request_ids_and_never_secrets(
    sim: SimProcess, tmp_path: Path
) -> None:
    """With --log-format json every stderr line is one JSON object; every line of a request
    (its run's trace lines included) carries its X-Request-Id, its outcome line has status,
    duration and model, a rejected call gets an access line, and no key is ever logged."""
    toml = node_toml(sim, server='api_keys = ["secret-key"]')
    async with edge_process(tmp_path, toml, log_format="json") as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as http:
            headers = {"Authorization": "Bearer secret-key", "X-Request-Id": "test-123"}
            traced = {"metadata": {"trace_stream": "true"}}
            answer = await http.post(
                CHAT, json=chat_body("sim-echo", "log me", **traced), headers=headers
            )
            assert answer.status_code == 200
            assert answer.headers["x-request-id"] == "test-123"
            run_id = answer.json()["id"].removeprefix("chatcmpl-")
            headers = {"Authorization": "Bearer secret-key", "X-Request-Id": "test-456"}
            streamed = await http.post(
                CHAT, json=chat_body("sim-echo", "and me", stream=True, **traced), headers=headers
            )
            assert data_lines(streamed.text.splitlines())[-1] == "[DONE]"
            headers = {"Authorization": "Bearer wrong-key-789", "X-Request-Id": "test-401"}
            assert (await http.get("/v1/models", headers=headers)).status_code == 401
        edge.signal(signal.SIGTERM)
        assert await edge.wait_exit() == 0

    records = edge.json_lines()
    assert records
    for record in records:
        assert {"ts", "level", "msg", "logger"} <= set(record)

    outcome = [r for r in records if r.get("request_id") == "test-123" and "status" in r]
    assert len(outcome) == 1
    assert outcome[0]["status"] == "success"
    assert outcome[0]["model"] == "sim-echo"
    assert outcome[0]["run_id"] == run_id
    assert isinstance(outcome[0]["duration_ms"], float | int)
    of_run = [r for r in records if r.get("run_id") == run_id]
    assert len(of_run) > 2  # trace lines, the outcome line, "stream closed"
    assert all(r.get("request_id") == "test-123" for r in of_run)

    streamed_lines = [r for r in records if r.get("request_id") == "test-456"]
    assert any(r.get("status") == "success" and r.get("stream") is True for r in streamed_lines)
    assert any(r["msg"].startswith("stream trace") for r in streamed_lines)

    (access,) = [r for r in records if r.get("request_id") == "test-401"]
    assert (access["status"], access["path"]) == (401, "/v1/models")
    assert isinstance(access["duration_ms"], float | int)

    for secret in ("secret-key", "wrong-key-789", "Bearer"):
        assert secret not in edge.stderr


# --- drain ------------------------------------------------------------------------


async def _request_during_drain(url: str) -> None:
    """A new request while draining gets a 503, or no connection once the listener closed
    (hypercorn stops accepting on the same signal that starts the drain)."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as other:
        try:
            response = await other.post(CHAT, json=chat_body("sim-echo", "late"))
        except httpx.ConnectError:
            return
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable"


async def test_drain_closes_idle_keep_alive_connections(
    nursery: trio.Nursery, sim: SimProcess
) -> None:
    """A connection idle between keep-alive requests is closed by the edge as soon as the
    drain begins, so a client that holds one (a load balancer) never holds the edge open.
    (The bound is generous; the edge cuts leftover connections by force ~3 s later.)"""
    running = await start_edge(nursery, edge_config(sim))  # drain_timeout_s: 30
    host, port = running.url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n")
        received = b""
        while not received.endswith(b'{"status":"ok"}'):
            received += await stream.receive_some(65536)
        assert received.startswith(b"HTTP/1.1 200")
        running.edge.shutdown.set()
        with trio.fail_after(2):
            assert await stream.receive_some(65536) == b""  # EOF: the edge closed it


async def test_sigterm_lets_a_stream_in_flight_finish_then_exits_0(
    sim: SimProcess, tmp_path: Path
) -> None:
    """SIGTERM mid-stream: no new request is served, the stream in flight still completes
    with [DONE], then the process exits 0."""
    steps = [{"type": "delta", "delta": c} for c in "abc"]
    items = [item for step in steps for item in (step, {"sleep_ms": 300})]
    body = chat_body("sim-script", script(*items, COMPLETE), stream=True)
    async with (
        edge_process(tmp_path, node_toml(sim, server="drain_timeout_s = 20")) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=30) as http,
        http.stream("POST", CHAT, json=body) as response,
    ):
        lines = response.aiter_lines()
        first = await first_content(lines)
        edge.signal(signal.SIGTERM)
        await edge.wait_line(r"draining: 1 stream\(s\) in flight")
        await _request_during_drain(edge.url)
        rest = data_lines([line async for line in lines])
        assert rest[-1] == "[DONE]"
        chunks = [first, *(json.loads(p) for p in rest[:-1])]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == "abc"  # the first content chunk was "a"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert await edge.wait_exit() == 0
    run = await sim.wait_run(first["id"].removeprefix("chatcmpl-"))
    assert (run["outcome"], run["cancel_rpc"]) == ("complete", False)


async def test_a_stream_that_outlives_the_drain_is_cancelled_on_the_node(
    sim: SimProcess, tmp_path: Path
) -> None:
    """With drain_timeout_s = 1, a hanging stream gets a service_unavailable error frame,
    the node sees CancelRun for its run, and the process still exits 0."""
    body = chat_body("sim-script", script(DELTA_X, HANG), stream=True)
    async with (
        edge_process(tmp_path, node_toml(sim, server="drain_timeout_s = 1")) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=30) as http,
        http.stream("POST", CHAT, json=body) as response,
    ):
        lines = response.aiter_lines()
        first = await first_content(lines)
        edge.signal(signal.SIGTERM)
        rest = data_lines([line async for line in lines])
        assert "[DONE]" not in rest
        assert json.loads(rest[-1])["error"]["type"] == "service_unavailable"
        assert await edge.wait_exit() == 0
    run = await sim.wait_run(first["id"].removeprefix("chatcmpl-"))
    assert (run["outcome"], run["cancel_rpc"]) == ("cancelled", True)


async def test_a_client_that_stopped_reading_does_not_hold_the_drain(
    sim: SimProcess, tmp_path: Path
) -> None:
    """A streaming client that reads nothing while big deltas wait, slow_client_s far away:
    after SIGTERM the drain deadline ends its stream, the write that waits on the client
    gives up with the drain, and the process exits 0 (not at the hard stop, code 1)."""
    big = script({"type": "delta", "delta": "x" * 65536, "repeat": 200}, HANG)
    body = json.dumps(chat_body("sim-script", big, stream=True)).encode()
    toml = node_toml(sim, server="drain_timeout_s = 0.5")
    toml += "[timeouts]\nslow_client_s = 600\n"
    async with edge_process(tmp_path, toml) as edge:
        host, port = edge.url.removeprefix("http://").rsplit(":", 1)
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect((host, int(port)))
        async with trio.SocketStream(sock) as stream:
            await stream.send_all(
                f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            got = b""
            while b"data: " not in got:  # the stream has begun; from here on, read nothing
                got += await stream.receive_some(4096)
            edge.signal(signal.SIGTERM)
            assert await edge.wait_exit() == 0


async def test_a_second_signal_exits_at_once(sim: SimProcess, tmp_path: Path) -> None:
    """A second SIGTERM during a long drain ends the process promptly (well before the
    30 s drain deadline), and the node's run does not outlive it."""
    body = chat_body("sim-script", script(DELTA_X, HANG), stream=True)
    async with (
        edge_process(tmp_path, node_toml(sim, server="drain_timeout_s = 30")) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=30) as http,
        http.stream("POST", CHAT, json=body) as response,
    ):
        lines = response.aiter_lines()  # held: a dropped iterator would close the response
        first = await first_content(lines)
        edge.signal(signal.SIGTERM)
        await edge.wait_line(r"draining: 1 stream\(s\) in flight")
        edge.signal(signal.SIGTERM)
        code = await edge.wait_exit(10)  # raises TimeoutExpired past 10 s
        assert code != 0
    run = await sim.wait_run(first["id"].removeprefix("chatcmpl-"))
    assert run["outcome"] == "cancelled"


# --- systemd ----------------------------------------------------------------------


async def test_sd_notify_ready_watchdog_stopping(tmp_path: Path) -> None:
    """On a NOTIFY_SOCKET the test owns: READY=1 once listening, WATCHDOG=1 pings while
    serving (WATCHDOG_USEC set), STOPPING=1 after SIGTERM; then exit 0."""
    directory = tmp_path
    if len(str(tmp_path / "notify.sock")) > 100:  # AF_UNIX paths are short
        directory = Path(tempfile.mkdtemp(prefix="iop-notify-"))
    path = directory / "notify.sock"
    with trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        await sock.bind(str(path))
        env = {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000", "WATCHDOG_PID": ""}
        toml = '[server]\nlisten = "127.0.0.1:0"\ndrain_timeout_s = 5\n'  # embedded node
        async with edge_process(tmp_path, toml, env=env) as edge:
            ready = await notify_lines(sock, "READY=1")
            assert "STOPPING=1" not in "".join(ready)
            await notify_lines(sock, "WATCHDOG=1")
            edge.signal(signal.SIGTERM)
            await notify_lines(sock, "STOPPING=1")
            assert await edge.wait_exit() == 0


def test_example_unit_files_are_valid(tmp_path: Path) -> None:
    """The example edge unit runs the console script as Type=notify with a watchdog, stops
    with SIGTERM giving the drain time, reloads with SIGHUP, and is hardened;
    `systemd-analyze verify` (where installed) finds no unknown key or bad value in either
    unit."""
    deploy = Path(__file__).resolve().parents[2] / "deploy"
    unit = (deploy / "iop-edge.service").read_text()
    for line in (
        "Type=notify", "WatchdogSec=", "KillSignal=SIGTERM", "TimeoutStopSec=",
        "ExecReload=/bin/kill -HUP $MAINPID",
    ):  # fmt: skip
        assert f"\n{line}" in unit, line
    for line in ("NoNewPrivileges=yes", "ProtectSystem=strict", "DynamicUser=yes"):
        assert f"\n{line}" in unit, line
    assert "/bin/iop-edge --config " in unit
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        return
    venv = str(Path(sys.executable).parent.parent)
    copies = []
    for name in ("iop-edge.service", "iop-sim-node.service"):
        copy = tmp_path / name
        copy.write_text((deploy / name).read_text().replace("/opt/iop-edge/.venv", venv))
        copies.append(str(copy))
    result = subprocess.run(
        [analyze, "verify", *copies], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr
