"""The settings: one frozen dataclass per table of the configuration file.

Owns what each setting is and its default (`Config` and the tables under it, the
per-model defaults); the tables of the nodes and of how runs reach them are
`edge.config.routing`'s. Knows nothing of TOML or of checking values
(`edge.config.parse`); the settings types of the layers below (`ForwardPolicy`,
`TracingConfig`) are theirs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from edge.api.policy import DEFAULT_MAX_OUTPUT_TOKENS, ForwardPolicy
from edge.config.address import UPSTREAM_SCHEMES
from edge.config.routing import AdmissionConfig, NodeConfig, RoutingConfig
from edge.observe.tracing import TracingConfig
from edge.stream.sentinel import DEFAULT_SENTINELS
from edge.stream.toolcall import ToolValidation
from edge.stream.toolparse import DEFAULT_FORMATS

REASONING_PARSERS = ("none", "think", "think_start")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    # The HTTP address the edge listens on, HOST:PORT.
    listen: str = "127.0.0.1:8080"
    # When set, /v1/* requires `Authorization: Bearer <key>` with one of these keys.
    api_keys: tuple[str, ...] = ()
    # More api_keys from a file: one per line, # comments (relative to the config file).
    api_keys_file: str | None = None
    # How long the streams in flight may finish on shutdown.
    drain_timeout_s: float = 30.0
    # The largest request body; a larger one is answered 413.
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
    # Worker processes serving the listen address (edge.process.supervisor); 1 = one
    # process; "auto": one per CPU this process may run on.
    workers: int = 1
    # Browser origins allowed to call the API (CORS), e.g. "https://app.example.com", or
    # "*" for any; empty: no CORS headers at all (docs/operations.md).
    cors_allow_origins: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LogConfig:
    # The least severe level logged.
    level: str = "INFO"
    # text: lines for a terminal; json: one object per line (journald).
    format: str = "text"
    # Lines waiting for a slow reader of stderr, at most (edge.observe.logwriter): the rest
    # are dropped.
    queue_bytes: int = 1024 * 1024


@dataclass(frozen=True, slots=True)
class TimeoutsConfig:
    # The longest wait from dispatching a run to the node's first event.
    first_event_s: float = 120.0
    # The longest wait between two events of the node.
    idle_s: float = 60.0
    # The longest a whole run may take.
    total_s: float = 900.0
    # A client that reads nothing while this many seconds of output wait is gone.
    slow_client_s: float = 30.0
    # Characters of output the process holds for its streams in all: past it, the streams
    # whose clients stopped reading longest ago are ended as slow clients at once (the
    # default fits 128 stalled streams, 256 Ki characters each).
    slow_client_backlog_chars: int = 32 * 1024 * 1024


CACHE_SCOPES = ("key", "shared")


@dataclass(frozen=True, slots=True)
class KeyConfig:
    """One API key (`[[keys]]`): its name, its secret and its limits (None: no limit).

    The secret is kept out of `repr` (a config printed or logged never shows it).
    """

    # The key's name in logs and metrics (the key itself never is): 1 to 64 of
    # A-Z a-z 0-9 . _ -; required.
    name: str
    # The key itself: from `key`, `key_env` or `key_file` (edge.config.keys).
    secret: str = field(repr=False)
    # Requests per minute; unset: no limit.
    rpm: int | None = None
    # Tokens per minute, counted when each run ends; unset: no limit.
    tpm: int | None = None
    # Streams (requests in flight) at once; unset: no limit.
    max_streams: int | None = None
    # The models this key may use (others are answered like unknown models); unset:
    # every model.
    models: tuple[str, ...] | None = None
    # Whose cached prompt prefixes this key's requests may reuse: "key" (its own only:
    # another key cannot learn a prompt from the cache) or "shared" (those of every
    # key that shares, e.g. one application's users sharing a system prompt).
    cache_scope: str = "key"

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
    # process hangs is given back within it.
    lease_s: float = 10.0
    # How often the leases a process holds are renewed (one store call per process
    # per renewal, for all of them); at most half of lease_s.
    lease_renew_s: float = 3.0


RESPONSE_STORES = ("sqlite", "redis", "off")


@dataclass(frozen=True, slots=True)
class ResponsesConfig:
    """Where `/v1/responses` keeps the responses later requests refer to (`[responses]`)."""

    # sqlite: a file shared by this edge's workers; redis: shared by every edge using
    # it; off: nothing is kept (previous_response_id and item_reference are refused).
    store: str = "sqlite"
    # The SQLite file (relative to the config file); unset: responses.sqlite3 in
    # systemd's $STATE_DIRECTORY, else in the edge run's own directory, removed when the
    # edge stops.
    path: str | None = None
    # redis://HOST:PORT/DB (or rediss://, unix://) for store = "redis"; unset: [limits]
    # redis_url.
    redis_url: str | None = None
    # Prefix of every Redis key of the store.
    key_prefix: str = "iop-edge:responses:"
    # Deadline of one Redis call of the store.
    redis_timeout_s: float = 2.0
    # Responses kept at most: past it, the oldest are evicted.
    max_responses: int = 10_000
    # Bytes kept at most (each response: its Response object, its context and its
    # output items, as JSON): past it, the oldest are evicted.
    max_bytes: int = 256 * 1024 * 1024
    # A larger response is answered but not kept (logged and counted).
    max_response_bytes: int = 8 * 1024 * 1024
    # Responses one key (tenant) keeps at most: past it, that key's oldest are evicted,
    # never another's. Unset: a quarter of max_responses.
    per_key_max_responses: int | None = None
    # Bytes one key keeps at most, as max_bytes counts them: past it, that key's oldest
    # are evicted. Unset: a quarter of max_bytes.
    per_key_max_bytes: int | None = None
    # A response is kept this long after it was stored, at most.
    ttl_s: float = 7 * 24 * 3600.0

    @property
    def key_max_responses(self) -> int:
        """What one key keeps at most, in responses (`per_key_max_responses`)."""
        if self.per_key_max_responses is not None:
            return self.per_key_max_responses
        return max(1, self.max_responses // 4)

    @property
    def key_max_bytes(self) -> int:
        """What one key keeps at most, in bytes (`per_key_max_bytes`)."""
        if self.per_key_max_bytes is not None:
            return self.per_key_max_bytes
        return max(self.max_response_bytes, self.max_bytes // 4)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Per-model settings (`[models.NAME]`): the output policy and the forwarding policy."""

    # Strict output for every request: reasoning hidden unless asked for, JSON answers
    # checked against their response_format, tool calls validated strictly.
    strict: bool = False
    # Under strict output, content is held until its check passed (a failing answer
    # sends no content byte).
    stream_buffer: bool = False
    # think: `<think>...</think>` split out of content; think_start: the template opened
    # the think block already; the default for sim-* models is think.
    reasoning_parser: str = "none"
    # The formats of tool calls written as text that are parsed (json and fenced are
    # opt-in).
    tool_call_formats: tuple[str, ...] = DEFAULT_FORMATS
    # strict, report or off; unset: derived per request, report or strict under strict
    # output (edge.stream.toolcheck).
    tool_validation: ToolValidation | None = None
    # Leaked special tokens removed from the output.
    sentinels: tuple[str, ...] = DEFAULT_SENTINELS
    # Per-chunk trace logging for the model's runs.
    trace_stream: bool = False
    # Forwarding policy (edge.api.policy): a request asking for more output tokens
    # (max_tokens, max_completion_tokens, min_tokens) is a 400.
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    # Forward chat_template_kwargs.chat_template (dropped unless allowed).
    allow_chat_template: bool = False
    # Forward ignore_eos (dropped unless allowed).
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
    """The whole file. The comment above each field of these dataclasses is its meaning in
    the generated reference (docs/config-reference.md, `edge.config.reference`): keep one
    above every setting the file can set."""

    # The HTTP server: address, API keys, bodies, connections, workers.
    server: ServerConfig = field(default_factory=ServerConfig)
    # Logs on stderr.
    log: LogConfig = field(default_factory=LogConfig)
    # The deadlines of a run, per edge (not per request).
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    # How runs are spread over the nodes, retried, and kept off failing nodes.
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # The queue of requests waiting for a free node slot, and the memory budget.
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # The nodes, one table each; unset: one simulated node, in-process.
    nodes: tuple[NodeConfig, ...] = (NodeConfig("embedded", "embedded"),)
    # Per-model settings, one table per model name: the output and forwarding policies.
    models: Mapping[str, ModelConfig] = field(default_factory=dict)
    # Named API keys with their limits, one table each (besides [server] api_keys).
    keys: tuple[KeyConfig, ...] = ()
    # Where the keys' counters live: Redis, else this edge's workers.
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    # OpenTelemetry traces; each key unset defers to the OTEL_* environment.
    tracing: TracingConfig = field(default_factory=TracingConfig)
    # The responses /v1/responses keeps for previous_response_id, item_reference and GET.
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    # The file read (in messages); not a key.
    source: str = "<defaults>"

    @property
    def relays_runs(self) -> bool:
        """Some node is `openai+http://`: the edge relays its runs to the model server
        itself (`edge.nodes.direct`), so a request keeps its RunRequest for them."""
        return any(node.address.startswith(UPSTREAM_SCHEMES) for node in self.nodes)

    def model(self, name: str) -> ModelConfig:
        found = self.models.get(name)
        if found is not None:
            return found
        return SIM_MODEL if name.startswith("sim-") else DEFAULT_MODEL
