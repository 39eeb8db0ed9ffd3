"""Reloading the configuration (SIGHUP), over real processes: one edge process and
`--workers 2`, with real `iop-sim-node` processes as nodes.

A reload is over in a process once it logged it ("configuration reloaded" or
"reload refused"): what the tests check then is checked at once, without a wait,
so "a key added answers at once after the reload" is a fact of order, not of time.
Waits on other processes are bounded polls; nothing here sleeps for timing.
"""

from __future__ import annotations

import hashlib
import json
import signal
from collections.abc import Callable, Iterable
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
)
from tests.integration.edgeproc import EdgeProcess, edge_process

CHAT = "/v1/chat/completions"
COMPLETE = {"type": "complete", "metadata": {"finish_reason": "stop"}}
RELOADED = "configuration reloaded"
REFUSED = "reload refused"
ALL_READY = r"serving on \S+ \(2 workers\)"


def toml(
    nodes: Iterable[SimProcess],
    keys: dict[str, str],
    *,
    server: str = "",
    extra: str = "",
) -> str:
    """A config of `nodes` (each named as its sim: the runs log's name) and `keys` (name:
    secret; a value with a space carries the key's other settings after it)."""
    text = f'[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n{server}\n'
    for node in nodes:
        text += f'[[nodes]]\nname = "{node.runs_log.stem.removesuffix("-runs")}"\n'
        text += f'address = "{node.address}"\n'
    for name, secret in keys.items():
        key, _, settings = secret.partition(" ")
        text += f'[[keys]]\nname = "{name}"\nkey = "{key}"\n{settings}\n'
    return text + extra


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def count(edge: EdgeProcess, text: str) -> int:
    return sum(text in line for line in edge.lines)


async def reload(edge: EdgeProcess, config: Path, text: str, *, lines: int = 1) -> None:
    """Write `text` as the config, SIGHUP, and wait until `lines` more processes logged the
    reload's end (applied or refused)."""
    done = count(edge, RELOADED) + count(edge, REFUSED)
    await trio.Path(config).write_text(text)
    edge.signal(signal.SIGHUP)
    await poll(lambda: count(edge, RELOADED) + count(edge, REFUSED) >= done + lines)


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


async def scrape(url: str) -> str:
    """/metrics on a connection of its own (with workers: whichever answers)."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        response = await http.get("/metrics")
    assert response.status_code == 200
    return response.text


def finished(node: SimProcess) -> int:
    return sum("outcome" in record for record in node.runs())


async def status(url: str, key: str) -> int:
    """A key's answer on /v1/models, on a connection of its own."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        return (await http.get("/v1/models", headers=bearer(key))).status_code


async def complete(url: str, key: str, text: str) -> None:
    """A non-streaming request of `key` answered whole, on a connection of its own."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        response = await http.post(CHAT, json=chat_body("sim-echo", text), headers=bearer(key))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == text


async def stream_across(
    url: str, key: str, during: Callable[[], Any], *, sleep_ms: int = 1500
) -> str:
    """A stream of `key` whose first chunk has arrived when `during()` runs, and whose
    node then takes `sleep_ms` before the rest; the whole answer's content."""
    items = [{"type": "delta", "delta": "before "}, {"sleep_ms": sleep_ms}]
    items += [{"type": "delta", "delta": "after"}, COMPLETE]
    body = chat_body("sim-script", script(*items), stream=True)
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        http.stream("POST", CHAT, json=body, headers=bearer(key)) as response,
    ):
        assert response.status_code == 200
        chunks = response.aiter_text()
        text = ""
        async for chunk in chunks:
            text += chunk
            if "before" in text:
                break
        await during()
        async for chunk in chunks:
            text += chunk
    assert text.rstrip().endswith("data: [DONE]")
    return sse_content(sse_frames(text))


