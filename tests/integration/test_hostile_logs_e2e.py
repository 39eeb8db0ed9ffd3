"""Logs an attacker sizes, and a reader of the log that stops: over a real edge process.

A hosted tool the edge drops is logged with the type the client gave it: that line
stays bounded whatever the type's size (edge.observe.logbound). The edge's stderr is a pipe
the test reads in a thread; paused, it is a pipe nobody drains, and the edge must
keep answering, drop the lines that do not fit and count them (edge.observe.logwriter).
Nothing here measures time: answers arrive, and counts add up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from edge.observe.logbound import ITEMS, LINE_CHARS
from tests.integration.edgeproc import EdgeProcess, edge_process

RESPONSES = "/v1/responses"
NOT_USED = "not used (the edge cannot run them)"


def _toml(*, log: str = "", workers: int = 1) -> str:
    return (
        f'[server]\nlisten = "127.0.0.1:0"\nworkers = {workers}\n\n[log]\n{log}\n'
        '[[nodes]]\nname = "embedded"\naddress = "embedded"\n'
    )


def _dropped_total(metrics: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "iop_edge_log_lines_dropped_total"
    )


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_a_hosted_tool_of_megabytes_is_answered_and_logged_in_a_bounded_line(
    tmp_path: Path, fmt: str
) -> None:
    """A Responses request whose dropped hosted tool's type is 3.9 MB of DEL characters
    (each written as four by a repr), followed by 5,000 more hosted tools, gets its normal
    answer; its "not used" line is at most LINE_CHARS, names the first tools, says how
    much of the type and how many tools were left out, and the whole log stays small."""
    body = (
        b'{"model": "sim-echo", "input": "hi", "tools": [{"type": "'
        + b"\x7f" * 3_900_000
        + b'"}'
        + b', {"type": "web_search"}' * 5_000
        + b"]}"
    )
    async with (
        edge_process(tmp_path, _toml(), log_format=fmt) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=60) as http,
    ):
        answer = await http.post(
            RESPONSES, content=body, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 200, answer.text[:500]
        assert answer.json()["status"] == "completed"
        line = await edge.wait_line(r"not used \(the edge cannot run them\)")
    assert len(line) <= LINE_CHARS + 1
    message = json.loads(line)["msg"] if fmt == "json" else line
    assert f"…(+{3_900_000 - 64} chars)" in message
    assert "tools[1] (type 'web_search': a hosted tool)" in message
    assert "tools[14] (type 'web_search'" in message
    assert f"…(+{5_001 - ITEMS + 1} more)" in message
    assert len(edge.stderr) < 64 * 1024


async def _responses_with_a_hosted_tool(http: httpx.AsyncClient, count: int) -> int:
    """`count` requests, each logging its "not used" line and its outcome line."""
    answered = 0
    body = {"model": "sim-echo", "input": "hi", "tools": [{"type": "web_search" + "q" * 200}]}
    for _ in range(count):
        response = await http.post(RESPONSES, json=body)
        assert response.status_code == 200, response.text
        answered += 1
    return answered


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_log_reader_that_stops_never_stops_the_edge(tmp_path: Path, workers: int) -> None:
    """With stderr a pipe nobody reads, 600 requests that each log two lines (about
    half a megabyte, many times the queue and the pipe) are all
    answered, and so is /healthz; the lines that did not fit ([log] queue_bytes and the
    pipe) are counted in iop_edge_log_lines_dropped_total (summed over the workers); once
    the reader reads again, lines flow again and a line says how many were dropped, and
    every request's line was either written or counted."""
    requests, tasks = 600, 8
    toml = _toml(log="queue_bytes = 16384\n", workers=workers)
    async with edge_process(tmp_path, toml, log_format="json") as edge:
        if workers > 1:
            await edge.wait_line(rf"serving on \S+ \({workers} workers\)")
        edge.pause_reading()
        answered: list[int] = []
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as http:

            async def client() -> None:
                answered.append(await _responses_with_a_hosted_tool(http, requests // tasks))

            async with trio.open_nursery() as nursery:
                for _ in range(tasks):
                    nursery.start_soon(client)
            assert sum(answered) == requests
            assert (await http.get("/healthz")).status_code == 200
            dropped = _dropped_total((await http.get("/metrics")).text)
            assert dropped > 0

            edge.resume_reading()
            # Each worker drains its own queue: a request's line can still be dropped by
            # one that has not caught up yet, so requests are sent until one's line is
            # written (each answered meanwhile).
            for attempt in range(60):
                resumed = await http.post(
                    RESPONSES, json={"model": "sim-echo", "input": "after"},
                    headers={"X-Request-Id": f"after-resume-{attempt}"},
                )  # fmt: skip
                assert resumed.status_code == 200
                try:
                    await edge.wait_line(r'"request_id": "after-resume-', within_s=0.5)
                    break
                except trio.TooSlowError:
                    continue
            else:
                raise AssertionError("no line written after the reader came back")
            await edge.wait_line(r"log lines dropped: the reader of the log was too slow")
            final = _dropped_total((await http.get("/metrics")).text)
    records = _records(edge)
    written = sum(1 for r in records if r["msg"].startswith(NOT_USED))
    outcomes = sum(
        1 for r in records
        if r["msg"].startswith("chat completion")
        and not str(r.get("request_id", "")).startswith("after-resume")
    )  # fmt: skip
    assert written < requests
    # Every line of the requests was written or counted (the count also holds
    # the notices about drops that were themselves dropped).
    assert written + outcomes + final >= 2 * requests


def _records(edge: EdgeProcess) -> list[dict[str, Any]]:
    """The JSON lines read so far (each whole: no line was cut or interleaved)."""
    return [json.loads(line) for line in edge.lines if line.strip()]
