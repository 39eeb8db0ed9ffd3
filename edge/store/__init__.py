"""The response store: what `/v1/responses` keeps for later requests to refer to.

`base` says what a store is and builds a record (the Response object, the context it
was given, its output items by id) within its byte bound; `sqlite` keeps them in a file
the workers of one edge share (stdlib sqlite3, WAL, its calls in worker threads),
`redisstore` in Redis for every edge that uses it; `stores` picks one.

I/O lives here, the rules of the API do not: which ids a request refers to, and what a
missing one answers, are `edge.api.responses_state`'s; when a request resolves and
saves is `edge.http`'s. Nothing here reads the environment (the process layer gives
the directory).

May import `node` (the asyncio bridge Redis is awaited through), `config`, `api`,
`observe`, `errors`; never `http`, `fleet`, `limits`, `nodes` or `process`.
"""
