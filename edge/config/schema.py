"""The settings: one frozen dataclass per table of the configuration file.

Owns what each setting is: a field whose metadata makes it a key of the file, with its
default, its meaning and its bounds or choices (`edge.config.spec`), from which the
parser (`edge.config.parse`) reads it and docs/config-reference.md
(`edge.config.reference`) describes it; and the per-model defaults. The tables of the
nodes and of how runs reach them are `edge.config.routing`'s. Knows nothing of TOML;
the settings types of the layers below (`ForwardPolicy`, `TracingConfig`) are theirs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from edge.api.policy import DEFAULT_MAX_OUTPUT_TOKENS, ForwardPolicy
from edge.config.address import UPSTREAM_SCHEMES
from edge.config.routing import (
    SERVICE_TIERS,
    AdmissionConfig,
    DiscoveryConfig,
    NodeConfig,
    RoutingConfig,
)
from edge.config.spec import about, setting
from edge.observe.tracing import TracingConfig
from edge.stream.sentinel import DEFAULT_SENTINELS
from edge.stream.toolcall import TOOL_VALIDATION_MODES, ToolValidation
from edge.stream.toolparse import DEFAULT_FORMATS

REASONING_PARSERS = ("none", "think", "think_start")
# `workers` at most (and what "auto" is capped at).
MAX_WORKERS = 256


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP server (`[server]`): its address, API keys, bodies, connections, workers."""

    listen: str = setting("127.0.0.1:8080", "The HTTP address the edge listens on, HOST:PORT.")
    api_keys: tuple[str, ...] = setting(
        (),
        "When set, /v1/* requires `Authorization: Bearer <key>` with one of these keys.",
    )
    api_keys_file: str | None = setting(
        None,
        "More api_keys from a file: one per line, # comments (relative to the config file).",
    )
    drain_timeout_s: float = setting(30.0, "How long the streams in flight may finish on shutdown.")
    max_body_bytes: int = setting(
        4 * 1024 * 1024,
        "The largest request body; a larger one is answered 413.",
        min=1024,
        number=True,
    )
    keepalive_s: float = setting(
        15.0, "SSE comment sent while waiting for the first token; 0 = never."
    )
    node_refresh_s: float = setting(
        5.0,
        "How often every node is asked for its models (health, /readyz, routing).",
        min=0.05,
    )
    max_connections: int = setting(
        0, "Client connections served at once; 0 = derived from the file-descriptor limit."
    )
    idle_timeout_s: float = setting(
        5.0,
        "A connection with no request in progress is closed this long after it went idle;"
        " the next request's head must be complete by then (slow heads too).",
        min=0.01,
        max=3600,
    )
    body_timeout_s: float = setting(
        60.0,
        "Time the edge waits on the client for one HTTP/1.1 request body: past it, 408.",
        min=0.01,
        max=3600,
    )
    workers: int = setting(
        1,
        "Worker processes serving the listen address (edge.process.supervisor); 1 = one"
        ' process; "auto": one per CPU this process may run on.',
        takes=f'integer, 1 to {MAX_WORKERS}, or "auto"',
    )
    cors_allow_origins: tuple[str, ...] = setting(
        (),
        'Browser origins allowed to call the API (CORS), e.g. "https://app.example.com", or'
        ' "*" for any; empty: no CORS headers at all (docs/operations.md).',
    )


@dataclass(frozen=True, slots=True)
class LogConfig:
    """Logs on stderr (`[log]`)."""

    level: str = setting(
        "INFO",
        "The least severe level logged.",
        choices=("TRACE", "DEBUG", "INFO", "WARNING", "ERROR"),
    )
    format: str = setting(
        "text",
        "text: lines for a terminal; json: one object per line (journald).",
        choices=("text", "json"),
    )
    queue_bytes: int = setting(
        1024 * 1024,
        "Lines waiting for a slow reader of stderr, at most (edge.observe.logwriter): the"
        " rest are dropped.",
        min=16384,
        max=2**30,
    )


@dataclass(frozen=True, slots=True)
class TimeoutsConfig:
    """The deadlines of a run, per edge (`[timeouts]`)."""

    first_event_s: float = setting(
        120.0,
        "The longest wait from dispatching a run to the node's first event.",
        min=0.001,
    )
    idle_s: float = setting(60.0, "The longest wait between two events of the node.", min=0.001)
    total_s: float = setting(900.0, "The longest a whole run may take.", min=0.001)
    slow_client_s: float = setting(
        30.0,
        "A client that reads nothing while this many seconds of output wait is gone.",
        min=0.001,
    )
    slow_client_backlog_chars: int = setting(
        64 * 1024 * 1024,
        "Characters of output the process holds for its streams in all, each stream whose"
        " client stopped reading counted with 768 Ki more for what it holds beyond its buffer:"
        " past it, the streams whose clients stopped reading longest ago are ended as slow"
        " clients at once (the default fits about 80 stalled streams of full buffers, 64 Ki"
        " characters each).",
        min=65536,
        max=2**40,
    )


