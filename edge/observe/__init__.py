"""Observability: logs, metrics and traces.

Owns logging (`log`: loguru, the stdlib loggers routed in; `logbound`: every
value a line quotes, bounded; `logwriter`: the queue in front of stderr that
drops rather than blocks), the Prometheus metrics (`metrics`; `catalog`: each
one's name, help, labels and buckets) and OpenTelemetry tracing (`tracing`;
`sampling`: its sampler, whose ratio a reload changes).

Used by every layer above it; imports only `stream` (outcome types, for
counting) and `errors`.
"""
