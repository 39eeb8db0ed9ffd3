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

# trio_asyncio before grpclib, in every process that runs grpclib on the bridge. Importing
# trio_asyncio puts functions of its own in place of asyncio's, and grpclib keeps the
# asyncio.current_task it finds when it is imported: from CPython 3.12 asyncio's own is
# written in C and finds no loop under trio-asyncio, and every grpclib call fails with
# "no running event loop" (python-trio/trio-asyncio#83). The edge's process imports this
# package before the contract's generated code and grpclib; a test or benchmark process
# that imports those first imports this package (or trio_asyncio) before them.
# `bridge.asyncio_loop` refuses to open the loop in a process where grpclib came first.
# Node processes (iop-node, iop-sim-node) import neither this package nor trio_asyncio:
# their loop is asyncio's own.
import trio_asyncio  # noqa: F401
