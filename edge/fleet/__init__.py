"""The fleet: which node runs a request, and the run's one lifecycle there.

Owns the pool of nodes (health, circuit breaker, panic routing, affinity),
admission (node slots, the queue, the memory budget), failover, the run
(`run`: accept, deadlines, batches, the one CancelRun, the outcome) and the
scheduler's turns for heavy steps.

May import `node` (the client side of the contract), `config`, `api`, `observe`,
`stream`, `errors`; never `http`, `process`, `limits` or `nodes`.
"""
