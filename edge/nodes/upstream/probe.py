"""Whether a llama.cpp server continues an answer, asked once (`--continuation auto`).

One streamed request (`edge.nodes.upstream.continuation.probe_body`: one token
after a made-up answer, sent as the `llamacpp` way sends a continuation); the
server continues when what it streams does not start with that answer. A server
that echoes the answer back first would start every continued answer over.

Bounded: PROBE_TIMEOUT_S in all, at most PROBE_MAX_BYTES of the answer read.
It knows httpx and the SSE framing; what the answer means is `continuation`'s.
"""

from __future__ import annotations

import json

import httpx

from edge.nodes.upstream.continuation import probe_body, probe_continues
from edge.nodes.upstream.sse import DONE, SSEDecoder

__all__ = ["PROBE_TIMEOUT_S", "probe_continuation"]

PROBE_TIMEOUT_S = 10.0
PROBE_MAX_BYTES = 64 * 1024


async def probe_continuation(client: httpx.AsyncClient, chat_url: str, model: str) -> bool:
    """True when the server at `chat_url` continued the probe's answer, False when it
    started over. httpx.HTTPError (or ValueError: not an event stream) when it could
    not say: the question stays open."""
    body = probe_body(model)
    decoder = SSEDecoder()
    content: list[str] = []
    read = 0
    async with client.stream("POST", chat_url, json=body, timeout=PROBE_TIMEOUT_S) as response:
        if response.status_code >= 400:
            # A server that refuses the form (a 4xx) does not continue this way.
            if response.status_code < 500:
                return False
            response.raise_for_status()
        async for text in response.aiter_text():
            read += len(text)
            for message in decoder.feed(text):
                if message.data == DONE:
                    return probe_continues("".join(content))
                chunk = json.loads(message.data)
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if isinstance(delta.get("content"), str):
                        content.append(delta["content"])
            if read > PROBE_MAX_BYTES:
                break
    return probe_continues("".join(content))
