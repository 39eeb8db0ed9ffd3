"""`iop-node`: a node that serves runs from any OpenAI-compatible server.

The pure mapping: `request` (RunRequest -> request body), `sse` (the body's
server-sent events), `chunks` (chunks -> RunEvents, with `toolcalls` and
`logprobs`), `bodies` (error bodies, model lists), `load` (the upstream's
load from its /metrics text). `relay` serves one run from the upstream (httpcore,
on any loop: anyio); `server` is the grpclib NodeService on asyncio
that relays its runs, `loadpoll` its reading of /metrics; `cli` is the
`iop-node` command. `edge.nodes.embedded` runs the same service inside the
edge for `openai+http://` node addresses.

The server's KV cache by the edge's prefix blocks (`--kv-events`): `kvwire` (vLLM's
and SGLang's KV event batches and their ZMQ framing), `tokentext` (tokens' text from
their vocabulary strings), `kvalign` (the edge's rendering of a run and which of the
server's tokens each prefix block needs), `kvmap` (the server's cached blocks as the
edge's, reported on Watch) are pure; `kvtokenize` asks the server for a run's tokens,
`kvfeed` reads the events (pyzmq, on the node's loop) and feeds the map.
"""
