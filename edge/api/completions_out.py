"""Output events rendered as OpenAI's legacy completions: SSE chunks, or one answer.

One session, two renderings, both `text_completion` objects: `CompletionsStreamer`
turns output events into `data:` chunks whose choice carries a `text` piece
(then the finish chunk, the usage chunk when `stream_options.include_usage`
asked for it, and `data: [DONE]`); `CompletionsFolder` folds the same events
into one answer. Only the answer's text is rendered: reasoning is not asked
for (`edge.api.completions`) and tool calls cannot be, as the shape has no
place for either. `echo`'s prompt comes first, as its own text. Errors are
OpenAI's, as chat's.

Log-probabilities are the legacy object: `tokens`, `token_logprobs`,
`top_logprobs` (a token -> log-probability map per position) and
`text_offset` (where each token starts in the choice's text, in characters).

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgspec

from edge.api.render import DONE, KEEPALIVE, error_frame, usage_dict
from edge.stream.logprobs import TokenLogprob
from edge.stream.output import ContentOut, ErrorOut, FinishOut, LogprobContentOut, OutEvent

_encode = msgspec.json.encode
# The legacy shape's finish reasons: a tool call (which no request can declare here) is
# reported as a stop.
_FINISH: Final = {"tool_calls": "stop"}


def legacy_logprobs(tokens: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy `logprobs` object of `tokens`, the first starting at `offset`."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [_finite(t.logprob) for t in tokens],
        "top_logprobs": [{a.token: _finite(a.logprob) for a in t.top} for t in tokens],
        "text_offset": offsets,
    }


def _finite(value: float) -> float:
    # What OpenAI reports for a token too unlikely to have a finite log-probability.
    return value if math.isfinite(value) else -9999.0


class CompletionsStreamer:
    """Renders one stream's output events as `text_completion` SSE chunks."""

    __slots__ = ("_echo", "_end", "_head", "_include_usage", "_offset", "_usage_head")

    keepalive: Final = KEEPALIVE

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        *,
        include_usage: bool,
        echo_json: bytes | None = None,
        echo_chars: int = 0,
    ) -> None:
        common = (
            b'{"id":' + _encode(response_id) + b',"object":"text_completion","created":'
            + str(created).encode() + b',"model":' + _encode(model)
        )  # fmt: skip
        self._head = b"data: " + common + b',"choices":[{"text":'
        # With include_usage, every chunk but the usage one carries "usage": null.
        self._end = b'}],"usage":null}\n\n' if include_usage else b"}]}\n\n"
        self._usage_head = b"data: " + common + b',"choices":[],"usage":'
        self._include_usage = include_usage
        self._echo = echo_json
        # Characters of the choice's text so far (the next token's text_offset).
        self._offset = echo_chars

    def encode(self, events: Iterable[OutEvent]) -> bytes:
        """All of `events` as one buffer (ready frames go out in one write)."""
        parts: list[bytes] = []
        if self._echo is not None:  # the prompt, once, before anything of the answer
            parts.append(self._chunk(self._echo, b"null", b"null"))
            self._echo = None
        for event in events:
            if isinstance(event, ContentOut):
                logprobs = b"null"
                if isinstance(event, LogprobContentOut):
                    logprobs = _encode(legacy_logprobs(event.logprobs, self._offset))
                self._offset += len(event.text)
                parts.append(self._chunk(_encode(event.text), logprobs, b"null"))
            elif isinstance(event, FinishOut):
                reason = _FINISH.get(event.finish_reason, event.finish_reason)
                parts.append(self._chunk(b'""', b"null", _encode(reason)))
                if self._include_usage:
                    parts.append(self._usage_head + _encode(usage_dict(event.usage)) + b"}\n\n")
                parts.append(DONE)
            elif isinstance(event, ErrorOut):
                parts.append(error_frame(event.type, event.message, event.code))
            # The role, reasoning and tool calls have no place in this shape.
        return b"".join(parts)

    def _chunk(self, text: bytes, logprobs: bytes, finish: bytes) -> bytes:
        return (
            self._head + text + b',"index":0,"logprobs":' + logprobs
            + b',"finish_reason":' + finish + self._end
        )  # fmt: skip


class CompletionsFolder:
    """Folds output events into one `text_completion` (the non-streaming rendering)."""

    __slots__ = ("_created", "_echo", "_id", "_model", "error", "finish", "logprobs", "text")

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        *,
        logprobs: bool,
        echo: str | None = None,
    ) -> None:
        self._id, self._created, self._model = response_id, created, model
        self._echo = echo
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self.finish: FinishOut | None = None
        self.error: ErrorOut | None = None

    def add(self, events: Iterable[OutEvent]) -> None:
        for event in events:
            if isinstance(event, ContentOut):
                self.text.append(event.text)
                if self.logprobs is not None and isinstance(event, LogprobContentOut):
                    self.logprobs.extend(event.logprobs)
            elif isinstance(event, FinishOut):
                self.finish = event
            elif isinstance(event, ErrorOut):
                self.error = event

    def body(self) -> dict[str, Any]:
        assert self.finish is not None
        echo = self._echo or ""
        reason = _FINISH.get(self.finish.finish_reason, self.finish.finish_reason)
        logprobs = None if self.logprobs is None else legacy_logprobs(self.logprobs, len(echo))
        return {
            "id": self._id,
            "object": "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [
                {
                    "text": echo + "".join(self.text),
                    "index": 0,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }
            ],
            "usage": usage_dict(self.finish.usage),
        }
