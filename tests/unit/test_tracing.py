"""Tracing's switch: off unless the config or the OTEL_* environment turns it on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from edge.config import ConfigError, parse_config
from edge.observe.tracing import TracingConfig, enabled, extract, setup_tracing, traces_url


@pytest.mark.parametrize(
    ("config", "environ", "on"),
    [
        (TracingConfig(), {}, False),
        (TracingConfig(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
        (TracingConfig(), {"OTEL_TRACES_EXPORTER": "otlp"}, True),
        (TracingConfig(), {"OTEL_TRACES_EXPORTER": "console, OTLP"}, True),
        (TracingConfig(), {"OTEL_TRACES_EXPORTER": "none"}, False),
        (TracingConfig(enabled=True), {}, True),
        (TracingConfig(enabled=False), {"OTEL_TRACES_EXPORTER": "otlp"}, False),
        (TracingConfig(enabled=True), {"OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_switch(config: TracingConfig, environ: dict[str, str], on: bool) -> None:
    """`[tracing] enabled` wins over OTEL_TRACES_EXPORTER; OTEL_SDK_DISABLED over both."""
    assert enabled(config, environ) is on


def test_off_sets_nothing_up() -> None:
    """Off, setup returns None and the SDK (provider, exporter, its thread) is never loaded."""
    code = (
        "import sys; from edge.process.daemon import serve;"
        " from edge.observe.tracing import setup_tracing;"
        " assert setup_tracing(service='x', environ={}) is None;"
        " loaded = [m for m in sys.modules if m.startswith('opentelemetry.sdk')"
        " or m.startswith('opentelemetry.exporter')]; assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_on_builds_a_provider_with_the_configured_sampler_and_endpoint() -> None:
    """On, the provider is this process's own, its sampler the configured ratio (parent
    based), its exporter the configured endpoint's /v1/traces."""
    tracing = setup_tracing(
        TracingConfig(enabled=True, endpoint="http://127.0.0.1:9/", sample_ratio=0.25),
        service="iop-edge",
        environ={},
    )
    assert tracing is not None
    try:
        description = tracing._provider.sampler.get_description()
        assert description.startswith("ParentBased{root:TraceIdRatioBased{0.25}")
        assert tracing.service == "iop-edge"
        assert tracing.capture_content is False
    finally:
        tracing.shutdown()


def test_traces_url_and_traceparent() -> None:
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"
    assert extract({}) is None
    assert extract({"traceparent": "garbage"}) is None
    assert extract({"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"}) is not None


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"endpoint": "localhost:4318"}, "tracing.endpoint: expected http://HOST:PORT"),
        ({"sample_ratio": 1.5}, "tracing.sample_ratio: must be <= 1"),
        ({"exporter": "jaeger"}, "tracing.exporter: expected one of otlp"),
        ({"enable": True}, "unknown key tracing.enable"),
    ],
)
def test_config_mistakes(table: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"tracing": table}, "edge.toml")


def test_config_keys() -> None:
    config = parse_config(
        {"tracing": {"enabled": True, "endpoint": "http://otel:4318", "sample_ratio": 0.1,
                     "capture_content": True}},
        "edge.toml",
    )  # fmt: skip
    assert config.tracing == TracingConfig(
        enabled=True, endpoint="http://otel:4318", sample_ratio=0.1, capture_content=True
    )
    assert parse_config({}, "edge.toml").tracing == TracingConfig()


def test_captured_output_is_bounded_while_it_streams() -> None:
    """With capture_content, a request's span keeps at most MAX_CAPTURED_CHARS of the
    answer (plus the event that crossed it), however long the answer is."""
    from opentelemetry.trace import INVALID_SPAN_CONTEXT, NonRecordingSpan

    from edge.http.spans import MAX_CAPTURED_CHARS, RequestTrace
    from edge.stream.output import ContentOut, ReasoningOut

    trace = RequestTrace(NonRecordingSpan(INVALID_SPAN_CONTEXT), "chat", capture=True)
    chunk = "y" * 1000
    for _ in range(1000):  # 2 MB of answer
        trace._take([ContentOut(chunk), ReasoningOut(chunk)])
    kept = sum(map(len, trace._output)) + sum(map(len, trace._reasoning))
    assert MAX_CAPTURED_CHARS <= kept <= MAX_CAPTURED_CHARS + len(chunk)
