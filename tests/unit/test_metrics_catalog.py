"""The metrics as declared (`edge.observe.catalog`) are the metrics on /metrics.

Each entry of the catalog is on the scrape of a fresh `EdgeMetrics` (or
`SupervisorMetrics`) with its name, help text, type, labels and buckets; names
and attributes are unique; each attribute is declared on its owner with its
kind, so the type checker sees `metrics.requests.labels(...)`.
"""

from __future__ import annotations

import math
from typing import get_type_hints

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edge.observe.catalog import EDGE_METRICS, SUPERVISOR_METRICS, MetricSpec
from edge.observe.metrics import EdgeMetrics, SupervisorMetrics

OWNERS = [
    pytest.param(EdgeMetrics, EDGE_METRICS, id="edge"),
    pytest.param(SupervisorMetrics, SUPERVISOR_METRICS, id="supervisor"),
]


def _scrape(owner: object, specs: tuple[MetricSpec, ...]) -> str:
    """The exposition of `owner` once each of its metrics has a series."""
    for spec in specs:
        metric = getattr(owner, spec.attr)
        if spec.labels:
            metric = metric.labels(*(f"v{i}" for i in range(len(spec.labels))))
        if isinstance(metric, Histogram):
            metric.observe(0)
    registry = owner.registry
    assert isinstance(registry, CollectorRegistry)
    return generate_latest(registry).decode()


def _without_le(labels: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in labels.items() if name != "le"}


@pytest.mark.parametrize(("owner", "specs"), OWNERS)
def test_every_declared_metric_is_on_the_scrape_with_its_help(
    owner: type[EdgeMetrics | SupervisorMetrics], specs: tuple[MetricSpec, ...]
) -> None:
    """A fresh owner shows every metric of its table: name, help, type, labels (in their
    order), buckets, and the series of its preset label values."""
    fresh = generate_latest(owner().registry).decode()
    for spec in specs:
        suffix = "_total" if spec.kind is Counter else ""
        assert f"# HELP {spec.name}{suffix} {spec.help}\n" in fresh
        for value in spec.preset:
            values = value if isinstance(value, tuple) else (value,)
            labels = ",".join(f'{n}="{v}"' for n, v in zip(spec.labels, values, strict=True))
            assert f"{spec.name}{suffix}{{{labels}}} 0.0\n" in fresh
    families = {f.name: f for f in text_string_to_metric_families(_scrape(owner(), specs))}
    for spec in specs:
        family = families[spec.name]
        assert family.documentation == spec.help
        assert family.type == spec.kind.__name__.lower()
        # The series `_scrape` made: each label named in its place (`.labels(...)` is positional).
        made = {name: f"v{i}" for i, name in enumerate(spec.labels)}
        assert made in [_without_le(sample.labels) for sample in family.samples]
        if spec.kind is Histogram:
            bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
            assert bounds == [*map(float, spec.buckets), math.inf]


@pytest.mark.parametrize(("owner", "specs"), OWNERS)
def test_names_and_attributes_are_unique(
    owner: type[EdgeMetrics | SupervisorMetrics], specs: tuple[MetricSpec, ...]
) -> None:
    """No two metrics of one owner share a name or an attribute."""
    assert len({spec.name for spec in specs}) == len(specs)
    assert len({spec.attr for spec in specs}) == len(specs)


def test_a_name_counted_by_workers_and_supervisor_alike_is_one_metric() -> None:
    """The supervisor and the workers write into one directory: a name both count is
    declared the same by both (its preset series aside)."""
    edge = {spec.name: spec for spec in EDGE_METRICS}
    shared = [spec for spec in SUPERVISOR_METRICS if spec.name in edge]
    assert shared
    for spec in shared:
        theirs = edge[spec.name]
        assert (spec.kind, spec.attr, spec.help, spec.labels, spec.buckets, spec.merge) == (
            theirs.kind, theirs.attr, theirs.help, theirs.labels, theirs.buckets, theirs.merge
        )  # fmt: skip


def test_buckets_and_merge_modes_belong_to_their_kinds() -> None:
    """Buckets are declared on every histogram and nothing else; a merge mode on gauges only."""
    for spec in EDGE_METRICS + SUPERVISOR_METRICS:
        assert bool(spec.buckets) == (spec.kind is Histogram), spec.name
        if spec.kind is not Gauge:
            assert spec.merge == "all", spec.name


@pytest.mark.parametrize(("owner", "specs"), OWNERS)
def test_each_metric_is_declared_on_its_owner_with_its_kind(
    owner: type[EdgeMetrics | SupervisorMetrics], specs: tuple[MetricSpec, ...]
) -> None:
    """The class annotations (what the type checker reads) are the table, and each
    attribute of a fresh owner is a metric of its declared kind."""
    kinds = (Counter, Gauge, Histogram)
    declared = {a: t for a, t in get_type_hints(owner).items() if t in kinds}
    assert declared == {spec.attr: spec.kind for spec in specs}
    made = owner()
    for spec in specs:
        assert type(getattr(made, spec.attr)) is spec.kind
