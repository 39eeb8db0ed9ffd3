"""API keys' limits: requests and tokens per minute, streams at once, model allow-lists.

`window` is the pure logic (one fixed window per key, the rate-limit
headers); `base` says what a store is; `memory`, `shared` and `redisstore`
keep the counters (one process, the workers of one edge in the file of
`slotfile`, every edge using one Redis), and `stores` picks one; `limiter`
ties a request to its key and its store, and owns the store-down policy.

May import `node` (the asyncio bridge Redis is awaited through), `config`,
`observe`, `stream`, `errors`; never `http`, `fleet`, `nodes` or `process`.
"""
