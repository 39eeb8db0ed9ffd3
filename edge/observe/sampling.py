"""The sampler of a process's traces, whose ratio a reload changes (`[tracing] sample_ratio`).

Imported only when tracing is on (`edge.observe.tracing`): it loads the OpenTelemetry SDK.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import (
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes


class AdjustableSampler(Sampler):
    """A client's sampled flag followed, new traces kept at a ratio that can change while
    spans are made: `default` (the environment's sampler) while the ratio is None."""

    def __init__(self, default: Sampler, ratio: float | None = None) -> None:
        self._default = default
        self._current = default
        self.set_ratio(ratio)

    def set_ratio(self, ratio: float | None) -> None:
        """New traces from now on: `ratio` of them (None: the default sampler's)."""
        self._current = self._default if ratio is None else ParentBased(TraceIdRatioBased(ratio))

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        return self._current.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return self._current.get_description()
