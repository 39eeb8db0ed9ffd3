"""How runs reach the nodes: the nodes (`[[nodes]]`), how runs are spread over them
(`[routing]`) and the queue of requests in front of them (`[admission]`).

`edge.config.schema` gathers these tables into `Config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTING_POLICIES = ("least_loaded", "affinity", "cache_aware")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """One node (`[[nodes]]`): where it is, its share of runs, how it is reached."""

    # The node's name in logs, metrics and errors, unique; unset: its address.
    name: str
    # HOST:PORT of a node; "embedded": the simulated node, in-process;
    # openai+http://HOST:PORT/v1: iop-node, in-process, in front of that server. Required.
    address: str
    # Runs in flight at once on this node: unset, the node's Describe max_runs
    # (its 0: no limit); 0: no limit whatever the node says.
    max_runs: int | None = None
    # A file holding the node's token, sent as `authorization: Bearer <token>` on every
    # call (the node's --token-file); read at start and at each reload. This key's and
    # the other files' paths are relative to the config file.
    token_file: str | None = None
    # Connect with TLS (implied by ca_file, cert_file or server_name).
    tls: bool = False
    # The CA file the node's certificate is checked against; unset: the system's CAs.
    ca_file: str | None = None
    # The edge's client certificate (PEM) for a node that asks for one (mutual TLS).
    cert_file: str | None = None
    # The client certificate's private key; unset: in cert_file.
    key_file: str | None = None
    # The name the node's certificate must carry; unset: the address's host.
    server_name: str | None = None
    # What the files above held when the configuration was read (not a key): a node whose
    # files changed is connected again on a reload.
    files_digest: str = field(default="", repr=False)

    @property
    def embedded(self) -> bool:
        return self.address == "embedded"

    @property
    def connection(self) -> tuple[object, ...]:
        """What the node's connections are made of: a change of it (the address, the
        credentials or their files) connects the node again."""
        return (
            self.address, self.token_file, self.tls, self.ca_file, self.cert_file,
            self.key_file, self.server_name, self.files_digest,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How runs are spread over nodes, retried, and kept off failing nodes (`[routing]`)."""

    # least_loaded: the node with the fewest runs in flight; affinity: the session's
    # node (X-Session-Id, prompt_cache_key, else `user`) while its load stays bounded;
    # cache_aware: the node whose KV cache holds the longest prefix of the prompt, within
    # a bound on load (docs/fleet.md, Cache-aware routing).
    policy: str = "least_loaded"
    # Retries of a run that could not start (on another node), before the first byte.
    retries: int = 2
    # Base of the jittered exponential backoff between retries.
    retry_backoff_s: float = 0.05
    # Times a request's answer may move to another node when its run breaks after
    # output (the node gone, drained or failed): a node whose model says `continuation`
    # continues it from the answer so far (docs/fleet.md, Migration). 0: never.
    migrations: int = 1
    # Run failures in a row that open a node's circuit breaker.
    breaker_failures: int = 5
    # How long an open breaker keeps new runs off the node before one probe run.
    breaker_cooldown_s: float = 5.0
    # The heartbeat the edge asks of each node's Watch stream: a node reports its load
    # when it changes and at least this often; one silent for 3 heartbeats (at least 1 s)
    # is suspect and subscribed to again.
    watch_heartbeat_s: float = 2.0
    # cache_aware: a node's KV cache, in blocks of 64 tokens (256 characters of prompt),
    # when it does not report its capacity (kv_cache_tokens).
    cache_blocks: int = 16384
    # cache_aware: no node is chosen for its cache with more than this many times the
    # mean runs of the candidates + 1 (looser than affinity's 1.25: a hit is short, and
    # a prefix spilled to another node is a miss there; BENCHMARKS.md).
    cache_load_factor: float = 2.0
    # cache_aware: the hot-spot guard: no node is chosen for its cache with more than
    # this many times the mean share of the edge's recent dispatches (about the last
    # 64) + 1.
    cache_share_factor: float = 1.4
    # cache_aware: a prefix no node holds past this share of a request's blocks is
    # weak: the request is placed as a miss, by its block at this share of its blocks
    # (new conversations that share only a short system prompt spread over the nodes).
    cache_threshold: float = 0.3


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
