"""The node contract's client side: how the edge talks to one node.

Owns the gRPC client (`grpc`: channels, the bounded codec, the one place grpclib
errors become the edge's; `access`: the token and TLS of its connections), the node
client (`client`: start, read, cancel a run; describe, watch), a node's checked
state (`describe`), the asyncio bridge
(`bridge`: grpclib is asyncio-only and stays behind it), the one Redis client
the limits and the response store await through that bridge (`redis`), and
the RunRequest and RunEvent conversions (`convert`, `wire`).

May import `contract`, `api` (the request it converts), `observe`, `stream`,
`errors`; never `fleet`, `http`, `limits`, `nodes` or `process`.
"""
