"""How runs reach the nodes: the nodes (`[[nodes]]`), how those behind a DNS name are
looked up (`[discovery]`), how runs are spread over them (`[routing]`) and the queue of
requests in front of them (`[admission]`), with the service tiers its bands are
(`SERVICE_TIERS`).

Each field that is a key of the file carries its default, meaning and bounds
(`edge.config.spec`); `edge.config.schema` gathers these tables into `Config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge.config.spec import about, setting

ROUTING_POLICIES = ("least_loaded", "affinity", "cache_aware")
ADMISSION_POLICIES = ("fair", "fifo")
# The service tiers a request may run on, in the order the queue's bands are served.
SERVICE_TIERS = ("priority", "default", "flex")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """One node (`[[nodes]]`): where it is, its share of runs, how it is reached."""

    name: str = field(
        metadata=about(
            "The node's name in logs, metrics and errors, unique; unset: its address (with"
            " discover: the DNS name)."
        )
    )
    address: str = field(
        metadata=about(
            'HOST:PORT of a node; "embedded": the simulated node, in-process;'
            " openai+http://HOST:PORT/v1: iop-node, in-process, in front of that server."
            " Required, unless discover is set (then not allowed)."
        )
    )
    discover: str | None = setting(
        None,
        "The nodes behind a DNS name instead of one address: dns+srv://NAME (its SRV"
        " records: a target and a port each, the target's A and AAAA records its addresses)"
        " or dns://NAME:PORT (its A and AAAA records, each address on PORT). Each address"
        " is a node named NAME/HOST:PORT (this entry's name before the slash) with this"
        " entry's other settings; looked up every discover_interval_s and at each reload"
        " (docs/fleet.md, Nodes found by DNS).",
    )
    discover_interval_s: float = setting(
        5.0,
        "How often discover's name is looked up again: nodes that appeared join (once they"
        " answered), nodes gone are drained; a failed look-up keeps the last answer.",
        min=0.05,
        max=3600,
    )
    max_runs: int | None = setting(
        None,
        "Runs in flight at once on this node: unset, the node's Describe max_runs"
        " (its 0: no limit); 0: no limit whatever the node says.",
        max=1_000_000,
    )
    token_file: str | None = setting(
        None,
        "A file holding the node's token, sent as `authorization: Bearer <token>` on every"
        " call (the node's --token-file); read at start and at each reload. This key's and"
        " the other files' paths are relative to the config file.",
    )
    tls: bool = setting(False, "Connect with TLS (implied by ca_file, cert_file or server_name).")
    ca_file: str | None = setting(
        None,
        "The CA file the node's certificate is checked against; unset: the system's CAs.",
    )
    cert_file: str | None = setting(
        None,
        "The edge's client certificate (PEM) for a node that asks for one (mutual TLS).",
    )
    key_file: str | None = setting(
        None, "The client certificate's private key; unset: in cert_file."
    )
    server_name: str | None = setting(
        None, "The name the node's certificate must carry; unset: the address's host."
    )
    # What the files above held when the configuration was read (not a key): a node whose
    # files changed is connected again on a reload.
    files_digest: str = field(default="", repr=False)

    @property
    def embedded(self) -> bool:
        return self.address == "embedded"

    @property
    def discovered(self) -> bool:
        """An entry whose nodes are found by DNS (`discover`): it is no node itself."""
        return self.discover is not None

    @property
    def connection(self) -> tuple[object, ...]:
        """What the node's connections are made of: a change of it (the address, the
        credentials or their files) connects the node again."""
        return (
            self.address, self.token_file, self.tls, self.ca_file, self.cert_file,
            self.key_file, self.server_name, self.files_digest,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """How the names of `[[nodes]]` entries with `discover` are looked up (`[discovery]`)."""

    nameservers: tuple[str, ...] = setting(
        (),
        "The DNS servers asked, each an IP address with or without a port (10.96.0.10,"
        ' "127.0.0.1:5353", "[::1]:5353"); empty: the system\'s (/etc/resolv.conf, its'
        " search domains and ndots too). /etc/hosts is not read.",
    )
    timeout_s: float = setting(
        2.0,
        "The longest one look-up of a name may take, its retries and the look-ups of its"
        " SRV targets included; past it the look-up failed (the last answer stays).",
        min=0.01,
        max=60,
    )


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How runs are spread over nodes, retried, and kept off failing nodes (`[routing]`)."""

    policy: str = setting(
        "least_loaded",
        "least_loaded: the node with the fewest runs in flight; affinity: the session's"
        " node (X-Session-Id, prompt_cache_key, else `user`) while its load stays bounded;"
        " cache_aware: the node whose KV cache holds the longest prefix of the prompt, within"
        " a bound on load (docs/fleet.md, Cache-aware routing).",
        choices=ROUTING_POLICIES,
    )
    retries: int = setting(
        2,
        "Retries of a run that could not start (on another node), before the first byte.",
        max=10,
    )
    retry_backoff_s: float = setting(
        0.05, "Base of the jittered exponential backoff between retries.", max=60
    )
    migrations: int = setting(
        1,
        "Times a request's answer may move to another node when its run breaks after"
        " output (the node gone, drained or failed): a node whose model says `continuation`"
        " continues it from the answer so far (docs/fleet.md, Migration). 0: never.",
        max=10,
    )
    breaker_failures: int = setting(
        5, "Run failures in a row that open a node's circuit breaker.", min=1
    )
    breaker_cooldown_s: float = setting(
        5.0,
        "How long an open breaker keeps new runs off the node before one probe run.",
        min=0.01,
        max=3600,
    )
    watch_heartbeat_s: float = setting(
        2.0,
        "The heartbeat the edge asks of each node's Watch stream: a node reports its load"
        " when it changes and at least this often; one silent for 3 heartbeats (at least 1 s)"
        " is suspect and subscribed to again.",
        min=0.1,
        max=60,
    )
    cache_blocks: int = setting(
        16384,
        "cache_aware: a node's KV cache, in blocks of 64 tokens (256 characters of prompt),"
        " when it does not report its capacity (kv_cache_tokens).",
        min=1,
        max=1 << 20,
    )
    cache_load_factor: float = setting(
        2.0,
        "cache_aware: no node is chosen for its cache with more than this many times the"
        " mean runs of the candidates + 1 (looser than affinity's 1.25: a hit is short, and"
        " a prefix spilled to another node is a miss there; BENCHMARKS.md).",
        min=1.0,
        max=100,
    )
    cache_share_factor: float = setting(
        1.4,
        "cache_aware: the hot-spot guard: no node is chosen for its cache with more than"
        " this many times the mean share of the edge's recent dispatches (about the last"
        " 64) + 1.",
        min=1.0,
        max=100,
    )
    cache_threshold: float = setting(
        0.3,
        "cache_aware: a prefix no node holds past this share of a request's blocks is"
        " weak: the request is placed as a miss, by its block at this share of its blocks"
        " (new conversations that share only a short system prompt spread over the nodes).",
        min=0,
        max=1,
    )
    cache_hold_s: float = setting(
        2.0,
        "cache_aware, with the edge's queue (nodes whose max_runs it enforces): how long a"
        " queued request may pass up free slots on nodes that hold at least cache_threshold"
        " of its prompt less than a busy node, waiting for that node's slot (a request that"
        " fits the free node better takes it meanwhile; docs/fleet.md, The cache hold)."
        " 0: a queued request takes the first slot freed, on any node.",
        min=0,
        max=60,
    )


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The queue of requests waiting for a free node slot (`[admission]`)."""

    max_queue: int = setting(
        1000,
        "Requests waiting at once, for the whole edge (each worker process its own); past"
        " it one is shed: a flex one first (429), then a default one, a priority one last"
        " (503 overloaded); 0: no queue.",
        max=1_000_000,
    )
    queue_timeout_s: float = setting(
        30.0,
        "How long a request may wait for a slot before 503 overloaded.",
        min=0.001,
        max=3600,
    )
    memory_budget_bytes: int = setting(
        512 * 1024 * 1024,
        "Bytes the requests queued and running may hold at once, as parsed (each request's"
        " estimate: edge.api.footprint); one that would pass it is answered 503 overloaded.",
        min=2**20,
        max=2**50,
    )
    policy: str = setting(
        "fair",
        "fair: one queue per tenant (a key; with no keys, a client address) in strict bands"
        " by service tier, the tenants of a band served in proportion to their keys' weight"
        " (docs/fleet.md, When the fleet is full); fifo: one queue in arrival order for"
        " every request (tiers and tenants aside).",
        choices=ADMISSION_POLICIES,
    )
    max_queue_per_key: int | None = setting(
        None,
        "fair: requests one tenant may have waiting; past it, that tenant's newest request"
        " is shed, not another's. Unset: a quarter of max_queue (at least 1).",
        min=1,
        max=1_000_000,
    )
    priority_slots: int = setting(
        0,
        "Node slots of the whole fleet (each worker process of its share) kept for priority"
        " requests: a default or flex request waits rather than take a slot that would leave"
        " fewer free; a priority request takes any free slot. Either policy; 0: none kept.",
        min=0,
        max=1_000_000,
    )

    @property
    def key_max_queue(self) -> int:
        """What one tenant may have waiting (`max_queue_per_key`)."""
        if self.max_queue_per_key is not None:
            return self.max_queue_per_key
        return max(1, self.max_queue // 4)
