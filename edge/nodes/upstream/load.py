"""An upstream's load, read from its Prometheus `/metrics` text.

`load_from_metrics` turns the text vLLM, SGLang or llama.cpp's `llama-server`
expose into a `Load`: the requests running and waiting, and the KV cache's
capacity and use in tokens. Each server has its own names (its *dialect*,
told by the metric prefix: `vllm:`, `sglang:`, `llamacpp:`):

- vLLM: `vllm:num_requests_running`, `vllm:num_requests_waiting`, the KV
  cache's use as a fraction, `vllm:kv_cache_usage_perc` (older releases:
  `vllm:gpu_cache_usage_perc`), and its size in the labels of the info
  gauge `vllm:cache_config_info`, `num_gpu_blocks` x `block_size` tokens.
  With data parallelism each engine has its samples (label `engine`): the
  capacity is the sum of the engines', the use each engine's fraction of its own.
- SGLang: `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
  `sglang:max_total_num_tokens` (the KV pool's size), `sglang:num_used_tokens`
  (or, without it, `sglang:token_usage` x the pool).
- llama.cpp (`--metrics`): `llamacpp:requests_processing`,
  `llamacpp:requests_deferred`; builds of before mid-2025 also expose
  `llamacpp:kv_cache_tokens` (the cells in use) and
  `llamacpp:kv_cache_usage_ratio` (their share of the context), whence the
  capacity, tokens / ratio, while the ratio is above 0. Current builds have
  no KV-cache metric: those fields stay unknown.

Samples of one metric (several models, engines or ranks) are summed. What the
upstream says is not trusted: only the lines of the metrics above are parsed
(with prometheus_client's parser; a scan of the text, linear, picks them);
a value that is not finite or is negative leaves its field unknown, counts
are clamped to uint32 and tokens to uint64, a fraction to [0, 1], and the KV
cache's use to its capacity. A field the text does not give is None (unknown).

Pure: it must not know sockets, httpx, grpclib or asyncio. The text may be
large (MAX_METRICS_BYTES): the caller runs this off its event loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["DIALECTS", "MAX_METRICS_BYTES", "SOURCES", "Load", "LoadError", "load_from_metrics"]

# The longest /metrics body read; a larger one is refused, not parsed. vLLM's,
# with its histograms, is some 100-300 KiB for one model.
MAX_METRICS_BYTES: Final = 4 * 1024 * 1024
UINT32_MAX: Final = 2**32 - 1
UINT64_MAX: Final = 2**64 - 1

VLLM: Final = "vllm"
SGLANG: Final = "sglang"
LLAMACPP: Final = "llamacpp"
DIALECTS: Final = (VLLM, SGLANG, LLAMACPP)
# What `--load-source` takes: a dialect, `auto` (told by the metric prefix) or `none`.
SOURCES: Final = ("auto", *DIALECTS, "none")

_NAMES: Final[Mapping[str, frozenset[str]]] = {
    VLLM: frozenset(
        {
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc",
            "vllm:cache_config_info",
        }
    ),
    SGLANG: frozenset(
        {
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:max_total_num_tokens",
            "sglang:num_used_tokens",
            "sglang:token_usage",
        }
    ),
    LLAMACPP: frozenset(
        {
            "llamacpp:requests_processing",
            "llamacpp:requests_deferred",
            "llamacpp:kv_cache_tokens",
            "llamacpp:kv_cache_usage_ratio",
        }
    ),
}
_ALL_NAMES: Final = frozenset().union(*_NAMES.values())

Labels = Mapping[str, str]
# One metric's samples: (labels, value), values checked finite and non-negative.
Samples = list[tuple[Labels, float]]


class LoadError(ValueError):
    """The text is not Prometheus' exposition format, or holds none of the metrics read."""


@dataclass(frozen=True, slots=True)
class Load:
    """What an upstream says of its load; None: it does not say (or said nonsense)."""

    dialect: str
    running: int | None = None
    waiting: int | None = None
    kv_cache_tokens: int | None = None
    kv_cache_used_tokens: int | None = None


def load_from_metrics(text: str, source: str = "auto") -> Load:
    """The load in `text`, read as `source` says (a dialect, or `auto`: by the prefix
    of the first metric read). Raises LoadError when it has none of the dialect's
    metrics, or is not exposition format."""
    if source not in ("auto", *DIALECTS):
        raise ValueError(f"load source {source!r} is not one of {', '.join(SOURCES)}")
    names = _ALL_NAMES if source == "auto" else _NAMES[source]
    lines, first = _pick_lines(text, names)
    if first is None:
        wanted = "vLLM, SGLang or llama.cpp" if source == "auto" else source
        raise LoadError(f"no {wanted} load metric in the text")
    dialect = source if source != "auto" else first.split(":", 1)[0]
    samples = _parse(lines, _NAMES[dialect])
    if dialect == VLLM:
        return _vllm(samples)
    if dialect == SGLANG:
        return _sglang(samples)
    return _llamacpp(samples)


def _pick_lines(text: str, names: frozenset[str]) -> tuple[list[str], str | None]:
    """The lines (samples, HELP and TYPE) of the metrics in `names`, and the first such
    metric's name. One pass over the text: the rest is never parsed."""
    picked: list[str] = []
    first: str | None = None
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] in names:
                picked.append(line)
            continue
        end = len(line)
        for stop in ("{", " ", "\t"):
            at = line.find(stop, 0, end)
            if at != -1:
                end = at
        name = line[:end]
        if name in names:
            picked.append(line)
            first = first or name
    return picked, first


