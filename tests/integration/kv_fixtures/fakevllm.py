"""A fake vLLM for iop-node's KV event tests: its OpenAI server (`/v1/models`,
`/v1/chat/completions`, `/tokenize`) and its prefix cache, which publishes what it
stores and evicts through a `Publisher` in one of this folder's formats.

The prompt is the ChatML template's text tokenized by `chatml.tokenize` (`/tokenize`
answers the same tokens, with their strings when `return_token_strs`). The cache
holds `capacity` blocks of `block_size` tokens, each keyed by a hash chained as
vLLM's is (SHA-256 over a seed drawn for each life of the server, the parent's hash,
the block's tokens, and the first block's `cache_salt`), kept in vLLM's order (a
request's blocks freed last to first: its end evicted first). A chat request finds
its longest cached prefix (`usage.prompt_tokens_details.cached_tokens`), evicts the
least recently used blocks it needs room for (one `BlockRemoved`), then stores its
new full blocks (one `BlockStored` from its last cached block); both in one batch,
as a vLLM step publishes them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

from tests.integration.kv_fixtures.chatml import template, tokenize
from tests.integration.kv_fixtures.publisher import Publisher
from tests.integration.rawhttp import read_request, send_events, send_whole


@dataclass
class FakeVllm:
    publisher: Publisher
    capacity: int = 256
    block_size: int = 16
    model: str = "m"
    url: str = ""
    token_strs: bool = True
    # What /tokenize answers a chat's messages with (SGLang's takes a prompt only).
    tokenize_status: int = 200
    tokenizes: int = 0
    vocab: dict[bytes, int] = field(default_factory=dict)
    seed: bytes = field(default_factory=lambda: os.urandom(32))
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def tokens(self, body: dict[str, Any]) -> tuple[list[int], list[str]]:
        text = template(body["messages"], body.get("add_generation_prompt", True))
        return tokenize(text, self.vocab)

    def _hash(self, parent: int | None, tokens: list[int], salt: str) -> int:
        data = (
            self.seed
            + (parent or 0).to_bytes(8, "big")
            + b"".join(t.to_bytes(4, "big") for t in tokens)
        )
        if parent is None:
            data += salt.encode()
        return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")

    def run(self, body: dict[str, Any]) -> tuple[int, int]:
        """Serve one request's prompt from the cache: (prompt tokens, cached tokens)."""
        ids, _ = self.tokens(body)
        size, salt = self.block_size, body.get("cache_salt", "")
        hashes: list[int] = []
        for j in range(len(ids) // size):
            hashes.append(self._hash(hashes[-1] if j else None, ids[j * size : (j + 1) * size],
                                     salt))  # fmt: skip
        cached = 0
        while cached < len(hashes) and hashes[cached] in self.cache:
            cached += 1
        for h in hashes[:cached]:
            self.cache.move_to_end(h)  # in use: not evicted for this request
        new = hashes[cached:]
        fmt = self.publisher.fmt
        events = []
        removed = self._evict(len(self.cache) + len(new) - self.capacity, keep=set(hashes))
        if removed:
            events.append(fmt.removed(removed))
        if new:
            parent = hashes[cached - 1] if cached else None
            events.append(fmt.stored(new, parent, ids[cached * size : len(hashes) * size],
                                     size, salt))  # fmt: skip
        for h in reversed(hashes):  # freed last to first: the start is the most recent
            self.cache[h] = None
            self.cache.move_to_end(h)
        if events:
            self.publisher.publish(events)
        return len(ids), cached * size

    def _evict(self, count: int, keep: set[int] | None = None) -> list[int]:
        removed = [h for h in self.cache if h not in (keep or set())][: max(0, count)]
        for h in removed:
            del self.cache[h]
        return removed

    def evict(self, count: int) -> None:
        """Evict the `count` least recently used blocks (one BlockRemoved)."""
        if removed := self._evict(count):
            self.publisher.publish([self.publisher.fmt.removed(removed)])

    def clear(self) -> None:
        """Empty the cache (AllBlocksCleared)."""
        self.cache.clear()
        self.publisher.publish([self.publisher.fmt.cleared()])

    def restart(self) -> None:
        """A new life: another seed, an empty cache, the publisher's numbers from 0."""
        self.seed = os.urandom(32)
        self.cache.clear()
        self.publisher.restart()

    async def answer(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            try:
                while (received := await read_request(stream, conn)) is not None:
                    request, raw = received
                    await self._route(stream, conn, request.target, raw)
                    conn.start_next_cycle()
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
                return

    async def _route(
        self, stream: trio.SocketStream, conn: h11.Connection, target: bytes, raw: bytes
    ) -> None:
        if target == b"/v1/models":
            models = {"object": "list", "data": [{"id": self.model, "owned_by": "vllm"}]}
            await send_whole(stream, conn, 200, json.dumps(models).encode())
        elif target == b"/tokenize" and self.tokenize_status != 200:
            self.tokenizes += 1
            detail = b'{"detail":"prompt: field required"}'
            await send_whole(stream, conn, self.tokenize_status, detail)
        elif target == b"/tokenize":
            body = json.loads(raw)
            self.tokenizes += 1
            ids, strs = self.tokens(body)
            answer: dict[str, Any] = {"count": len(ids), "max_model_len": 32768, "tokens": ids}
            if body.get("return_token_strs") and self.token_strs:
                answer["token_strs"] = strs
            await send_whole(stream, conn, 200, json.dumps(answer).encode())
        elif target == b"/v1/chat/completions":
            prompt, cached = self.run(json.loads(raw))
            await self._stream(stream, conn, prompt, cached)
        else:
            await send_whole(stream, conn, 404, b'{"detail":"Not Found"}')

    async def _stream(
        self, stream: trio.SocketStream, conn: h11.Connection, prompt: int, cached: int
    ) -> None:
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": self.model}
        usage = {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1,
                 "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        chunks = [
            {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"},
                                  "finish_reason": None}]},
            {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {**base, "choices": [], "usage": usage},
        ]  # fmt: skip
        body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        body += b"data: [DONE]\n\n"
        headers = [("content-type", "text/event-stream"), ("content-length", str(len(body)))]
        await send_events(
            stream, conn, h11.Response(status_code=200, headers=headers), h11.Data(body),
            h11.EndOfMessage(),
        )  # fmt: skip
