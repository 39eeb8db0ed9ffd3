"""A node's report as the edge keeps it (`edge.node.describe`): every field read, every
bound held, a report past one refused with an error that names it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.contract._proto.iop.node import v1 as pb
from edge.errors import NodeFailedError
from edge.node.describe import (
    HEARTBEAT_MAX_MS,
    HEARTBEAT_MIN_MS,
    MAX_MODELS,
    MAX_NAME_CHARS,
    description_from_pb,
)


def test_every_field_of_a_report_is_read() -> None:
    """Models, logprobs, context limits, load, KV cache, heartbeat and seq all arrive."""
    report = pb.DescribeResponse(
        node_name="n1",
        models=[
            pb.ModelInfo(id="a", logprobs=True, max_context_tokens=8192),
            pb.ModelInfo(id="b"),
        ],
        active_runs=3,
        max_runs=8,
        waiting_runs=2,
        kv_cache_tokens=1000,
        kv_cache_used_tokens=250,
        heartbeat_ms=2000,
        seq=7,
        instance_id="5f2c",
    )
    d = description_from_pb(report, "fallback", "h:1")
    assert d.instance == "5f2c"
    assert (d.name, d.models, d.logprobs_models) == ("n1", ("a", "b"), frozenset({"a"}))
    assert (d.active_runs, d.max_runs, d.waiting_runs) == (3, 8, 2)
    assert (d.kv_cache_tokens, d.kv_cache_used_tokens, d.kv_cache_usage) == (1000, 250, 0.25)
    assert (d.heartbeat_ms, d.seq, dict(d.max_context_tokens)) == (2000, 7, {"a": 8192})


def test_what_a_node_does_not_say_stays_unknown() -> None:
    """An older node's answer: no queue, no KV cache, no heartbeat; its name is the edge's."""
    d = description_from_pb(pb.DescribeResponse(models=[pb.ModelInfo(id="a")]), "edge-name", "h:1")
    assert (d.name, d.instance) == ("edge-name", "")
    assert (d.waiting_runs, d.kv_cache_tokens, d.kv_cache_usage, d.heartbeat_ms) == (
        None, None, None, 0,
    )  # fmt: skip


def test_too_many_models_is_refused_with_the_bound() -> None:
    """One model more than MAX_MODELS: the report is refused, naming the count and the bound."""
    report = pb.DescribeResponse(models=[pb.ModelInfo(id=f"m{i}") for i in range(MAX_MODELS + 1)])
    with pytest.raises(NodeFailedError, match=f"{MAX_MODELS + 1} models, over the limit of"):
        description_from_pb(report, "n", "h:1")


@pytest.mark.parametrize("where", ["model", "name", "instance"])
def test_a_name_too_long_is_refused_with_the_bound(where: str) -> None:
    """A model id, node name or instance id past MAX_NAME_CHARS: refused, naming the bound."""
    long = "x" * (MAX_NAME_CHARS + 1)
    report = {
        "model": pb.DescribeResponse(models=[pb.ModelInfo(id=long)]),
        "name": pb.DescribeResponse(node_name=long),
        "instance": pb.DescribeResponse(instance_id=long),
    }[where]
    with pytest.raises(NodeFailedError, match=f"over the limit of {MAX_NAME_CHARS}"):
        description_from_pb(report, "n", "h:1")


@given(
    total=st.integers(0, 2**64 - 1),
    used=st.integers(0, 2**64 - 1),
    heartbeat=st.integers(0, 2**32 - 1),
    counts=st.lists(st.integers(0, 2**32 - 1), min_size=3, max_size=3),
)
def test_numbers_are_held_to_their_ranges(
    total: int, used: int, heartbeat: int, counts: list[int]
) -> None:
    """Whatever the numbers: the KV cache in use is at most its capacity (usage 0 to 1),
    the heartbeat 0 or within HEARTBEAT_MIN_MS..HEARTBEAT_MAX_MS, counts as sent."""
    report = pb.DescribeResponse(
        active_runs=counts[0], max_runs=counts[1], waiting_runs=counts[2],
        kv_cache_tokens=total, kv_cache_used_tokens=used, heartbeat_ms=heartbeat,
    )  # fmt: skip
    d = description_from_pb(report, "n", "h:1")
    assert d.kv_cache_used_tokens is not None
    assert d.kv_cache_used_tokens <= total
    usage = d.kv_cache_usage
    if total == 0:
        assert usage is None
    else:
        assert usage is not None
        assert 0.0 <= usage <= 1.0
    assert d.heartbeat_ms == 0 or HEARTBEAT_MIN_MS <= d.heartbeat_ms <= HEARTBEAT_MAX_MS
    assert (d.active_runs, d.max_runs, d.waiting_runs) == tuple(counts)