async def test_keys_and_nodes_change_under_a_stream(tmp_path: Path) -> None:
    """One process. A stream of key `a` on node n1 is in flight while a reload removes
    both (key `b` and node n2 in their place): once the reload is logged, `a` answers 401
    and `b` 200 at once, `b`'s requests run on n2 (n1 gets no new run), the stream
    finishes whole on n1, and only then is n1's connection closed. The gauge shows the
    new file's digest."""
    with named_sims(tmp_path, "n1", "n2") as (n1, n2):
        async with edge_process(tmp_path, toml([n1], {"a": "key-a"})) as edge:
            config = tmp_path / "edge.toml"

            async def swap() -> None:
                await reload(edge, config, toml([n2], {"b": "key-b"}))
                assert await status(edge.url, "key-a") == 401
                assert await status(edge.url, "key-b") == 200
                for i in range(3):
                    await complete(edge.url, "key-b", f"on n2 {i}")
                await poll(lambda: finished(n2) == 3)

            assert await stream_across(edge.url, "key-a", swap) == "before after"
            await edge.wait_line("node n1 closed")
            assert finished(n1) == 1
            # It was removed with the stream in flight, and closed after it.
            assert any("node n1 removed" in line and "its 1 run(s)" in line for line in edge.lines)
            assert count(edge, "reload refused") == 0
            metrics = await scrape(edge.url)
            info = samples(metrics, "iop_edge_config_info")
            assert [labels["digest"] for labels, _ in info] == [digest(config)]
            assert samples(metrics, "iop_edge_config_reloads_total") == [
                ({"result": "ok"}, 1.0),
                ({"result": "error"}, 0.0),
            ]


async def test_a_bad_file_changes_nothing(sim: SimProcess, tmp_path: Path) -> None:
    """One process. A file that is not TOML, then one with a bad value: each reload is
    refused with one line naming the file (and the key), counted; the keys, the digest
    shown and the answers stay those of the configuration in use. A good file after
    them applies (what waits for a restart named in its line; a CORS origin it adds is
    answered at once)."""
    async with edge_process(tmp_path, toml([sim], {"a": "key-a"})) as edge:
        config = tmp_path / "edge.toml"
        running = digest(config)
        await reload(edge, config, toml([sim], {"b": "key-b"}) + "[broken\n")
        await reload(edge, config, toml([sim], {"b": "key-b"}, extra='[routing]\npolicy = "x"\n'))
        refused = [line for line in edge.lines if REFUSED in line]
        assert len(refused) == 2
        assert all(str(config) in line and running in line for line in refused)
        assert "not valid TOML" in refused[0]
        assert "routing.policy" in refused[1]
        assert await status(edge.url, "key-a") == 200
        assert await status(edge.url, "key-b") == 401
        metrics = await scrape(edge.url)
        assert [labels["digest"] for labels, _ in samples(metrics, "iop_edge_config_info")] == [
            running
        ]
        reloads = dict((labels["result"], v) for labels, v in samples(
            metrics, "iop_edge_config_reloads_total"))  # fmt: skip
        assert reloads == {"ok": 0.0, "error": 2.0}
        # Good again, with a setting bound at start changed: applied, the setting named.
        origin = "https://app.example"
        server = f'max_connections = 77\ncors_allow_origins = ["{origin}"]'
        await reload(edge, config, toml([sim], {"b": "key-b"}, server=server))
        line = next(line for line in edge.lines if RELOADED in line)
        assert "needs a restart" in line
        assert "server.max_connections" in line
        assert "keys +b -a" in line
        assert "server.cors_allow_origins" in line
        async with httpx.AsyncClient(base_url=edge.url, timeout=10) as http:
            headers = {"Origin": origin, **bearer("key-b")}
            response = await http.get("/v1/models", headers=headers)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == origin


async def test_two_workers_switch_together(tmp_path: Path) -> None:
    """`--workers 2`: the supervisor checks the file once and both workers switch to it: a
    stream in flight across the reload finishes whole; once both logged it, every
    connection (whichever worker holds it) finds the new key and not the old, and runs
    on the node added; a broken file is refused by the supervisor alone, counted once,
    and both workers keep running the digest they had."""
    with named_sims(tmp_path, "n1", "n2") as (n1, n2):
        first = toml([n1], {"a": "key-a"}, server="workers = 2")
        async with edge_process(tmp_path, first, log_format="json") as edge:
            await edge.wait_line(ALL_READY)
            config = tmp_path / "edge.toml"

            async def swap() -> None:
                await reload(edge, config, toml([n2], {"b": "key-b"}, server="workers = 2"),
                             lines=2)  # fmt: skip
                for i in range(6):  # new connections: both workers answer some
                    assert await status(edge.url, "key-a") == 401
                    await complete(edge.url, "key-b", f"hello {i}")
                await poll(lambda: finished(n2) == 6)

            assert await stream_across(edge.url, "key-a", swap) == "before after"
            await poll(lambda: count(edge, "node n1 closed") == 2)
            assert finished(n1) == 1  # the stream, and no run after the reload
            applied = [json.loads(line) for line in edge.lines if RELOADED in line]
            assert sorted(line["worker"] for line in applied) == [1, 2]
            good = digest(config)
            await reload(edge, config, "[broken\n", lines=1)
            refused = [json.loads(line) for line in edge.lines if REFUSED in line]
            assert [line["worker"] for line in refused] == [0]
            metrics = await scrape(edge.url)
            info = samples(metrics, "iop_edge_config_info")
            live = {labels["pid"]: labels["digest"] for labels, value in info if value > 0}
            assert list(live.values()) == [good, good]
            reloads = {labels["result"]: v for labels, v in samples(
                metrics, "iop_edge_config_reloads_total")}  # fmt: skip
            assert reloads == {"ok": 2.0, "error": 1.0}
            assert await status(edge.url, "key-b") == 200


