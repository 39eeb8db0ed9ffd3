"""The settings: one frozen dataclass per table of the configuration file.

Owns what each setting is and its default (`Config` and the tables under it, the
per-model defaults). Knows nothing of TOML or of checking values (`edge.config.parse`);
the settings types of the layers below (`ForwardPolicy`, `TracingConfig`) are theirs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from edge.api.policy import DEFAULT_MAX_OUTPUT_TOKENS, ForwardPolicy
from edge.observe.tracing import TracingConfig
from edge.stream.sentinel import DEFAULT_SENTINELS
from edge.stream.toolcall import ToolValidation
from edge.stream.toolparse import DEFAULT_FORMATS

REASONING_PARSERS = ("none", "think", "think_start")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    listen: str = "127.0.0.1:8080"
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    drain_timeout_s: float = 30.0
    max_body_bytes: int = 4 * 1024 * 1024
    # SSE comment sent while waiting for the first token; 0 = never.
    keepalive_s: float = 15.0
    # How often every node is asked for its models (health, /readyz, routing).
    node_refresh_s: float = 5.0
    # Client connections served at once; 0 = derived from the file-descriptor limit.
    max_connections: int = 0
    # A connection with no request in progress is closed this long after it went
    # idle; the next request's head must be complete by then (slow heads too).
    idle_timeout_s: float = 5.0
    # Time the edge waits on the client for one HTTP/1.1 request body: past it, 408.
    body_timeout_s: float = 60.0
    # Worker processes serving the listen address (edge.process.supervisor); 1 = one process.
    workers: int = 1


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = "INFO"
    format: str = "text"
    # Lines waiting for a slow reader of stderr, at most (edge.observe.logwriter): the rest
    # are dropped.
    queue_bytes: int = 1024 * 1024


@dataclass(frozen=True, slots=True)
class TimeoutsConfig:
    first_event_s: float = 120.0
    idle_s: float = 60.0
    total_s: float = 900.0
    # A client that reads nothing while this many seconds of output wait is gone.
    slow_client_s: float = 30.0


ROUTING_POLICIES = ("least_loaded", "affinity")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How runs are spread over nodes, retried, and kept off failing nodes (`[routing]`)."""

    # least_loaded: the node with the fewest runs in flight; affinity: the session's
    # node (X-Session-Id, else the request's `user`) while its load stays bounded.
    policy: str = "least_loaded"
    # Retries of a run that could not start (on another node), before the first byte.
    retries: int = 2
    # Base of the jittered exponential backoff between retries.
    retry_backoff_s: float = 0.05
    # Run failures in a row that open a node's circuit breaker.
    breaker_failures: int = 5
    # How long an open breaker keeps new runs off the node before one probe run.
    breaker_cooldown_s: float = 5.0


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The queue of requests waiting for a free node slot (`[admission]`)."""

    # Requests waiting at once; one more is answered 503 overloaded (0: no queue).
    max_queue: int = 1000
    # How long a request may wait for a slot before 503 overloaded.
    queue_timeout_s: float = 30.0
    # Bytes the requests queued and running may hold at once, as parsed (each request's
    # estimate: edge.api.footprint); one that would pass it is answered 503 overloaded.
    memory_budget_bytes: int = 512 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class KeyConfig:
    """One API key (`[[keys]]`): its name, its secret and its limits (None: no limit).

    The secret is kept out of `repr` (a config printed or logged never shows it).
    """

    name: str
    secret: str = field(repr=False)
    # Requests and tokens per minute, streams (requests in flight) at once.
    rpm: int | None = None
    tpm: int | None = None
    max_streams: int | None = None
    # The models this key may use; None: every model.
    models: tuple[str, ...] | None = None

    @property
    def limited(self) -> bool:
        """Whether any counted limit applies (and so the rate-limit headers are sent)."""
        return self.rpm is not None or self.tpm is not None or self.max_streams is not None


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Where the keys' counters live (`[limits]`): Redis, else this edge's workers."""

    # redis://HOST:PORT/DB (or rediss://, unix://): limits shared by every edge using it.
    redis_url: str | None = None
    # Redis down or slow: true lets requests through, false answers 503.
    fail_open: bool = True
    # Prefix of every Redis key the edge writes.
    key_prefix: str = "iop-edge:"
    # Deadline of one Redis call.
    redis_timeout_s: float = 0.25
    # A `max_streams` lease (Redis, the workers' shared file) expires this long after it
    # was last renewed: a stream whose release failed (Redis unreachable) or whose
    # process hangs is given back within it. A live request renews its lease every
    # `lease_renew_s` (one store call per process per renewal, for all its leases).
    lease_s: float = 10.0
    lease_renew_s: float = 3.0


@dataclass(frozen=True, slots=True)
class NodeConfig:
    name: str
    address: str
    # Runs in flight at once on this node: None, the node's Describe max_runs
    # (its 0: no limit); 0: no limit whatever the node says.
    max_runs: int | None = None

    @property
    def embedded(self) -> bool:
        return self.address == "embedded"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Per-model settings (`[models.NAME]`): the output policy and the forwarding policy."""

    strict: bool = False
    stream_buffer: bool = False
    reasoning_parser: str = "none"
    tool_call_formats: tuple[str, ...] = DEFAULT_FORMATS
    # strict | report | off; None: derived per request (edge.stream.toolcheck).
    tool_validation: ToolValidation | None = None
    sentinels: tuple[str, ...] = DEFAULT_SENTINELS
    trace_stream: bool = False
    # Forwarding policy (edge.api.policy): a request asking for more is a 400.
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    # Not forwarded unless allowed: chat_template_kwargs.chat_template, ignore_eos.
    allow_chat_template: bool = False
    allow_ignore_eos: bool = False
    # Media URL schemes the node may be sent besides data: ("http", "https").
    media_url_schemes: tuple[str, ...] = ("data",)

    @property
    def forward_policy(self) -> ForwardPolicy:
        return ForwardPolicy(
            max_output_tokens=self.max_output_tokens,
            allow_chat_template=self.allow_chat_template,
            allow_ignore_eos=self.allow_ignore_eos,
            media_url_schemes=frozenset(self.media_url_schemes) | {"data"},
        )


DEFAULT_MODEL = ModelConfig()
# The simulated models write <think> into content like the models they stand for.
SIM_MODEL = ModelConfig(reasoning_parser="think")


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    nodes: tuple[NodeConfig, ...] = (NodeConfig("embedded", "embedded"),)
    models: Mapping[str, ModelConfig] = field(default_factory=dict)
    keys: tuple[KeyConfig, ...] = ()
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    source: str = "<defaults>"

    def model(self, name: str) -> ModelConfig:
        found = self.models.get(name)
        if found is not None:
            return found
        return SIM_MODEL if name.startswith("sim-") else DEFAULT_MODEL
