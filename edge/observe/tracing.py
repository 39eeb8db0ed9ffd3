"""Tracing: OpenTelemetry spans of requests and runs, off unless turned on.

One process (an edge, `iop-sim-node`, `iop-node`) has at most one `Tracing`:
its SDK tracer provider, with one BatchSpanProcessor and an OTLP/HTTP
exporter. Spans are handed to the processor's own thread when they end and
exported from there in batches: exporting never blocks the trio or asyncio
loop. `Tracing.shutdown` flushes what is left (blocking: call it from a
thread, or after the loop).

Off (the default) there is no `Tracing` at all: no provider, no exporter,
no thread, and the SDK is not even imported; the code that would make spans
sees `None` and does nothing (one `if` per request, none per chunk).

It is on with the standard environment variables, `OTEL_TRACES_EXPORTER=otlp`
(then `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
`OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`, `OTEL_BSP_*`,
`OTEL_SERVICE_NAME` apply as the SDK reads them), or with the edge's
`[tracing]` table (`TracingConfig`), whose keys win over the variables.
`OTEL_SDK_DISABLED=true` turns it off whatever else says on. A reload changes
the sample ratio and the capture of content (`Tracing.adjust`, for the spans
begun after it); turning tracing on or off, or another endpoint, needs a
restart.

W3C trace context crosses each hop as a `traceparent` header: from the
client to the edge (HTTP), from the edge to its node (gRPC metadata on the
Run call), from `iop-node` to its model server (HTTP). `extract` and
`inject` are the one place it is read and written.

The node side's spans (one per run, continued from the edge's `traceparent`)
are `edge.nodes.kit.NodeSpans`'s, built on `extract` and `set_error` here.
This module knows no trio, asyncio, HTTP framework or gRPC library: callers
hand it headers as mappings.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loguru import logger
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from edge.observe.sampling import AdjustableSampler

__all__ = [
    "EXPORTERS",
    "Tracing",
    "TracingConfig",
    "extract",
    "inject",
    "setup_tracing",
]

EXPORTERS = ("otlp",)
# The GenAI semantic conventions' name of who serves the model.
PROVIDER = "iop"
OPERATION = "chat"
# The standard switch of GenAI instrumentations for prompt and completion text.
CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """The `[tracing]` table: every key optional; None defers to the OTEL_* variables.

    Each field's metadata is the key's meaning and bounds, as `edge.config.spec` reads
    them (the parser and docs/config-reference.md).
    """

    enabled: bool | None = field(
        default=None,
        metadata={
            "doc": "On or off; unset: on when OTEL_TRACES_EXPORTER names otlp"
            " (OTEL_SDK_DISABLED wins)."
        },
    )
    exporter: str = field(
        default="otlp",
        metadata={"doc": "Where spans go: otlp, over OTLP/HTTP.", "choices": EXPORTERS},
    )
    endpoint: str | None = field(
        default=None,
        metadata={
            "doc": "OTLP/HTTP base URL (as OTEL_EXPORTER_OTLP_ENDPOINT), or the full"
            " /v1/traces URL."
        },
    )
    sample_ratio: float | None = field(
        default=None,
        metadata={
            "doc": "Share of new traces recorded (a client's sampled flag is followed).",
            "max": 1.0,
        },
    )
    capture_content: bool | None = field(
        default=None,
        metadata={"doc": "Prompt and completion text on the spans (gen_ai.input/output.messages)."},
    )


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in _TRUE


def enabled(config: TracingConfig, environ: Mapping[str, str]) -> bool:
    """Whether tracing is on: `[tracing] enabled`, else OTEL_TRACES_EXPORTER naming otlp."""
    if _flag(environ, "OTEL_SDK_DISABLED"):
        return False
    if config.enabled is not None:
        return config.enabled
    exporters = environ.get("OTEL_TRACES_EXPORTER", "")
    return "otlp" in (e.strip().lower() for e in exporters.split(","))


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a configured endpoint: a base gets `/v1/traces`."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


class Tracing:
    """The tracer of one process, and the provider behind it (see the module doc)."""

    def __init__(
        self,
        provider: TracerProvider,
        *,
        capture_content: bool,
        service: str,
        sampler: AdjustableSampler | None = None,
    ) -> None:
        self._provider = provider
        self._sampler = sampler
        self.tracer: Tracer = provider.get_tracer("iop-edge")
        self.capture_content = capture_content
        self.service = service

    def adjust(self, config: TracingConfig) -> None:
        """A reload's `[tracing]`: its sample ratio and its capture of content, for the
        spans made from now on (None keeps deferring to the environment)."""
        if self._sampler is not None:
            self._sampler.set_ratio(config.sample_ratio)
        capture = config.capture_content
        self.capture_content = _flag(os.environ, CAPTURE_ENV) if capture is None else capture

    def shutdown(self) -> None:
        """Export the spans still queued, then stop the exporter (blocking, bounded by
        the exporter's timeout)."""
        self._provider.shutdown()


def setup_tracing(
    config: TracingConfig | None = None,
    *,
    service: str,
    environ: Mapping[str, str] | None = None,
) -> Tracing | None:
    """This process's tracing, or None when it is off (nothing is set up then).

    `service` is the default `service.name` (OTEL_SERVICE_NAME wins). The
    provider is this process's own, not the global one: two edges in one
    process (tests) do not share it, and no library's spans join ours.
    """
    config = config or TracingConfig()
    env = os.environ if environ is None else environ
    if not enabled(config, env):
        return None
    # Imported only when on: an edge without tracing never loads the SDK.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from edge.observe.sampling import AdjustableSampler

    name = env.get("OTEL_SERVICE_NAME") or service
    # The SDK's sampler (OTEL_TRACES_SAMPLER(_ARG), default parentbased_always_on) as a
    # provider made without one picks it, unless a ratio is set (a reload may set one).
    default = TracerProvider(shutdown_on_exit=False).sampler
    sampler = AdjustableSampler(default, config.sample_ratio)
    provider = TracerProvider(
        sampler=sampler, resource=Resource.create({SERVICE_NAME: name}), shutdown_on_exit=False
    )
    endpoint = traces_url(config.endpoint) if config.endpoint else None
    exporter = OTLPSpanExporter(endpoint=endpoint)
    # Its own thread: spans are queued (bounded; past OTEL_BSP_MAX_QUEUE_SIZE dropped)
    # and exported every OTEL_BSP_SCHEDULE_DELAY ms or per full batch.
    provider.add_span_processor(BatchSpanProcessor(exporter))
    capture = config.capture_content
    if capture is None:
        capture = _flag(env, CAPTURE_ENV)
    logger.info(
        "tracing on: service {}, OTLP/HTTP to {}, sampler {}{}",
        name, getattr(exporter, "_endpoint", endpoint),
        provider.sampler.get_description(),
        ", with prompt and completion text" if capture else "",
    )  # fmt: skip
    return Tracing(provider, capture_content=capture, service=name, sampler=sampler)


def extract(headers: Mapping[str, str]) -> Context | None:
    """The trace context a `traceparent` header carries (None: none, or malformed)."""
    if TRACEPARENT not in headers:
        return None
    context = _PROPAGATOR.extract(carrier=headers)
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context


def inject(span: Span) -> dict[str, str]:
    """The `traceparent` (and `tracestate`) that continue `span` in the next hop."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def header_map(pairs: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The trace context headers of a raw header list (ASGI's), lower-cased names."""
    out: dict[str, str] = {}
    for name, value in pairs:
        key = name.decode("latin-1").lower()
        if key in ("traceparent", "tracestate"):
            out[key] = value.decode("latin-1")
    return out


def set_error(span: Span, error_type: str, description: str = "") -> None:
    """`error.type` and an error status on `span`."""
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, description or error_type))