async def test_no_request_fails_across_ten_reloads(tmp_path: Path) -> None:
    """`--workers 2`: 200 concurrent streams and a steady rate of short requests while ten
    reloads alternate two files (a node added then removed, a limited key's limits and
    the set of limited keys, the routing policy, the admission bounds): every stream
    finishes whole, every request is answered 200."""
    with named_sims(tmp_path, "n1", "n2") as (n1, n2):
        key = "rpm = 1000000\nmax_streams = 1000"
        one = toml([n1], {"k": f"key-k {key}"}, server="workers = 2")
        two = toml(
            [n1, n2], {"k": f"key-k {key.replace('1000', '999')}", "x": "key-x rpm = 5"},
            server="workers = 2",
            extra='[routing]\npolicy = "cache_aware"\n[admission]\nmax_queue = 999\n',
        )  # fmt: skip
        async with edge_process(tmp_path, one, log_format="json") as edge:
            await edge.wait_line(ALL_READY)
            config = tmp_path / "edge.toml"
            words = [f"w{i} " for i in range(8)]
            items: list[dict[str, Any]] = []
            for word in words:
                items += [{"type": "delta", "delta": word}, {"sleep_ms": 400}]
            body = chat_body("sim-script", script(*items, COMPLETE), stream=True)
            expected = "".join(words)
            failures: list[str] = []
            streams_started = streams_done = 0
            reloads_done = trio.Event()
            limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)

            async def one_stream(http: httpx.AsyncClient) -> None:
                nonlocal streams_started, streams_done
                async with http.stream("POST", CHAT, json=body, headers=bearer("key-k")) as r:
                    text = ""
                    async for chunk in r.aiter_text():
                        if not text:
                            streams_started += 1
                        text += chunk
                content = sse_content(sse_frames(text))
                if r.status_code != 200 or content != expected:
                    failures.append(f"stream {r.status_code}: {text[-200:]}")
                streams_done += 1

            async def steady(http: httpx.AsyncClient) -> int:
                sent = 0
                while not reloads_done.is_set():
                    body = chat_body("sim-echo", f"steady {sent}")
                    response = await http.post(CHAT, json=body, headers=bearer("key-k"))
                    if response.status_code != 200:
                        failures.append(f"steady {response.status_code}: {response.text}")
                    sent += 1
                return sent

            async with httpx.AsyncClient(base_url=edge.url, timeout=60, limits=limits) as http:
                sent: list[int] = []
                async with trio.open_nursery() as nursery:
                    for _ in range(200):
                        nursery.start_soon(one_stream, http)

                    async def steady_to_end() -> None:
                        sent.append(await steady(http))

                    nursery.start_soon(steady_to_end)
                    # Every stream has its first chunk: the reloads come while all are on.
                    await poll(lambda: streams_started + len(failures) >= 200)
                    assert streams_done == 0
                    for i in range(10):
                        await reload(edge, config, two if i % 2 == 0 else one, lines=2)
                    reloads_done.set()
            assert failures == []
            assert streams_done == 200
            assert sent[0] > 0
            assert count(edge, REFUSED) == 0
            assert sum(RELOADED in line for line in edge.lines) == 20
            # The node added then removed five times took runs, and was closed each time.
            await poll(lambda: count(edge, "node n2 closed") == 10)
            assert finished(n1) + finished(n2) == 200 + sent[0]
            assert all(line.get("level") != "ERROR" for line in edge.json_lines())
