"""An upstream's chat completion chunks as RunEvents, ending in exactly one terminal.

`ChunkMapper` is an incremental state machine fed the response's server-sent
events (decoded by `edge.nodes.upstream.sse`; OpenAI `chat.completion.chunk`
objects): text and reasoning become deltas (`logprobs` cuts them under the
message limit, with their tokens), streamed tool-call fragments are
assembled (`toolcalls`), and usage and `finish_reason` are held for the one
terminal event. `feed_completion` maps a whole `chat.completion` for a
server that ignored `stream: true`.

`coalesced` sends the plain deltas of chunks that arrived together (one
read of the body) as one event: a model server streams a chunk per token,
and under load the node reads several at once. One event instead of ten
is a tenth of the work at every hop after it (the node's gRPC send, the
edge's read, its stream session and its client write) and no later: only
what is here already is joined.

Logprobs go on the content delta of the same chunk; a chunk with logprobs
and nothing else passes them to the next content delta, and those on a
chunk of reasoning or tool calls are dropped.

It tolerates the dialects of vLLM, llama.cpp, Ollama and SGLang: `reasoning`
or `reasoning_content`, `content: null` or `""` deltas, nulls for absent
fields, extra fields (`timings`, `matched_stop`, ...), a whole tool call in
one chunk with or without `index`, usage in its own chunk, on the finish
chunk, or missing, and error objects inside the stream. The stop string that
ended the text, when the server names it (vLLM's `stop_reason`, SGLang's
`matched_stop`, when a string; llama.cpp's `stopping_word` in the `__verbose`
fields it adds when asked, `edge.nodes.upstream.relay.LLAMACPP_STOP`), is the
`complete` metadata's `stop_sequence`.

It must not know sockets, httpx, grpclib or asyncio, nor who reads the events.
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.bodies import MAX_ERROR_CHARS
from edge.nodes.upstream.logprobs import MAX_DELTA_CHARS, choice_logprobs, content_events, deltas
from edge.nodes.upstream.sse import DONE, SSEMessage
from edge.nodes.upstream.toolcalls import ToolCallAssembler, ToolCallLimitError

__all__ = ["ChunkMapper", "coalesced"]

_UINT32_MAX: Final = 2**32 - 1
# Logprobs of chunks without content waiting for the next content, at most (then dropped).
MAX_WAITING_LOGPROBS: Final = 4096
# The longest stop string passed on as the one that matched (the edge takes nothing longer).
MAX_STOP_SEQUENCE_CHARS: Final = 1024


def _text(value: object) -> str:
    """A delta's text: a string, or the text of content parts; "" for null."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(
            str(p.get("text") or "") for p in value if isinstance(p, dict) and p.get("text")
        )
    return ""


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    if isinstance(value, float) and not math.isfinite(value):
        return 0
    return max(0, min(int(value), _UINT32_MAX))


def _detail(usage: dict[str, Any], key: str, name: str) -> int:
    details = usage.get(key)
    if isinstance(details, dict) and details.get(name) is not None:
        return _count(details.get(name))
    return _count(usage.get(name))  # some servers flatten the details


def _error_text(payload: dict[str, Any]) -> str:
    error = payload.get("error")
    if isinstance(error, dict):
        message = error.get("message") or json.dumps(error, ensure_ascii=False)
        code = error.get("code")
    elif error is not None:
        message, code = str(error), None
    else:  # vLLM/SGLang: {"object": "error", "message": ..., "code": ...}
        message, code = payload.get("message") or "unknown error", payload.get("code")
    suffix = f" (code {code})" if isinstance(code, int | str) and code != "" else ""
    return f"upstream error: {str(message)[:MAX_ERROR_CHARS]}{suffix}"


def _is_error(payload: dict[str, Any]) -> bool:
    return payload.get("error") is not None or payload.get("object") == "error"


# The kinds of delta whose consecutive events may go as one, when they carry text only.
_JOINABLE: Final = frozenset({"delta", "reasoning_delta"})


def _joinable(event: pb.RunEvent) -> bool:
    """A delta with text and nothing else (no logprobs, tool calls or metadata)."""
    return (
        event.type in _JOINABLE and not event.logprobs and not event.tool_calls
        and not event.metadata
    )  # fmt: skip


def coalesced(events: list[pb.RunEvent]) -> list[pb.RunEvent]:
    """`events` with each run of consecutive text-only deltas of one kind as one delta
    of their joined text, at most MAX_DELTA_CHARS characters (a longer run: several);
    every other event, and a delta alone in its run, as it is, in its place. Linear:
    each run is joined once."""
    if len(events) < 2:
        return events
    out: list[pb.RunEvent] = []
    run: list[pb.RunEvent] = []  # the text-only deltas of one kind not out yet
    size = 0

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append(pb.RunEvent(type=run[0].type, delta="".join(e.delta for e in run)))
        run.clear()

    for event in events:
        if not _joinable(event):
            flush()
            out.append(event)
            continue
        if run and (event.type != run[0].type or size + len(event.delta) > MAX_DELTA_CHARS):
            flush()
        if not run:
            size = 0
        run.append(event)
        size += len(event.delta)
    flush()
    return out


