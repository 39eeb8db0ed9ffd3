"""The pure mapping between the node contract and an OpenAI-compatible upstream.

It owns these translations, each a plain function or an incremental state
machine fed dicts and strings:

- `chat_request_body`: a RunRequest as the upstream's chat completions body.
- `ChunkMapper`: the response's server-sent events (decoded by
  `edge.nodes.upstream.sse`; OpenAI `chat.completion.chunk` objects) as RunEvents,
  assembling streamed tool-call fragments (`ToolCallAssembler`) and holding
  usage and `finish_reason` for the one terminal event. `feed_completion`
  maps a whole `chat.completion` for a server that ignored `stream: true`.
- `error_message` / `models_from_body`: an upstream's error body and model list.

Logprobs: a request with `logprobs` / `top_logprobs` (in extra_json) is
forwarded as sent, `top_logprobs` capped at 20 (OpenAI's bound). A choice's
`logprobs.content` (OpenAI's shape, as vLLM, llama.cpp and SGLang answer
it) goes on the content delta of the same chunk as typed TokenLogprobs; a
chunk with logprobs and nothing else passes them to the next content
delta, and those on a chunk of reasoning or tool calls are dropped. Each
token keeps at most 20 alternatives, and a delta's logprobs are cut into
several events so none nears gRPC's message limit.

It tolerates the dialects of vLLM, llama.cpp, Ollama and SGLang: `reasoning`
or `reasoning_content`, `content: null` or `""` deltas, nulls for absent
fields, extra fields (`timings`, `matched_stop`, ...), a whole tool call in
one chunk with or without `index`, usage in its own chunk, on the finish
chunk, or missing, and error objects inside the stream.

It must not know sockets, httpx, grpclib or asyncio, nor who reads the events.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Final, cast

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.sse import DONE, SSEMessage

__all__ = [
    "ChunkMapper",
    "ToolCallAssembler",
    "ToolCallLimitError",
    "chat_request_body",
    "error_message",
    "models_from_body",
]

# Error bodies are quoted up to this many characters.
MAX_ERROR_CHARS: Final = 500
# A text delta longer than this is sent as several RunEvents: each stays well
# under gRPC's 4 MiB message limit (at most 4 bytes a character in UTF-8).
MAX_DELTA_CHARS: Final = 512 * 1024
# What one run's streamed tool calls may add up to: their names and argument
# fragments in characters, and their number. The calls travel in the complete
# event's typed `tool_calls`, one gRPC message (4 MiB at most).
MAX_TOOL_CALL_CHARS: Final = 512 * 1024
MAX_TOOL_CALLS: Final = 256
_UINT32_MAX: Final = 2**32 - 1
# OpenAI's bound on top_logprobs, asked of the upstream and kept of its answer.
MAX_TOP_LOGPROBS: Final = 20
# Estimated bytes of logprobs one delta event carries at most (the rest goes
# in the next event), and tokens waiting for content at most (then dropped).
MAX_EVENT_LOGPROB_BYTES: Final = 1024 * 1024
MAX_WAITING_LOGPROBS: Final = 4096
# Fields the request body owns: extra_json may not override them.
_OWNED: Final = frozenset({"model", "messages", "stream", "stream_options"})


# --- RunRequest -> the upstream's request body -----------------------------------


def _content_part(part: Any) -> dict[str, Any]:
    if part.json:
        try:
            raw = json.loads(part.json)
        except ValueError:
            raw = None
        if isinstance(raw, dict):
            return raw
    return {"type": part.type or "text", "text": part.text}


def _message(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role}
    if message.content is not None:
        out["content"] = message.content
    elif message.parts:
        out["content"] = [_content_part(p) for p in message.parts]
    else:
        # OpenAI's shape: an assistant turn that only calls tools has null content.
        out["content"] = None if message.tool_calls else ""
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type or "function",
                "function": {"name": call.name, "arguments": call.arguments or "{}"},
            }
            for call in message.tool_calls
        ]
    return out


def _tool(tool: Any) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters_json:
        function["parameters"] = json.loads(tool.parameters_json)
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": tool.type or "function", "function": function}


def _tool_choice(choice: str) -> str | dict[str, Any]:
    if choice in ("auto", "none", "required"):
        return choice
    return {"type": "function", "function": {"name": choice}}


def chat_request_body(request: pb.RunRequest) -> dict[str, Any]:
    """Every field of `request` an OpenAI-compatible server understands, as its JSON body.

    Always streams and asks for usage. `extra_json` is merged in last but
    cannot replace the model, the messages or the streaming fields.
    """
    body: dict[str, Any] = {
        "model": request.model,
        "messages": [_message(m) for m in request.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.tools:
        body["tools"] = [_tool(t) for t in request.tools]
    if request.tool_choice:
        body["tool_choice"] = _tool_choice(request.tool_choice)
    optional = {
        "parallel_tool_calls": request.parallel_tool_calls,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_tokens": request.max_tokens,
        "seed": request.seed,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
    }
    body.update((k, v) for k, v in optional.items() if v is not None)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.response_format_json:
        body["response_format"] = json.loads(request.response_format_json)
    if request.metadata:
        body["metadata"] = dict(request.metadata)
    if request.extra_json:
        extra = json.loads(request.extra_json)
        if isinstance(extra, dict):
            body.update((k, v) for k, v in extra.items() if k not in _OWNED)
    top = body.get("top_logprobs")
    if isinstance(top, int) and not isinstance(top, bool) and top > MAX_TOP_LOGPROBS:
        body["top_logprobs"] = MAX_TOP_LOGPROBS
    return body


# --- chunks -> RunEvents ---------------------------------------------------------


@dataclass(slots=True)
class _Call:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


def _text(value: object) -> str:
    """A delta's text: a string, or the text of content parts; "" for null."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(
            str(p.get("text") or "") for p in value if isinstance(p, dict) and p.get("text")
        )
    return ""


