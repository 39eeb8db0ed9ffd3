"""`iop-node`: a node that serves runs from any OpenAI-compatible server.

The pure mapping: `request` (RunRequest -> request body), `sse` (the body's
server-sent events), `chunks` (chunks -> RunEvents, with `toolcalls` and
`logprobs`), `bodies` (error bodies, model lists), `load` (the upstream's
load from its /metrics text). `relay` serves one run from the upstream (httpcore,
on any loop: anyio); `server` is the grpclib NodeService on asyncio
that relays its runs, `loadpoll` its reading of /metrics; `cli` is the
`iop-node` command. `edge.nodes.embedded` runs the same service inside the
edge for `openai+http://` node addresses.
"""
