"""The fleet: which node runs a request, and the run's one lifecycle there.

Owns the pool of nodes (health, Watch or Describe: `feed`, circuit breaker:
`breaker`, panic routing, affinity, the rank of a node by its load: `load`; cache-aware routing:
`cacheaware`, over each node's `cacheindex`; the choice among the candidates:
`picker`; what `/readyz` and the node gauges show: `readiness`; why no node
can take a run, as the 503 says it: `unavailable`),
admission (node slots, the queue, the memory budget; a queued request's wait for
the node holding its prompt: `cachehold`), the tenants and service
tiers it shares the slots by (`tenants`), a request's answer
(`answer`: its nursery, its attempts by `failover` and `migration`, the run
whose outcome is the request's, its journal), the run (`run`: its phases as
one table, `phase`; accept, the one CancelRun, the outcome; its output under
the deadlines, `reader`), the
scheduler's turns for heavy steps, and per-model policy (`modelpolicy`: a
request's session settings, what reaches its node). `fleet.Fleet` holds the
parts a request uses; the daemon builds them, the HTTP handler only uses them.

May import `node` (the client side of the contract), `config`, `api`, `contract`,
`observe`,
`stream`, `errors`; never `http`, `process`, `limits` or `nodes`.
"""
