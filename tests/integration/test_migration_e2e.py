"""Migration over real processes: an answer cut mid-way by its node's death goes on on
another node, byte for byte.

Two `iop-sim-node` processes behind a real edge. The simulated node is
deterministic and continues a script exactly (it skips what a RunRequest's
continuation holds and plays the rest, docs/simulated-node.md), so the text of a
migrated answer must be the text of an uncut one.

- Long answers (200 deltas, small sleeps between them) on both nodes, one node
  killed (SIGKILL) mid-answer: every answer completes with exactly the expected
  text, `finish_reason: "stop"`, one terminal, and usage; each answer that was on
  the killed node is counted as migrated.
- A node whose model does not say `continuation` (`--no-continuation`) takes no
  continuation: the answers cut on the other node end with an error frame, as
  before migration.
- A stream whose head went out with a keep-alive, its node killed before any
  output: it starts again on the other node and completes whole.
- An answer whose every node aborts its stream ends with the node's failure
  (`run_error`) once no node is left, never a timeout.
- A client that left is never migrated: its run is cancelled on its node, and the
  other node's runs log never names it.
- A client that stopped reading after more than a stalled answer may keep: once
  its run's event buffer is full, what the edge kept of its answer is let go;
  its node killed, the answer does not move (counted `stalled`), and the other
  node's runs log never names it.
- An answer whose two nodes are killed in turn goes back to the first, restarted
  meanwhile (a new process, a life the edge saw the old one's end of), and
  completes whole; the restarted process runs it once.

Waits are bounded polls on in-process state or on the nodes' runs logs; nothing
asserts a duration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from edge.config import Config, NodeConfig, RoutingConfig, ServerConfig
from edge.fleet.continuation import STALLED_CHARS
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    kill_process,
    poll,
    script,
    sse_content,
    sse_frames,
    stalled_stream,
    start_edge,
    start_sim,
    stop_edge,
    stop_process,
)

CHAT = "/v1/chat/completions"
WAIT_S = 30.0
PIECES = 200
MIGRATIONS = "iop_edge_migrations_total"
EXPECTED = "".join(f"w{i} " for i in range(PIECES))
# 200 deltas with a short sleep after each: an answer of a second or so.
LONG = script(
    *[item for i in range(PIECES) for item in ({"type": "delta", "delta": f"w{i} "},
                                                {"sleep_ms": 5})],
    {"type": "complete", "usage": {"input_tokens": 9, "output_tokens": PIECES}},
)  # fmt: skip


@contextmanager
def _sims(tmp: Path, *args: tuple[str, ...]) -> Iterator[tuple[SimProcess, ...]]:
    """Nodes "a", "b", ... each started with `--name NAME` and its own extra arguments."""
    with ExitStack() as stack:
        nodes = []
        for name, extra in zip("ab", args, strict=False):
            node = start_sim(tmp, name, "--name", name, *extra)
            stack.callback(stop_process, node.process)
            nodes.append(node)
        yield tuple(nodes)


def _config(*nodes: SimProcess, migrations: int = 1, keepalive_s: float = 0) -> Config:
    return Config(
        # No refresh during a test: the edge learns of a dead node from its runs.
        server=ServerConfig(listen="127.0.0.1:0", keepalive_s=keepalive_s, node_refresh_s=600),
        routing=RoutingConfig(retries=2, retry_backoff_s=0.01, migrations=migrations),
        nodes=tuple(NodeConfig(name, n.address) for name, n in zip("ab", nodes, strict=False)),
    )


def _streamed(text: str) -> dict[str, Any]:
    """A streamed request of `text` (a sim-script), usage included."""
    body = chat_body("sim-script", text, stream=True)
    body["stream_options"] = {"include_usage": True}
    return body


def _live_on(edge: RunningEdge, node: str, seen: Callable[[Any], bool]) -> int:
    return sum(1 for r in edge.edge.runs.live if r.info.node == node and seen(r))


def _serving(edge: RunningEdge) -> str:
    """Which of nodes "a" and "b" the one answer in flight was accepted on."""
    return "a" if _live_on(edge, "a", lambda r: r.accepted) else "b"


class _Stream:
    """One streamed answer read as it comes: its text so far, and whole at the end."""

    def __init__(self) -> None:
        self.text = ""
        self.done = False

    @property
    def pieces(self) -> int:
        return sse_content(sse_frames(self.text[: self.text.rfind("\n\n") + 1])).count(" ")

    async def read(self, http: httpx.AsyncClient, body: dict[str, Any]) -> None:
        async with http.stream("POST", CHAT, json=body) as response:
            assert response.status_code == 200
            async for chunk in response.aiter_text():
                self.text += chunk
        self.done = True


def _whole(text: str) -> None:
    """A streamed answer that completed exactly: the uncut text, one role chunk, one
    finish (stop), usage, [DONE] once, no error frame."""
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    assert text.count("data: [DONE]") == 1
    frames = sse_frames(text)
    assert not any("error" in f for f in frames), text[-300:]
    assert sse_content(frames) == EXPECTED
    roles = [f for f in frames if f.get("choices") and f["choices"][0]["delta"].get("role")]
    assert len(roles) == 1
    finishes = [f["choices"][0]["finish_reason"] for f in frames
                if f.get("choices") and f["choices"][0].get("finish_reason")]  # fmt: skip
    assert finishes == ["stop"]
    usage = [f["usage"] for f in frames if f.get("usage")]
    assert len(usage) == 1
    assert usage[0]["completion_tokens"] == PIECES


@pytest.mark.parametrize("stream", [True, False])
async def test_answers_cut_by_a_node_kill_complete_exactly_on_the_other_node(
    nursery: trio.Nursery, tmp_path: Path, stream: bool
) -> None:
    """Ten long answers across two nodes, node a killed (SIGKILL) once each answer on it
    has output: every answer completes with exactly the text of an uncut run, stop,
    one terminal and usage; each that was on a is counted as migrated."""
    with _sims(tmp_path, (), ()) as (a, b):
        running = await start_edge(nursery, _config(a, b))
        body = _streamed(LONG) if stream else chat_body("sim-script", LONG, stream=False)
        streams = [_Stream() for _ in range(10)]
        answers: list[httpx.Response] = []

        async def ask(http: httpx.AsyncClient) -> None:
            answers.append(await http.post(CHAT, json=body))

        async with (
            httpx.AsyncClient(base_url=running.url, timeout=60) as http,
            trio.open_nursery() as clients,
        ):
            for reader in streams:
                if stream:
                    clients.start_soon(reader.read, http, body)
                else:
                    clients.start_soon(ask, http)
            await poll(lambda: _live_on(running, "a", lambda r: r.accepted) >= 1
                        and _live_on(running, "b", lambda r: r.accepted) >= 1)  # fmt: skip
            if stream:
                await poll(lambda: all(s.pieces >= 10 for s in streams))
            else:
                await poll(lambda: _live_on(running, "a", lambda r: r.reader.output_seen) >= 1)
            on_a = _live_on(running, "a", lambda r: r.accepted and r.outcome is None)
            kill_process(a.process)
        assert on_a >= 1
        if stream:
            for reader in streams:
                _whole(reader.text)
        else:
            assert len(answers) == 10
            for response in answers:
                assert response.status_code == 200, response.text
                answer = response.json()
                assert answer["choices"][0]["message"]["content"] == EXPECTED
                assert answer["choices"][0]["finish_reason"] == "stop"
                assert answer["usage"]["completion_tokens"] == PIECES
        # Every stream on a had output when a was killed: each moved. A non-streaming
        # answer's progress is not seen from outside (and runs still reached a between
        # the count and the kill): those on a moved if their output had reached the
        # edge (what a sent before it died included), else started again on b; each
        # answer did one or the other at most once (b never failed).
        moved = running.counted(MIGRATIONS, outcome="migrated")
        if stream:
            assert moved == on_a
        else:
            assert moved >= 1  # one had output on a: the poll saw it
            assert moved + running.counted("iop_edge_retries_total") <= 10
        await running.wait_idle(within_s=WAIT_S)
        # b ran each answer once, whole or continued: one line per run id.
        on_b = [r for r in b.runs() if "outcome" in r]
        assert len(on_b) == len({r["run_id"] for r in on_b}) == 10
        await stop_edge(running)


async def test_a_stream_whose_node_died_before_output_but_after_a_keepalive_completes(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The answer's head and a keep-alive went out, then its node died before any output:
    nothing was said yet, so the run starts again on the other node (no continuation
    needed: b does not say it can continue) and the stream completes whole, once."""
    slow = script(
        {"sleep_ms": 1500}, *[{"type": "delta", "delta": f"w{i} "} for i in range(PIECES)],
        {"type": "complete", "usage": {"input_tokens": 9, "output_tokens": PIECES}},
    )  # fmt: skip
    with _sims(tmp_path, (), ("--no-continuation",)) as (a, b):
        running = await start_edge(nursery, _config(a, b, keepalive_s=0.05))
        reader = _Stream()
        async with (
            httpx.AsyncClient(base_url=running.url, timeout=60) as http,
            trio.open_nursery() as clients,
        ):
            clients.start_soon(reader.read, http, _streamed(slow))
            await poll(lambda: ": keep-alive" in reader.text)
            first = _serving(running)
            assert reader.pieces == 0
            node = a if first == "a" else b
            kill_process(node.process)
        _whole(reader.text)
        assert running.counted(MIGRATIONS, outcome="migrated") == 1
        await stop_edge(running)


