"""`iop-node`: a node that serves runs from any OpenAI-compatible server.

`adapter` and `sse` are the pure mapping (RunRequest -> request body, SSE
chunks -> RunEvents); `server` is the grpclib NodeService on asyncio that
calls the upstream with httpx; `cli` is the `iop-node` command; `embedded`
runs the same service inside the edge for `openai+http://` node addresses.
"""