def _arguments(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # Ollama-native objects


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


class ToolCallLimitError(ValueError):
    """The upstream's tool calls passed MAX_TOOL_CALL_CHARS or MAX_TOOL_CALLS."""


class ToolCallAssembler:
    """Streamed tool-call fragments folded into whole calls, in the order they began.

    A fragment joins the call with its `index` unless it names a different
    `id`; without an index it joins the call with its id, starts a new call if
    it has an id or a name, and otherwise extends the last call.

    What it holds is bounded: past MAX_TOOL_CALLS calls or MAX_TOOL_CALL_CHARS
    characters of ids, names and arguments, `feed` raises ToolCallLimitError.
    """

    __slots__ = ("_by_index", "_chars", "calls")

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self._by_index: dict[int, _Call] = {}
        self._chars = 0

    def feed(self, fragments: object) -> None:
        if isinstance(fragments, dict):
            fragments = [fragments]
        if not isinstance(fragments, list):
            return
        for fragment in fragments:
            if isinstance(fragment, dict):
                self._fragment(fragment)

    def _fragment(self, fragment: dict[str, Any]) -> None:
        function = fragment.get("function")
        fn: dict[str, Any] = function if isinstance(function, dict) else {}
        call_id = fragment.get("id") if isinstance(fragment.get("id"), str) else ""
        name = fn.get("name") or fragment.get("name")
        name = name if isinstance(name, str) else ""
        index = fragment.get("index")
        if isinstance(index, bool) or not isinstance(index, int):
            index = None
        call: _Call | None = None
        if index is not None:
            call = self._by_index.get(index)
            if call is not None and call_id and call.id and call_id != call.id:
                call = None
        elif call_id:
            call = next((c for c in self.calls if c.id == call_id), None)
        elif not name and self.calls:
            call = self.calls[-1]
        if call is None:
            if len(self.calls) >= MAX_TOOL_CALLS:
                raise ToolCallLimitError(f"upstream sent more than {MAX_TOOL_CALLS} tool calls")
            call = _Call()
            self.calls.append(call)
            if index is not None:
                self._by_index[index] = call
        arguments = _arguments(fn.get("arguments", fragment.get("arguments")))
        kept = len(arguments)
        if call_id and not call.id:
            call.id = call_id
            kept += len(call.id)
        if name and not call.name:
            call.name = name
            kept += len(name)
        self._chars += kept
        if self._chars > MAX_TOOL_CALL_CHARS:
            raise ToolCallLimitError(
                f"upstream tool calls exceed {MAX_TOOL_CALL_CHARS} characters"
                " of ids, names and arguments"
            )
        if arguments:
            call.arguments.append(arguments)

    def typed(self, id_prefix: str) -> list[pb.ToolCall]:
        """The named calls, as the contract types them; a missing id becomes `call_{prefix}_{n}`."""
        out: list[pb.ToolCall] = []
        for call in self.calls:
            if not call.name:
                continue
            out.append(
                pb.ToolCall(
                    id=call.id or f"call_{id_prefix}_{len(out)}",
                    type="function",
                    name=call.name,
                    arguments="".join(call.arguments) or "{}",
                )
            )
        return out


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


def _deltas(kind: str, text: str) -> list[pb.RunEvent]:
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


def _choice_logprobs(choice: dict[str, Any]) -> list[pb.TokenLogprob]:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return []
    return [t for item in content if (t := _token_logprob(item)) is not None]


def _logprob_size(token: pb.TokenLogprob) -> int:
    """An estimate of a token's encoded bytes (4 a character, 32 an entry)."""
    return 4 * len(token.token) + 32 + sum(4 * len(a.token) + 32 for a in token.top_logprobs)


def _content_events(text: str, tokens: list[pb.TokenLogprob]) -> list[pb.RunEvent]:
    """`text` with its tokens as delta events: cut at token ends, each event under
    MAX_DELTA_CHARS characters and MAX_EVENT_LOGPROB_BYTES of logprobs."""
    if not tokens:
        return _deltas("delta", text)
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
            events.extend(_deltas("delta", rest[len(head) :]))
    return events


def _is_error(payload: dict[str, Any]) -> bool:
    return payload.get("error") is not None or payload.get("object") == "error"


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
        "_usage",
        "_waiting_logprobs",
        "outcome",
        "tools",
    )

    def __init__(self, id_prefix: str) -> None:
        self._id_prefix = id_prefix
        self.tools = ToolCallAssembler()
        self._finish: str | None = None
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

    def error(self, text: str) -> pb.RunEvent:
        """The terminal error event (callers check `terminated` first)."""
        self.outcome = "error"
        return pb.RunEvent(type="error", error=text)

    def _chunk(self, payload: dict[str, Any]) -> list[pb.RunEvent]:
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        timings = payload.get("timings")
        if isinstance(timings, dict):
            self._cached_fallback = _count(timings.get("cache_n"))
        events: list[pb.RunEvent] = []
        choices = payload.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) not in (0, None):
                continue  # n > 1 is not part of the contract
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            reasoning = _text(delta.get("reasoning_content")) or _text(delta.get("reasoning"))
            if reasoning:
                events.extend(_deltas("reasoning_delta", reasoning))
            content = _text(delta.get("content"))
            tokens = _choice_logprobs(choice)
            if content:
                if self._waiting_logprobs:
                    tokens = self._waiting_logprobs + tokens
                    self._waiting_logprobs = []
                events.extend(_content_events(content, tokens))
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
        return events

    def _complete(self) -> pb.RunEvent:
        self.outcome = "complete"
        metadata = {"finish_reason": self._finish or "stop"}
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


