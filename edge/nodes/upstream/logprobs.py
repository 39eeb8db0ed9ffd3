"""Content deltas and their token logprobs as RunEvents under gRPC's message limit.

A choice's `logprobs.content` (OpenAI's shape, as vLLM, llama.cpp and SGLang
answer it) becomes typed TokenLogprobs, each keeping at most
MAX_TOP_LOGPROBS alternatives; `content_events` cuts a text and its tokens
into delta events at token ends, and `deltas` a text alone, so that none
nears the message limit (MAX_DELTA_CHARS characters, MAX_EVENT_LOGPROB_BYTES
of logprobs an event).

Pure: it must not know sockets, httpx, grpclib or asyncio, nor which chunk
the tokens came from (that is `chunks`).
"""

from __future__ import annotations

from typing import Any, Final

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.routes import MAX_MESSAGE_BYTES

__all__ = ["MAX_DELTA_CHARS", "MAX_TOP_LOGPROBS", "choice_logprobs", "content_events", "deltas"]

# A text delta longer than this is sent as several RunEvents: each stays well
# under gRPC's message limit. At most 4 bytes a character in UTF-8, the text
# takes at most half the message (512 Ki characters of the 4 MiB).
MAX_DELTA_CHARS: Final = MAX_MESSAGE_BYTES // 8
# OpenAI's bound on top_logprobs, asked of the upstream and kept of its answer.
MAX_TOP_LOGPROBS: Final = 20
# Estimated bytes of logprobs one delta event carries at most (the rest goes
# in the next event): a quarter of the message (1 MiB of the 4), beside its text.
MAX_EVENT_LOGPROB_BYTES: Final = MAX_MESSAGE_BYTES // 4


def deltas(kind: str, text: str) -> list[pb.RunEvent]:
    """`text` as RunEvents of `kind`, each at most MAX_DELTA_CHARS characters."""
    if len(text) <= MAX_DELTA_CHARS:
        return [pb.RunEvent(type=kind, delta=text)]
    return [
        pb.RunEvent(type=kind, delta=text[i : i + MAX_DELTA_CHARS])
        for i in range(0, len(text), MAX_DELTA_CHARS)
    ]


def _logprob_value(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return -9999.0  # what OpenAI reports for a token too unlikely to rate
    return float(value)


def _logprob_bytes(value: object) -> bytes | None:
    if isinstance(value, list) and all(
        isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in value
    ):
        return bytes(value)
    return None


def _token_logprob(item: object) -> pb.TokenLogprob | None:
    """One entry of OpenAI's `logprobs.content`; None when it has no token string."""
    if not isinstance(item, dict) or not isinstance(item.get("token"), str):
        return None
    tops = item.get("top_logprobs")
    return pb.TokenLogprob(
        token=item["token"],
        logprob=_logprob_value(item.get("logprob")),
        bytes=_logprob_bytes(item.get("bytes")),
        top_logprobs=[
            pb.TopLogprob(
                token=top["token"],
                logprob=_logprob_value(top.get("logprob")),
                bytes=_logprob_bytes(top.get("bytes")),
            )
            for top in (tops if isinstance(tops, list) else [])[:MAX_TOP_LOGPROBS]
            if isinstance(top, dict) and isinstance(top.get("token"), str)
        ],
    )


def choice_logprobs(choice: dict[str, Any]) -> list[pb.TokenLogprob]:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return []
    return [t for item in content if (t := _token_logprob(item)) is not None]


def _logprob_size(token: pb.TokenLogprob) -> int:
    """An estimate of a token's encoded bytes (4 a character, 32 an entry)."""
    return 4 * len(token.token) + 32 + sum(4 * len(a.token) + 32 for a in token.top_logprobs)


def content_events(text: str, tokens: list[pb.TokenLogprob]) -> list[pb.RunEvent]:
    """`text` with its tokens as delta events: cut at token ends, each event under
    MAX_DELTA_CHARS characters and MAX_EVENT_LOGPROB_BYTES of logprobs."""
    if not tokens:
        return deltas("delta", text)
    events: list[pb.RunEvent] = []
    start = end = size = 0
    group: list[pb.TokenLogprob] = []
    for token in tokens:
        end = min(end + len(token.token), len(text))
        group.append(token)
        size += _logprob_size(token)
        if size >= MAX_EVENT_LOGPROB_BYTES or end - start >= MAX_DELTA_CHARS:
            events.append(pb.RunEvent(type="delta", delta=text[start:end], logprobs=group))
            start, size, group = end, 0, []
    rest = text[start:]
    if group or rest:
        head = rest[:MAX_DELTA_CHARS]
        events.append(pb.RunEvent(type="delta", delta=head, logprobs=group))
        if len(rest) > len(head):
            events.extend(deltas("delta", rest[len(head) :]))
    return events