CACHE_SCOPES = ("key", "shared")


@dataclass(frozen=True, slots=True)
class KeyConfig:
    """One API key (`[[keys]]`): its name, its secret and its limits (None: no limit).

    The secret is kept out of `repr` (a config printed or logged never shows it).
    """

    name: str = field(
        metadata=about(
            "The key's name in logs and metrics (the key itself never is): 1 to 64 of"
            " A-Z a-z 0-9 . _ -; required."
        )
    )
    # The key itself: from `key`, `key_env` or `key_file` (edge.config.keys).
    secret: str = field(repr=False)
    rpm: int | None = setting(
        None, "Requests per minute; unset: no limit.", min=1, max=1_000_000_000
    )
    tpm: int | None = setting(
        None,
        "Tokens per minute, counted when each run ends; unset: no limit.",
        min=1,
        max=1_000_000_000,
    )
    max_streams: int | None = setting(
        None,
        "Streams (requests in flight) at once; unset: no limit.",
        min=1,
        max=1_000_000_000,
    )
    models: tuple[str, ...] | None = setting(
        None,
        "The models this key may use (others are answered like unknown models); unset:"
        " every model.",
    )
    cache_scope: str = setting(
        "key",
        'Whose cached prompt prefixes this key\'s requests may reuse: "key" (its own only:'
        ' another key cannot learn a prompt from the cache) or "shared" (those of every'
        " key that shares, e.g. one application's users sharing a system prompt).",
        choices=CACHE_SCOPES,
    )
    weight: float = setting(
        1.0,
        "Its share of the node slots when the fleet is full: the keys with requests waiting"
        " are served in proportion to their weights (admission policy fair).",
        min=0.01,
        max=1000,
    )
    service_tiers: tuple[str, ...] = setting(
        ("default", "flex"),
        'The service tiers its requests may ask for (`service_tier`), of "priority",'
        ' "default" and "flex"; another is answered 400.',
    )
    service_tier: str = setting(
        "default",
        'The tier of its requests that ask for none (or "auto"); one of its service_tiers.',
        choices=SERVICE_TIERS,
    )

    @property
    def limited(self) -> bool:
        """Whether any counted limit applies (and so the rate-limit headers are sent)."""
        return self.rpm is not None or self.tpm is not None or self.max_streams is not None


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Where the keys' counters live (`[limits]`): Redis, else this edge's workers."""

    redis_url: str | None = setting(
        None,
        "redis://HOST:PORT/DB (or rediss://, unix://): limits shared by every edge using it.",
    )
    fail_open: bool = setting(
        True, "Redis down or slow: true lets requests through, false answers 503."
    )
    key_prefix: str = setting("iop-edge:", "Prefix of every Redis key the edge writes.")
    redis_timeout_s: float = setting(0.25, "Deadline of one Redis call.", min=0.001, max=60)
    lease_s: float = setting(
        10.0,
        "A `max_streams` lease (Redis, the workers' shared file) expires this long after it"
        " was last renewed: a stream whose release failed (Redis unreachable) or whose"
        " process hangs is given back within it.",
        min=0.05,
        max=3600,
    )
    lease_renew_s: float = setting(
        3.0,
        "How often the leases a process holds are renewed (one store call per process"
        " per renewal, for all of them); at most half of lease_s.",
        min=0.01,
        max=3600,
    )


RESPONSE_STORES = ("sqlite", "redis", "off")


@dataclass(frozen=True, slots=True)
class ResponsesConfig:
    """Where `/v1/responses` keeps the responses later requests refer to (`[responses]`)."""

    store: str = setting(
        "sqlite",
        "sqlite: a file shared by this edge's workers; redis: shared by every edge using"
        " it; off: nothing is kept (previous_response_id and item_reference are refused).",
        choices=RESPONSE_STORES,
    )
    path: str | None = setting(
        None,
        "The SQLite file (relative to the config file); unset: responses.sqlite3 in"
        " systemd's $STATE_DIRECTORY, else in the edge run's own directory, removed when the"
        " edge stops.",
    )
    redis_url: str | None = setting(
        None,
        'redis://HOST:PORT/DB (or rediss://, unix://) for store = "redis"; unset: [limits]'
        " redis_url.",
    )
    key_prefix: str = setting("iop-edge:responses:", "Prefix of every Redis key of the store.")
    redis_timeout_s: float = setting(
        2.0, "Deadline of one Redis call of the store.", min=0.001, max=60
    )
    max_responses: int = setting(
        10_000,
        "Responses kept at most: past it, the oldest are evicted.",
        min=1,
        max=10**9,
    )
    max_bytes: int = setting(
        256 * 1024 * 1024,
        "Bytes kept at most (each response: its Response object, its context and its"
        " output items, as JSON): past it, the oldest are evicted.",
        min=2**16,
        max=2**44,
    )
    max_response_bytes: int = setting(
        8 * 1024 * 1024,
        "A larger response is answered but not kept (logged and counted).",
        min=1024,
        max=2**31,
    )
    ttl_s: float = setting(
        7 * 24 * 3600.0,
        "A response is kept this long after it was stored, at most.",
        min=1.0,
        max=10 * 365 * 86400.0,
    )
    per_key_max_responses: int | None = setting(
        None,
        "Responses one key (tenant) keeps at most: past it, that key's oldest are evicted,"
        " never another's. Unset: a quarter of max_responses.",
        min=1,
        max=10**9,
    )
    per_key_max_bytes: int | None = setting(
        None,
        "Bytes one key keeps at most, as max_bytes counts them: past it, that key's oldest"
        " are evicted. Unset: a quarter of max_bytes.",
        min=1024,
        max=2**44,
    )

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

    strict: bool = setting(
        False,
        "Strict output for every request: reasoning hidden unless asked for, JSON answers"
        " checked against their response_format, tool calls validated strictly.",
    )
    stream_buffer: bool = setting(
        False,
        "Under strict output, content is held until its check passed (a failing answer"
        " sends no content byte).",
    )
    reasoning_parser: str = setting(
        "none",
        "think: `<think>...</think>` split out of content; think_start: the template opened"
        " the think block already; the default for sim-* models is think.",
        choices=REASONING_PARSERS,
    )
    tool_call_formats: tuple[str, ...] = setting(
        DEFAULT_FORMATS,
        "The formats of tool calls written as text that are parsed (json and fenced are opt-in).",
    )
    tool_validation: ToolValidation | None = field(
        default=None,
        metadata=about(
            "strict, report or off; unset: derived per request, report or strict under strict"
            " output (edge.stream.toolcheck).",
            choices=TOOL_VALIDATION_MODES,
        ),
    )
    sentinels: tuple[str, ...] = setting(
        DEFAULT_SENTINELS, "Leaked special tokens removed from the output."
    )
    trace_stream: bool = setting(False, "Per-chunk trace logging for the model's runs.")
    max_output_tokens: int = setting(
        DEFAULT_MAX_OUTPUT_TOKENS,
        "Forwarding policy (edge.api.policy): a request asking for more output tokens"
        " (max_tokens, max_completion_tokens, min_tokens) is a 400.",
        min=1,
        max=2**32 - 1,  # the node protocol carries max_tokens as a uint32
    )
    allow_chat_template: bool = setting(
        False, "Forward chat_template_kwargs.chat_template (dropped unless allowed)."
    )
    allow_ignore_eos: bool = setting(False, "Forward ignore_eos (dropped unless allowed).")
    media_url_schemes: tuple[str, ...] = setting(
        ("data",), 'Media URL schemes the node may be sent besides data: ("http", "https").'
    )

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
    """The whole file: one field per table, each with its meaning (`edge.config.spec`),
    as the keys of those tables have theirs."""

    server: ServerConfig = field(
        default_factory=ServerConfig,
        metadata=about("The HTTP server: address, API keys, bodies, connections, workers."),
    )
    log: LogConfig = field(default_factory=LogConfig, metadata=about("Logs on stderr."))
    timeouts: TimeoutsConfig = field(
        default_factory=TimeoutsConfig,
        metadata=about("The deadlines of a run, per edge (not per request)."),
    )
    routing: RoutingConfig = field(
        default_factory=RoutingConfig,
        metadata=about("How runs are spread over the nodes, retried, and kept off failing nodes."),
    )
    admission: AdmissionConfig = field(
        default_factory=AdmissionConfig,
        metadata=about(
            "The queue of requests waiting for a free node slot, and the memory budget."
        ),
    )
    nodes: tuple[NodeConfig, ...] = setting(
        (NodeConfig("embedded", "embedded"),),
        "The nodes, one table each; unset: one simulated node, in-process.",
    )
    discovery: DiscoveryConfig = field(
        default_factory=DiscoveryConfig,
        metadata=about(
            "How the DNS names of [[nodes]] entries with discover are looked up (docs/fleet.md,"
            " Nodes found by DNS)."
        ),
    )
    models: Mapping[str, ModelConfig] = field(
        default_factory=dict,
        metadata=about(
            "Per-model settings, one table per model name: the output and forwarding policies."
        ),
    )
    keys: tuple[KeyConfig, ...] = setting(
        (), "Named API keys with their limits, one table each (besides [server] api_keys)."
    )
    limits: LimitsConfig = field(
        default_factory=LimitsConfig,
        metadata=about("Where the keys' counters live: Redis, else this edge's workers."),
    )
    tracing: TracingConfig = field(
        default_factory=TracingConfig,
        metadata=about("OpenTelemetry traces; each key unset defers to the OTEL_* environment."),
    )
    responses: ResponsesConfig = field(
        default_factory=ResponsesConfig,
        metadata=about(
            "The responses /v1/responses keeps for previous_response_id, item_reference and GET."
        ),
    )
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