def _parse(lines: list[str], names: frozenset[str]) -> dict[str, Samples]:
    """Each metric's samples, checked: a metric with a value that is not finite or is
    negative is dropped whole (its field is then unknown)."""
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except Exception as exc:  # the parser's errors are ValueErrors, mostly: any is a refusal
        raise LoadError(f"not Prometheus exposition text: {exc}") from None
    samples: dict[str, Samples] = {}
    bad: set[str] = set()
    for family in families:
        for sample in family.samples:
            if sample.name not in names:
                continue
            value = float(sample.value)
            if not math.isfinite(value) or value < 0:
                bad.add(sample.name)
                continue
            samples.setdefault(sample.name, []).append((sample.labels, value))
    for name in bad:
        samples.pop(name, None)
    return samples


def _total(samples: Samples | None) -> float | None:
    return None if not samples else sum(value for _, value in samples)


def _count(value: float | None) -> int | None:
    return None if value is None else min(round(value), UINT32_MAX)


def _tokens(value: float | None) -> int | None:
    return None if value is None else min(round(value), UINT64_MAX)


def _fraction(value: float) -> float:
    return min(value, 1.0)


def _label_int(labels: Labels, key: str) -> int | None:
    """A label holding a positive whole number (vLLM writes "None" before it knows)."""
    text = labels.get(key, "")
    if not (0 < len(text) <= 20 and text.isascii() and text.isdigit()):
        return None
    number = int(text)
    return number if number > 0 else None


def _used(capacity: int | None, used: float | None) -> int | None:
    tokens = _tokens(used)
    if tokens is None or capacity is None:
        return tokens
    return min(tokens, capacity)


def _vllm(samples: dict[str, Samples]) -> Load:
    """Running and waiting summed; the KV cache per engine (label `engine`), summed."""
    capacities: dict[str, int | None] = {}
    for labels, _ in samples.get("vllm:cache_config_info", ()):
        blocks, size = _label_int(labels, "num_gpu_blocks"), _label_int(labels, "block_size")
        capacities[labels.get("engine", "")] = blocks * size if blocks and size else None
    usage = samples.get("vllm:kv_cache_usage_perc") or samples.get("vllm:gpu_cache_usage_perc")
    capacity, used = _per_engine(capacities, usage or [])
    return Load(
        VLLM,
        running=_count(_total(samples.get("vllm:num_requests_running"))),
        waiting=_count(_total(samples.get("vllm:num_requests_waiting"))),
        kv_cache_tokens=_tokens(capacity),
        kv_cache_used_tokens=_used(_tokens(capacity), used),
    )


def _per_engine(
    capacities: Mapping[str, int | None], usage: Samples
) -> tuple[int | None, float | None]:
    """(capacity, used) over the engines a usage sample names; a usage sample whose
    engine has no known capacity (and no single capacity stands for all) makes
    both unknown. Without usage samples, the capacity alone."""
    if not usage:
        known = list(capacities.values())
        if not known or None in known:
            return None, None
        return sum(c for c in known if c is not None), None
    single = next(iter(capacities.values())) if len(capacities) == 1 else None
    capacity, used = 0, 0.0
    for labels, fraction in usage:
        engine = labels.get("engine", "")
        cap = capacities.get(engine, single)
        if cap is None:
            return None, None
        capacity += cap
        used += cap * _fraction(fraction)
    return capacity, used


def _sglang(samples: dict[str, Samples]) -> Load:
    """Running and queued summed; the pool summed, its use counted (or its fraction of it)."""
    capacity = _total(samples.get("sglang:max_total_num_tokens"))
    used = _total(samples.get("sglang:num_used_tokens"))
    if used is None and capacity is not None:
        used = _matched_use(
            samples.get("sglang:max_total_num_tokens", []), samples.get("sglang:token_usage", [])
        )
    return Load(
        SGLANG,
        running=_count(_total(samples.get("sglang:num_running_reqs"))),
        waiting=_count(_total(samples.get("sglang:num_queue_reqs"))),
        kv_cache_tokens=_tokens(capacity),
        kv_cache_used_tokens=_used(_tokens(capacity), used),
    )


def _matched_use(pools: Samples, usage: Samples) -> float | None:
    """Each rank's fraction of its own pool (samples matched by their labels), summed."""
    fractions = {_key(labels): fraction for labels, fraction in usage}
    if not fractions:
        return None
    used = 0.0
    for labels, pool in pools:
        fraction = fractions.get(_key(labels))
        if fraction is None:
            return None
        used += pool * _fraction(fraction)
    return used


def _key(labels: Labels) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def _llamacpp(samples: dict[str, Samples]) -> Load:
    """Processing and deferred; the KV cells in use, and the context they are a share of."""
    used = _total(samples.get("llamacpp:kv_cache_tokens"))
    ratio = _total(samples.get("llamacpp:kv_cache_usage_ratio"))
    capacity = None
    if used is not None and ratio is not None and 0 < ratio <= 1:
        capacity = used / ratio
    return Load(
        LLAMACPP,
        running=_count(_total(samples.get("llamacpp:requests_processing"))),
        waiting=_count(_total(samples.get("llamacpp:requests_deferred"))),
        kv_cache_tokens=_tokens(capacity),
        kv_cache_used_tokens=_used(_tokens(capacity), used),
    )
