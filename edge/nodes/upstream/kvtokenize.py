"""A run's prompt as its model server tokenizes it, and as the server will cache it: one
round trip to the server's `/tokenize` before the run is sent.

vLLM's `POST /tokenize` (at the server's origin, beside `/v1`) takes a chat
request's `messages` and the fields its chat template reads (`tools`,
`add_generation_prompt`, `continue_final_message`, `chat_template`,
`chat_template_kwargs`) and answers the prompt's token ids, and with
`return_token_strs` each token's vocabulary string. `tokenize_body` makes that
request of the run's own upstream body (after the forwarding policy and a
continuation's changes: the prompt the server will see), `read_tokenized` reads
the answer (bounded), and `run_prompt` turns both into the `Prompt` the KV map
registers (`edge.nodes.upstream.kvmap`): the rendering checked against the
run's `prefix_blocks` (`edge.nodes.upstream.kvalign.verified`), the tokens'
text (`edge.nodes.upstream.tokentext`), each edge block's tokens
(`kvalign.needed_tokens`), the blocks' keys.

A run is not mapped (`run_prompt` says why) when it carries no prefix blocks,
has parts other than text (an image's tokens are placeholders: two images would
be one prompt to the keys), renders otherwise than the edge hashed it, or the
server's answer has no token strings (a vLLM before `return_token_strs`).

Costs a run: the round trip, the server's tokenization of the prompt (its chat
template and tokenizer: the same work it does again for the run), and here
work linear in the prompt (parse, align, hash), off the loop for a large one.
"""

from __future__ import annotations

from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import msgspec

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import PREFIX_BLOCK_CHARS
from edge.nodes.upstream.kvalign import needed_tokens, pieces, verified
from edge.nodes.upstream.kvmap import Prompt, prompt_blocks
from edge.nodes.upstream.tokentext import token_bytes

__all__ = [
    "MAX_TOKENIZE_BYTES",
    "TOKENIZE_TIMEOUT_S",
    "Tokenized",
    "mappable",
    "read_tokenized",
    "run_prompt",
    "tokenize_body",
    "tokenize_url",
]

# How long a run waits for its prompt's tokens before it is sent unmapped.
TOKENIZE_TIMEOUT_S: Final = 5.0
# The longest answer read (a prompt of the gRPC message's 4 MiB is about 1M tokens:
# their ids and strings as JSON stay under this).
MAX_TOKENIZE_BYTES: Final = 64 * 1024 * 1024
# The chat body's fields a chat template reads, sent to /tokenize as they are.
_TEMPLATE_FIELDS: Final = (
    "model", "messages", "tools", "add_generation_prompt", "continue_final_message",
    "chat_template", "chat_template_kwargs",
)  # fmt: skip


class Tokenized(msgspec.Struct):
    """vLLM's answer: the prompt's token ids, and each one's vocabulary string."""

    tokens: list[int]
    token_strs: list[str] | None = None


_decode_tokenized = msgspec.json.Decoder(Tokenized).decode


def tokenize_url(upstream: str) -> str:
    """The server's `/tokenize`: at its origin, whatever the API's path."""
    parts = urlsplit(upstream)
    return f"{parts.scheme}://{parts.netloc}/tokenize"


def tokenize_body(chat_body: bytes) -> bytes:
    """The `/tokenize` request of a run's upstream body (the module doc)."""
    body: dict[str, Any] = msgspec.json.decode(chat_body)
    asked: dict[str, Any] = {k: body[k] for k in _TEMPLATE_FIELDS if k in body}
    asked["return_token_strs"] = True
    return msgspec.json.encode(asked)


async def read_tokenized(client: httpx.AsyncClient, url: str, chat_body: bytes) -> Tokenized:
    """POST the run's `/tokenize` and read the answer. httpx.HTTPError: the request
    failed; ValueError: an error status, an answer past MAX_TOKENIZE_BYTES, or not one."""
    request = client.build_request(
        "POST", url, content=tokenize_body(chat_body),
        headers={"content-type": "application/json"},
    )  # fmt: skip
    response = await client.send(request, stream=True)
    try:
        if response.status_code != 200:
            raise ValueError(
                f"{url} answered {response.status_code} to a chat's messages (vLLM's takes"
                " them; SGLang's takes a prompt string, docs/nodes.md)"
            )
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > MAX_TOKENIZE_BYTES:
                raise ValueError(f"{url} answered more than {MAX_TOKENIZE_BYTES} bytes")
    finally:
        await response.aclose()
    try:
        tokenized = _decode_tokenized(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{url} answered no token list: {exc}") from None
    strs = tokenized.token_strs
    if strs is not None and len(strs) != len(tokenized.tokens):
        raise ValueError(f"{url} answered {len(strs)} token strings for {len(tokenized.tokens)}")
    return tokenized


def mappable(request: pb.RunRequest) -> str | None:
    """Why `request` cannot be mapped before anything is asked; None: it can be."""
    if not request.prefix_blocks:
        return "it carries no prefix blocks"
    for message in request.messages:
        if any(part.type != "text" for part in message.parts):
            return "it has parts other than text"
    return None


def run_prompt(request: pb.RunRequest, tokenized: Tokenized, block_size: int) -> Prompt | str:
    """The `Prompt` of `request` as the server tokenized it (`tokenized`), or why it is
    not mapped. Linear in the prompt: off the loop for a large one."""
    if tokenized.token_strs is None:
        return "the server's /tokenize gives no token strings (return_token_strs)"
    try:
        rendered = pieces(request)
    except ValueError:
        return "a part or a tool's schema is not JSON"
    if not verified(request, rendered):
        return "it renders otherwise than the edge hashed it"
    blocks = list(request.prefix_blocks)
    needed = needed_tokens(
        rendered, token_bytes(tokenized.token_strs), len(blocks), PREFIX_BLOCK_CHARS
    )
    scope = (request.cache_salt, request.model)
    return prompt_blocks(scope, tokenized.tokens, block_size, needed, blocks)
