"""The node side: servers of the node contract, apart from the edge side.

Owns the kit every node shares (`kit`: the grpclib server, run records, the
bounded codec, spans; `guard`: the bearer token and TLS a node serves with), the
simulated node (`sim`, `iop-sim-node`), the node in
front of an OpenAI-compatible server (`upstream`, `iop-node`), running
either inside the edge (`embedded`), and the client of an in-process iop-node
whose runs the edge relays to the model server itself (`direct`).

May import `contract`, `node` (the asyncio bridge, for running in-process),
`config` (its TOML reader and addresses), `observe`, `forwarding` (the edge's
forwarding policy, which `iop-node` applies to its runs too), `prefixchain` (the
edge's prefix fingerprint's hashes, which `iop-node` reports KV blocks by), `errors`;
never `http`,
`fleet`, `limits` or `process`.
"""
