"""The Grafana dashboard (deploy/grafana/iop-edge.json) queries only metrics the edge has."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx

from tests.integration.conftest import RunningEdge

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "iop-edge.json"
# PromQL words that are neither metrics nor functions (those are followed by "(").
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or"}
_KEYWORDS |= {"unless", "bool", "offset", "inf", "nan"}
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label
    matchers, ranges, grouping clauses and numbers are gone, less function calls and
    keywords."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"(?<![A-Za-z0-9_:])\d[\w.]*", " ", expr)  # numbers and durations (5m)
    names = set()
    for match in _NAME.finditer(expr):
        word = match.group()
        if expr[match.end() :].lstrip().startswith("(") or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def exposed_names(text: str) -> set[str]:
    """Every sample name a family of this exposition can have (a histogram's _bucket,
    _sum and _count; a counter's family name carries its _total already)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            elif kind == "summary":
                names |= {name, f"{name}_sum", f"{name}_count"}
            else:
                names.add(name)
    return names


def _expressions(node: Any) -> list[str]:
    """Every `expr` (panel targets) and variable query in the dashboard."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                found.append(value)
            elif key == "definition" and isinstance(value, str):
                found.append(re.sub(r"^label_values\((\w+),.*\)$", r"\1", value))
            else:
                found.extend(_expressions(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(_expressions(item))
    return found


def test_metric_names_parser() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, model) (rate(a_bucket{model=~"$m",x="{"}'
        "[$__rate_interval]))) / sum without (pid) (b) or on (node) c offset 5m"
    )
    assert metric_names(expr) == {"a_bucket", "b", "c"}


async def test_every_dashboard_metric_is_exposed(
    edge: RunningEdge, http: httpx.AsyncClient
) -> None:
    """Each metric any panel or variable queries is in /metrics of a running edge (after one
    request, so the per-request histograms have samples too), and every panel has a query."""
    dashboard = json.loads(DASHBOARD.read_text())
    body = {"model": "sim-echo", "stream": True, "messages": [{"role": "user", "content": "a b c"}]}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for _ in response.aiter_lines():
            pass
    await edge.wait_idle()
    text = (await http.get("/metrics")).text
    exposed = exposed_names(text)
    expressions = _expressions(dashboard)
    queried = set().union(*(metric_names(e) for e in expressions))
    assert queried, "the dashboard queries nothing"
    assert queried <= exposed, sorted(queried - exposed)
    for name in ("iop_edge_time_per_output_token_seconds", "iop_edge_request_duration_seconds"):
        assert f'{name}_count{{api="chat",model="sim-echo",node="sim"}} 1.0' in text
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert all(t["expr"] for t in panel["targets"]), panel["title"]