class ChunkMapper:
    """One run's upstream chunks as RunEvents, ending in exactly one terminal event.

    `feed` maps one SSE event; `end` is called when the body ends and supplies
    the terminal if none was sent: complete when `[DONE]` or a `finish_reason`
    arrived, else an error. After the terminal everything is ignored.
    """

    __slots__ = (
        "_cached_fallback",
        "_finish",
        "_id_prefix",
        "_stop_sequence",
        "_usage",
        "_waiting_logprobs",
        "outcome",
        "tools",
    )

    def __init__(self, id_prefix: str) -> None:
        self._id_prefix = id_prefix
        self.tools = ToolCallAssembler()
        self._finish: str | None = None
        self._stop_sequence = ""  # the stop string the server says matched
        self._usage: dict[str, Any] | None = None
        self._cached_fallback = 0  # llama.cpp: timings.cache_n
        # Logprobs of a chunk that had no content, for the next content delta.
        self._waiting_logprobs: list[pb.TokenLogprob] = []
        # "complete" or "error" once the terminal event has been produced.
        self.outcome: str | None = None

    @property
    def terminated(self) -> bool:
        return self.outcome is not None

    def feed(self, message: SSEMessage) -> list[pb.RunEvent]:
        if self.terminated:
            return []
        if message.data == DONE:
            return [self._complete()]
        try:
            payload = json.loads(message.data)
        except ValueError:
            if message.event == "error":
                return [self.error(f"upstream error: {message.data[:MAX_ERROR_CHARS]}")]
            return [self.error(f"upstream sent a malformed chunk: {message.data[:200]!r}")]
        if not isinstance(payload, dict):
            return [self.error(f"upstream sent a malformed chunk: {message.data[:200]!r}")]
        if message.event == "error" or _is_error(payload):
            return [self.error(_error_text(payload))]
        try:
            return self._chunk(payload)
        except ToolCallLimitError as exc:
            return [self.error(str(exc))]

    def feed_completion(self, payload: object) -> list[pb.RunEvent]:
        """A whole `chat.completion` (a server that did not stream): its events and terminal."""
        if not isinstance(payload, dict):
            return [self.error("upstream sent a response that is not a JSON object")]
        if _is_error(payload):
            return [self.error(_error_text(payload))]
        choices = payload.get("choices")
        if isinstance(choices, list):
            payload = {
                **payload,
                "choices": [
                    {**c, "delta": c.get("message") or {}} for c in choices if isinstance(c, dict)
                ],
            }
        try:
            events = self._chunk(payload)
        except ToolCallLimitError as exc:
            return [self.error(str(exc))]
        if not self.terminated:
            events.append(self._complete())
        return events

    def end(self) -> list[pb.RunEvent]:
        """The body ended: the terminal event, if one is still owed."""
        if self.terminated:
            return []
        if self._finish is not None:
            return [self._complete()]
        return [self.error("upstream stream ended early (no [DONE] and no finish_reason)")]

    def error(self, text: str, *, message: str = "", http_status: int = 0) -> pb.RunEvent:
        """The terminal error event (callers check `terminated` first); a refusal's
        `text` is its code, `message` its words (`edge.nodes.upstream.bodies.UpstreamError`)."""
        self.outcome = "error"
        return pb.RunEvent(type="error", error=text, message=message, http_status=http_status)

    def _chunk(self, payload: dict[str, Any]) -> list[pb.RunEvent]:
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        timings = payload.get("timings")
        if isinstance(timings, dict):
            self._cached_fallback = _count(timings.get("cache_n"))
        events: list[pb.RunEvent] = []
        native = payload.get("__verbose")  # llama.cpp's own fields, when asked for them
        if isinstance(native, dict) and native.get("stop_type") == "word":
            matched = native.get("stopping_word")
            if isinstance(matched, str) and 0 < len(matched) <= MAX_STOP_SEQUENCE_CHARS:
                self._stop_sequence = matched
        choices = payload.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) not in (0, None):
                continue  # n > 1 is not part of the contract
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            reasoning = _text(delta.get("reasoning_content")) or _text(delta.get("reasoning"))
            if reasoning:
                events.extend(deltas("reasoning_delta", reasoning))
            content = _text(delta.get("content"))
            tokens = choice_logprobs(choice)
            if content:
                if self._waiting_logprobs:
                    tokens = self._waiting_logprobs + tokens
                    self._waiting_logprobs = []
                events.extend(content_events(content, tokens))
            elif tokens and not reasoning and not delta.get("tool_calls"):
                # Reasoning and tool-call tokens carry no logprobs out (as OpenAI).
                room = MAX_WAITING_LOGPROBS - len(self._waiting_logprobs)
                self._waiting_logprobs.extend(tokens[: max(0, room)])
            calls = delta.get("tool_calls")
            if calls:
                self.tools.feed(calls)
            finish = choice.get("finish_reason")
            if isinstance(finish, str) and finish:
                self._finish = finish
                matched = choice.get("stop_reason")  # a stop token's id is an int: not one
                if not isinstance(matched, str):
                    matched = choice.get("matched_stop")
                if isinstance(matched, str) and 0 < len(matched) <= MAX_STOP_SEQUENCE_CHARS:
                    self._stop_sequence = matched
        return events

    def _complete(self) -> pb.RunEvent:
        self.outcome = "complete"
        metadata = {"finish_reason": self._finish or "stop"}
        if self._stop_sequence:
            metadata["stop_sequence"] = self._stop_sequence
        calls = self.tools.typed(self._id_prefix)
        if calls and metadata["finish_reason"] == "stop":  # Ollama and older servers
            metadata["finish_reason"] = "tool_calls"
        return pb.RunEvent(
            type="complete", usage=self._usage_pb(), metadata=metadata, tool_calls=calls
        )

    def _usage_pb(self) -> pb.Usage | None:
        usage = self._usage
        if usage is None:
            return None
        cached = _detail(usage, "prompt_tokens_details", "cached_tokens") or self._cached_fallback
        return pb.Usage(
            input_tokens=_count(usage.get("prompt_tokens")),
            output_tokens=_count(usage.get("completion_tokens")),
            reasoning_tokens=_detail(usage, "completion_tokens_details", "reasoning_tokens"),
            cached_input_tokens=cached,
        )