# --- error bodies and model lists ------------------------------------------------


def error_message(status: int, body: bytes, reason: str = "") -> str:
    """`upstream returned STATUS: MESSAGE`, the message dug out of any server's error body.

    Shapes: `{"error": {"message"}}` (OpenAI, llama.cpp, Ollama),
    `{"error": "..."}`, `{"object": "error", "message"}` (vLLM, SGLang),
    `{"detail": ...}` (FastAPI), or plain text.
    """
    text = body.decode("utf-8", errors="replace").strip()
    message = ""
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        error = doc.get("error")
        if isinstance(error, dict) and error.get("message"):
            message = str(error["message"])
        elif isinstance(error, str) and error:
            message = error
        elif doc.get("message"):
            message = str(doc["message"])
        elif doc.get("detail"):
            detail = doc["detail"]
            message = detail if isinstance(detail, str) else json.dumps(detail)
    if not message:
        message = text or reason or "no details"
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "..."
    return f"upstream returned {status}: {message}"


def models_from_body(body: bytes) -> list[tuple[str, str]]:
    """(id, owned_by) of each model in a `/models` answer; raises ValueError if it has none.

    OpenAI's `{"data": [{"id"}]}`, or llama.cpp's and Ollama's `{"models": [{"name"}]}`.
    """
    doc = json.loads(body)
    items: object = None
    if isinstance(doc, dict):
        items = doc.get("data") or doc.get("models")
    if not isinstance(items, list):
        raise ValueError("the /models answer has no model list")
    out: list[tuple[str, str]] = []
    for item in cast(list[object], items):
        if isinstance(item, dict):
            model = item.get("id") or item.get("model") or item.get("name")
            if isinstance(model, str) and model:
                out.append((model, str(item.get("owned_by") or "")))
    return out
