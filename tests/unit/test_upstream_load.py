"""iop-node's reading of an upstream's load from its /metrics text (`edge.nodes.upstream.load`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.nodes.upstream.load import (
    MAX_METRICS_BYTES,
    UINT32_MAX,
    UINT64_MAX,
    Load,
    LoadError,
    load_from_metrics,
)

FIXTURES = Path(__file__).parent.parent / "integration" / "upstream_fixtures" / "metrics"

EXPECTED = {
    "vllm": Load("vllm", running=4, waiting=2, kv_cache_tokens=881152, kv_cache_used_tokens=165216),
    "vllm-v0": Load(
        "vllm", running=2, waiting=5, kv_cache_tokens=1308272, kv_cache_used_tokens=654136
    ),
    "sglang": Load(
        "sglang", running=6, waiting=4, kv_cache_tokens=160716, kv_cache_used_tokens=48213
    ),
    "llamacpp": Load(
        "llamacpp", running=2, waiting=1, kv_cache_tokens=32768, kv_cache_used_tokens=6144
    ),
    "llamacpp-current": Load("llamacpp", running=1, waiting=0),
}


def _fixture(name: str) -> str:
    return (FIXTURES / f"{name}.prom").read_text()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_recorded_server_is_read(name: str) -> None:
    """Each server's recorded /metrics gives its load, told apart by the metric prefix
    alone, and the same when the dialect is named."""
    expected = EXPECTED[name]
    assert load_from_metrics(_fixture(name)) == expected
    assert load_from_metrics(_fixture(name), expected.dialect) == expected


def test_every_fixture_is_expected() -> None:
    """No recorded /metrics goes untested."""
    assert {p.stem for p in FIXTURES.glob("*.prom")} == set(EXPECTED)


def test_the_wrong_dialect_named_is_an_error() -> None:
    """A source named that the text does not speak is a LoadError naming it."""
    with pytest.raises(LoadError, match="no sglang load metric"):
        load_from_metrics(_fixture("vllm"), "sglang")
    with pytest.raises(ValueError, match="not one of"):
        load_from_metrics(_fixture("vllm"), "ollama")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<!doctype html><title>Web UI</title>",
        '{"error": "not found"}',
        # An iop-edge upstream has a /metrics of its own, with none of these.
        "# TYPE iop_edge_requests_total counter\niop_edge_requests_total 3\n",
    ],
)
def test_text_without_known_metrics_is_an_error(text: str) -> None:
    """A body with none of the three servers' metrics (empty, HTML, JSON, another
    program's metrics) is a LoadError, not an empty load."""
    with pytest.raises(LoadError, match=r"no vLLM, SGLang or llama\.cpp load metric"):
        load_from_metrics(text)


def test_a_malformed_line_of_a_read_metric_is_an_error() -> None:
    """A line of a read metric the parser cannot read refuses the whole text."""
    with pytest.raises(LoadError, match="not Prometheus exposition text"):
        load_from_metrics("vllm:num_requests_running{engine=0} 3\n")


def test_malformed_lines_of_other_metrics_are_never_parsed() -> None:
    """Lines of metrics not read are skipped unparsed, however broken."""
    text = "garbage{{{ line\n\x00\xff\nvllm:num_requests_running 3\n"
    assert load_from_metrics(text).running == 3


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-1", "-0.5"])
def test_values_not_finite_or_negative_leave_the_field_unknown(value: str) -> None:
    """A count that is NaN, infinite or negative leaves that field unknown (not 0),
    and the other fields are still read."""
    text = f"vllm:num_requests_running {value}\nvllm:num_requests_waiting 2\n"
    assert load_from_metrics(text) == Load("vllm", running=None, waiting=2)


def test_counts_and_tokens_are_clamped_to_their_fields() -> None:
    """Counts past uint32 and tokens past uint64 are clamped to the fields' ranges, and
    the KV cache's use to its capacity (a fraction above 1 is 1)."""
    text = (
        "sglang:num_running_reqs 1e300\n"
        "sglang:num_queue_reqs 5e9\n"
        "sglang:max_total_num_tokens 1e30\n"
        "sglang:token_usage 7\n"
    )
    load = load_from_metrics(text)
    assert (load.running, load.waiting) == (UINT32_MAX, UINT32_MAX)
    assert load.kv_cache_tokens == UINT64_MAX
    assert load.kv_cache_used_tokens == UINT64_MAX
    text = (
        "vllm:num_requests_running 2.6\n"
        + _cache_info("16", "100")
        + "vllm:kv_cache_usage_perc 3\n"
    )
    load = load_from_metrics(text)
    assert (load.running, load.kv_cache_tokens, load.kv_cache_used_tokens) == (3, 1600, 1600)


