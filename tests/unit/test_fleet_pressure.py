"""The cache-pressure workload of the fleet benchmark (`benchmarks.pressure`,
`benchmarks.prompts.pressure`): its sizes, its arrival times, and that it is the same
from the same seed. Pure: no process."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
from prometheus_client import generate_latest

from benchmarks.pressure import (
    QUICK,
    PressureSettings,
    merged,
    other,
    pressure_figures,
    routing_counts,
    spread,
    workload,
)
from benchmarks.prompts import CHARS_PER_TOKEN, arrivals
from edge.observe.metrics import EdgeMetrics


def _messages(body: bytes) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = json.loads(body)["messages"]
    return messages


@pytest.mark.parametrize("p", [PressureSettings(), QUICK], ids=["full", "quick"])
def test_the_system_prompts_need_70_to_75_percent_of_the_fleets_kv(p: PressureSettings) -> None:
    """The groups' system prompts add up to 70-75% of the nodes' caches added up (llm-d's
    run: 73%), each node's cache whole 64-token blocks."""
    w = workload(p)
    fleet = p.kv_tokens * p.nodes
    assert p.kv_tokens % 64 == 0
    assert w.working_set_tokens == p.groups * p.prefix_tokens
    assert 0.70 <= w.working_set_tokens / fleet <= 0.75


def test_each_request_is_a_groups_system_prompt_and_a_short_question_of_its_own() -> None:
    """A request is one of `groups` system prompts of `prefix_tokens` tokens, then a
    question of `question_words` words that no other request has; every group is used."""
    p = PressureSettings()
    w = workload(p)
    systems, questions = set(), set()
    for sequence in w.sequences:
        assert len(sequence) == 1
        system, user = _messages(sequence[0])
        assert (system["role"], user["role"]) == ("system", "user")
        assert len(system["content"]) == p.prefix_tokens * CHARS_PER_TOKEN
        assert len(user["content"].split()) == p.question_words
        systems.add(system["content"])
        questions.add(user["content"])
    assert len(systems) == p.groups
    assert len(questions) == w.requests


def test_arrivals_rise_stage_by_stage_at_each_stages_rate() -> None:
    """The send times are sorted, and each stage's count is its rate x its seconds within
    four standard deviations (a Poisson count); the rates rise past the fleet's capacity
    with nothing reused from the third stage, and stay under its capacity with every
    prefix cached."""
    p = PressureSettings()
    w = workload(p)
    assert list(w.arrivals) == sorted(w.arrivals)
    assert len(w.arrivals) == w.requests
    start = 0.0
    for rate, seconds in p.stages:
        count = sum(1 for t in w.arrivals if start <= t < start + seconds)
        assert abs(count - rate * seconds) <= 4 * math.sqrt(rate * seconds)
        start += seconds
    rates = [rate for rate, _ in p.stages]
    assert rates == sorted(rates)
    assert rates[1] < p.capacity(0) < rates[2]
    assert rates[-1] < p.capacity(1)


def test_the_same_seed_gives_the_same_requests_at_the_same_times() -> None:
    """The workload is deterministic from its seed: the same bodies in the same order at
    the same times; another seed gives other ones."""
    p = PressureSettings()
    one, two = workload(p), workload(p)
    assert one.sequences == two.sequences
    assert one.arrivals == two.arrivals
    assert other(p).sequences == other(p).sequences
    three = workload(dataclasses.replace(p, seed=p.seed + 1))
    assert three.arrivals != one.arrivals
    assert three.sequences[0] != one.sequences[0]
    assert arrivals(1, ((10.0, 2.0),)) == arrivals(1, ((10.0, 2.0),))


def test_the_ceiling_is_the_system_text_of_each_groups_later_requests() -> None:
    """The workload fits the fleet's caches, so its ceiling is the share of the prompts'
    text seen before: every request's system prompt but each group's first."""
    p = QUICK
    w = workload(p)
    seen: set[str] = set()
    held = total = 0
    for (body,) in w.sequences:
        system, question = (len(json.dumps(m)) for m in _messages(body))
        total += system + question
        text = _messages(body)[0]["content"]
        held += system if text in seen else 0
        seen.add(text)
    assert w.ceiling() == pytest.approx(held / total)
    assert 0.8 < w.ceiling() < 1


def test_the_other_traffic_is_merged_in_time_order_and_told_apart() -> None:
    """The other traffic (random prompts, nothing shared) joins the workload's requests in
    time order, each tagged with where it came from (0: the workload, 1: the other)."""
    p = QUICK
    w, o = workload(p), other(p)
    assert o.requests > 0
    assert len({_messages(b)[0]["content"] for (b,) in o.sequences}) == o.requests
    bodies, times, origin = merged(w, o)
    assert times == sorted(times)
    assert len(bodies) == len(origin) == w.requests + o.requests
    for body, (k, i) in zip(bodies, origin, strict=True):
        assert body == (w if k == 0 else o).sequences[i]
    assert sorted(i for k, i in origin if k == 0) == list(range(w.requests))


def test_a_cells_figures_count_its_stages_and_its_answers_tokens() -> None:
    """TTFT p90 per stage takes the requests sent in that stage; output tokens a second
    are the answers' completion tokens over the time to the last answer; a failed request
    counts in neither."""
    p = QUICK
    w = workload(p)
    ends = list(itertools.accumulate(seconds for _, seconds in p.stages))
    records = []
    for seq, at in enumerate(w.arrivals):
        stage = next(i for i, end in enumerate(ends) if at < end)
        records.append({
            "seq": seq, "ttft_ms": 100.0 * (stage + 1), "prompt_tokens": 10,
            "cached_tokens": 5, "completion_tokens": 4, "end_s": at + 1.0, "late_ms": 1.0,
        })  # fmt: skip
    records.append({"seq": 0, "error": "HTTP 503", "ttft_ms": 1e6, "completion_tokens": 99})
    raw = {"records": records, "wall_s": 30.0}
    cell = pressure_figures(raw, [1, 1, 1, 1], 1.0, w)
    assert cell["stage_ttft_p90_ms"] == [100.0, 200.0, 300.0]
    assert cell["ttft_p90_ms"] == 300.0
    assert cell["output_tokens"] == 4 * w.requests
    assert cell["output_tok_per_s"] == pytest.approx(4 * w.requests / (w.arrivals[-1] + 1), 1e-3)
    assert (cell["hit_ratio"], cell["errors"]) == (0.5, 1)


def test_a_cells_routing_outcomes_are_read_from_the_edges_counter() -> None:
    """`routes`: the edge's `iop_edge_cache_routing_total` by outcome, as its metrics
    render it (the catalog's own counter, so a renamed metric fails here)."""
    metrics = EdgeMetrics()
    for outcome in ("hit", "hit", "miss"):
        metrics.cache_routed(outcome, "n1", 512)
    text = generate_latest(metrics.registry).decode()
    assert routing_counts(text) == {"hit": 2, "miss": 1}
    assert routing_counts("") == {}


def test_the_workload_is_spread_over_the_replicas_in_turn_the_other_traffic_apart() -> None:
    """With `replicas` gateways, the workload's request i goes to gateway i mod replicas
    whatever other traffic comes between; the other traffic to the target after them."""
    p = dataclasses.replace(QUICK, replicas=3)
    _, _, origin = merged(workload(p), other(p))
    targets = spread(origin, p.replicas)
    for (kind, i), target in zip(origin, targets, strict=True):
        assert target == (i % 3 if kind == 0 else 3)
    assert {t for t in targets if t < 3} == {0, 1, 2}
    assert spread(origin, 1) == [kind for kind, _ in origin]