async def test_a_node_that_cannot_continue_takes_no_continuation(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Node b does not say `continuation`: the streams cut on a end with an error frame
    (no [DONE]), as before migration, and b is never sent them; b's own complete."""
    with _sims(tmp_path, (), ("--no-continuation",)) as (a, b):
        running = await start_edge(nursery, _config(a, b))
        body = chat_body("sim-script", LONG, stream=True)
        streams = [_Stream() for _ in range(4)]
        async with (
            httpx.AsyncClient(base_url=running.url, timeout=60) as http,
            trio.open_nursery() as clients,
        ):
            for reader in streams:
                clients.start_soon(reader.read, http, body)
            await poll(lambda: all(s.pieces >= 10 for s in streams))
            on_a = _live_on(running, "a", lambda r: r.accepted and r.outcome is None)
            kill_process(a.process)
        assert on_a >= 1
        cut = [s.text for s in streams if "data: [DONE]" not in s.text]
        assert len(cut) == on_a
        for text in cut:
            last = sse_frames(text)[-1]
            assert last["error"]["type"] == "run_error", text[-300:]
        for text in (s.text for s in streams if "data: [DONE]" in s.text):
            assert sse_content(sse_frames(text)) == EXPECTED
        assert running.counted(MIGRATIONS, outcome="migrated") == 0
        assert running.counted(MIGRATIONS, outcome="no_node") == on_a
        await running.wait_idle(within_s=WAIT_S)
        assert len([r for r in b.runs() if "outcome" in r]) == 4 - on_a
        await stop_edge(running)


async def test_an_answer_whose_every_node_aborts_ends_as_the_nodes_failure(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A script that aborts its stream after output on every node: the answer moves
    from a to b, b aborts too, and no node is left: the client gets the node's failure
    (`run_error`), at once, never a timeout; each node ran it once, aborted."""
    aborting = script(
        {"type": "delta", "delta": "hello "}, {"sleep_ms": 20},
        {"type": "delta", "delta": "world"}, {"type": "abort"},
    )  # fmt: skip
    with _sims(tmp_path, (), ()) as (a, b):
        running = await start_edge(nursery, _config(a, b, migrations=3))
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as http:
            response = await http.post(CHAT, json=chat_body("sim-script", aborting, stream=True))
        frames = sse_frames(response.text)
        assert sse_content(frames) == "hello world"
        assert frames[-1]["error"]["type"] == "run_error", response.text[-300:]
        assert "data: [DONE]" not in response.text
        run_id = frames[0]["id"].removeprefix("chatcmpl-")
        assert running.counted(MIGRATIONS, outcome="migrated") == 1
        assert running.counted(MIGRATIONS, outcome="no_node") == 1
        await running.wait_idle(within_s=WAIT_S)
        for node in (a, b):
            record = node.run(run_id)
            assert record is not None
            assert record["outcome"] == "aborted", record
        await stop_edge(running)


async def test_a_client_that_left_is_never_migrated(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A client that leaves mid-answer: its run is cancelled on its node (its runs log
    says so), and the other node's runs log never names it; nothing is migrated."""
    with _sims(tmp_path, (), ()) as (a, b):
        running = await start_edge(nursery, _config(a, b))
        body = chat_body("sim-script", LONG, stream=True)
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as http:
            text = ""
            async with http.stream("POST", CHAT, json=body) as response:
                async for chunk in response.aiter_text():
                    text += chunk
                    if sse_content(sse_frames(text[: text.rfind("\n\n") + 1])).count(" ") >= 10:
                        break  # the client leaves
        run_id = sse_frames(text)[0]["id"].removeprefix("chatcmpl-")
        await running.wait_idle(within_s=WAIT_S)
        await poll(lambda: a.run(run_id) is not None or b.run(run_id) is not None)
        first, other = (a, b) if a.run(run_id) is not None else (b, a)
        record = first.run(run_id)
        assert record is not None
        assert record["outcome"] == "cancelled", record
        assert not any(r.get("run_id") == run_id for r in other.runs())
        assert running.counted(MIGRATIONS, outcome="migrated") == 0
        await stop_edge(running)


async def test_a_stalled_clients_answer_is_let_go_and_does_not_move(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A client that reads more than STALLED_CHARS of an answer of 64 KiB deltas, then
    stops: its run's event buffer fills, and what the edge kept of the answer (to move
    it) is let go at once. Its node killed then, the answer does not move: counted
    `stalled`, never sent to the other node; the client reading again gets the error."""
    big = {"type": "delta", "delta": "x", "delta_times": 65536, "repeat": 4096}
    with _sims(tmp_path, (), ()) as (a, b):
        running = await start_edge(nursery, _config(a, b))
        body = _streamed(script(big, {"type": "complete"}))

        def stalled(run: Any) -> bool:
            delivered = run.reader.delivered
            return run.accepted and delivered is not None and delivered.gone == "stalled"

        async with stalled_stream(running.url, body, rcvbuf=16 * 1024) as (head, run_id, sock):
            # More than a stalled answer may keep is read first, then nothing.
            read = len(head)
            with trio.fail_after(WAIT_S):
                while read <= STALLED_CHARS:
                    read += len(await sock.recv(65536))
            await poll(lambda: any(stalled(r) for r in running.edge.runs.live))
            first, other = (a, b) if _serving(running) == "a" else (b, a)
            kill_process(first.process)
            # It reads again: what was written, then the break's error frame.
            tail = b""
            with trio.fail_after(WAIT_S):
                while not tail.endswith(b"\r\n0\r\n\r\n"):
                    chunk = await sock.recv(65536)
                    assert chunk, tail[-300:]
                    tail = (tail + chunk)[-4096:]
        assert b'"error"' in tail, tail[-300:]
        assert running.counted(MIGRATIONS, outcome="stalled") == 1
        await running.wait_idle(within_s=WAIT_S)
        assert running.counted(MIGRATIONS, outcome="migrated") == 0
        assert not any(r.get("run_id") == run_id for r in other.runs())
        await stop_edge(running)


async def test_an_answer_whose_nodes_died_in_turn_goes_back_to_a_restarted_one(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A fleet of two, one long answer: its node killed mid-answer, it moves to the other;
    the first restarted on its address (a new process: the edge hears its new instance),
    the second killed too: the answer goes back to the first node, whose life it failed
    in has ended, and completes whole. The new process runs it once."""
    # The answer pauses on nodes "a" and "b" only (where it is killed); the restarted
    # process is named "a2" or "b2", so it plays the rest at once.
    paced = script(
        *[{"type": "delta", "delta": f"w{i} "} for i in range(10)],
        {"sleep_ms": 60_000, "on_node": "a"}, {"sleep_ms": 60_000, "on_node": "b"},
        *[{"type": "delta", "delta": f"w{i} "} for i in range(10, PIECES)],
        {"type": "complete", "usage": {"input_tokens": 9, "output_tokens": PIECES}},
    )  # fmt: skip
    with _sims(tmp_path, (), ()) as sims, ExitStack() as stack:
        running = await start_edge(nursery, _config(*sims, migrations=2))
        reader = _Stream()
        async with (
            httpx.AsyncClient(base_url=running.url, timeout=60) as http,
            trio.open_nursery() as clients,
        ):
            clients.start_soon(reader.read, http, _streamed(paced))
            await poll(lambda: reader.pieces >= 10)
            first = _serving(running)
            nodes = dict(zip("ab", sims, strict=True))
            other = "b" if first == "a" else "a"
            kill_process(nodes[first].process)
            await poll(lambda: _live_on(running, other, lambda r: r.accepted) >= 1)
            state = running.node(first)
            old = state.description.instance
            again = start_sim(
                tmp_path, f"{first}2", "--name", f"{first}2", "--listen", nodes[first].address
            )
            stack.callback(stop_process, again.process)
            await poll(
                lambda: state.description.instance not in ("", old) and state.health.up
            )  # fmt: skip
            assert not reader.done
            kill_process(nodes[other].process)
        _whole(reader.text)
        assert running.counted(MIGRATIONS, outcome="migrated") == 2
        run_id = sse_frames(reader.text)[0]["id"].removeprefix("chatcmpl-")
        await running.wait_idle(within_s=WAIT_S)
        record = await again.wait_run(run_id)
        assert record["outcome"] == "complete", record
        assert len([r for r in again.runs() if r.get("run_id") == run_id]) == 1
        await stop_edge(running)