def _cache_info(block_size: str, blocks: str, engine: str | None = None) -> str:
    extra = "" if engine is None else f',engine="{engine}"'
    labels = f'block_size="{block_size}",num_gpu_blocks="{blocks}"{extra}'
    return f"vllm:cache_config_info{{{labels}}} 1.0\n"


@pytest.mark.parametrize(
    ("block_size", "blocks"), [("16", "None"), ("x", "10"), ("16", "0"), ("16", "9" * 30)]
)
def test_a_cache_size_vllm_does_not_know_leaves_the_cache_unknown(
    block_size: str, blocks: str
) -> None:
    """cache_config_info labels that are not positive numbers of sane length (vLLM
    writes "None" before it has profiled) leave the KV cache unknown."""
    text = _cache_info(block_size, blocks) + "vllm:kv_cache_usage_perc 0.5\n"
    load = load_from_metrics(text)
    assert (load.kv_cache_tokens, load.kv_cache_used_tokens) == (None, None)


def test_vllm_engines_are_matched_by_their_label() -> None:
    """Each engine's usage is a fraction of its own cache; an engine whose cache size is
    not given leaves the whole KV cache unknown, never a wrong sum."""
    text = (
        _cache_info("16", "100", "0")
        + _cache_info("32", "100", "1")
        + 'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        + 'vllm:kv_cache_usage_perc{engine="1"} 0.25\n'
    )
    load = load_from_metrics(text)
    assert (load.kv_cache_tokens, load.kv_cache_used_tokens) == (4800, 1600)
    text = _cache_info("16", "100", "0") + _cache_info("16", "100", "1")
    text += 'vllm:kv_cache_usage_perc{engine="2"} 0.5\n'
    load = load_from_metrics(text)
    assert (load.kv_cache_tokens, load.kv_cache_used_tokens) == (None, None)


def test_vllm_prefers_the_newer_kv_metric() -> None:
    """With both names (releases that kept the old one beside the new), the newer
    `kv_cache_usage_perc` is read."""
    text = (
        _cache_info("16", "100") + "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.5\n"
    )
    assert load_from_metrics(text).kv_cache_used_tokens == 800


def test_vllm_capacity_without_usage() -> None:
    """A cache size without a usage gauge gives the capacity and leaves the use unknown."""
    load = load_from_metrics(_cache_info("16", "100"))
    assert (load.kv_cache_tokens, load.kv_cache_used_tokens) == (1600, None)


def test_sglang_without_used_tokens_takes_the_fraction() -> None:
    """Without `num_used_tokens`, SGLang's use is `token_usage` of each rank's own pool."""
    text = "\n".join(
        line for line in _fixture("sglang").splitlines() if "num_used_tokens" not in line
    )
    load = load_from_metrics(text)
    assert (load.kv_cache_tokens, load.kv_cache_used_tokens) == (160716, round(0.3 * 160716))


def test_llamacpp_idle_cache_has_no_capacity() -> None:
    """llama.cpp's capacity is derived from the share in use: at 0 it is unknown, the
    use (0) known."""
    text = "llamacpp:kv_cache_usage_ratio 0\nllamacpp:kv_cache_tokens 0\n"
    load = load_from_metrics(text)
    assert (load.kv_cache_tokens, load.kv_cache_used_tokens) == (None, 0)


def test_samples_of_several_models_are_summed() -> None:
    """The whole server's load: samples of one metric (models, ranks) are summed."""
    text = (
        'vllm:num_requests_running{model_name="a"} 2\nvllm:num_requests_running{model_name="b"} 5\n'
    )
    assert load_from_metrics(text).running == 7


def test_a_body_at_the_limit_is_read_in_one_pass() -> None:
    """A body of MAX_METRICS_BYTES of other metrics (histogram buckets) with the read
    ones at its end is read: only the read metrics' lines reach the parser."""
    bucket = 'vllm:e2e_request_latency_seconds_bucket{le="0.5",model_name="m"} 1.0\n'
    filler = bucket * ((MAX_METRICS_BYTES - 200) // len(bucket))
    text = filler + "vllm:num_requests_running 1\nvllm:num_requests_waiting 9\n"
    assert len(text) <= MAX_METRICS_BYTES
    assert load_from_metrics(text) == Load("vllm", running=1, waiting=9)
