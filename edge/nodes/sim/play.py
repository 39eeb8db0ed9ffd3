"""What a run of the simulated node plays, as steps: the events of its model's answer.

`script_steps` turns a sim-script turn's items (found and checked by
`edge.nodes.sim.script`) into steps, `echo_steps` sim-echo's answer; the
server (`edge.nodes.sim.server`) plays them: `Sleep`, `Send` (an event, or
`repeat` copies of it), `Hang` (until cancelled), `Abort` (break the stream),
`End` (the run's outcome for the runs log). `event_from_item` builds the
RunEvent an item sends.

A run that continues an earlier one (`RunRequest.continuation`) plays the
same steps with a `edge.nodes.sim.continuation.Cut`: the text events the
continuation holds are skipped, one it ends inside is sent from there on (its
logprobs cut at the same character), and the sleeps before the cut are
skipped (the continuation starts at once, from the point reached); everything
else (events without text, the terminal, a hang or an abort) plays as it
would have. A continuation that is not the start of the answer ends the run
with an error event (`ContinuationError`'s message, no status), never a
wrong answer. A `request` item echoes the RunRequest without its
continuation.

Pure: no asyncio, no gRPC stream; steps are made as the server asks for them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.sim.continuation import TEXT_KINDS, ContinuationError, Cut, cut_logprobs
from edge.nodes.sim.script import ScriptError, message_text

__all__ = [
    "Abort",
    "End",
    "Hang",
    "Send",
    "Sleep",
    "Step",
    "echo_steps",
    "event_from_item",
    "script_steps",
]

_TERMINAL = frozenset({"complete", "error", "cancelled"})


@dataclasses.dataclass(frozen=True, slots=True)
class Sleep:
    """Pause the run."""

    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    """Send `event`, `repeat` times (the benchmarks' fast path)."""

    event: pb.RunEvent
    repeat: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Hang:
    """Wait until the run is cancelled."""


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """Break the stream without a terminal event."""


@dataclasses.dataclass(frozen=True, slots=True)
class End:
    """The run is over; `outcome` is its runs-log outcome."""

    outcome: str


Step = Sleep | Send | Hang | Abort | End


def _last_user_text(request: pb.RunRequest) -> str:
    for message in reversed(request.messages):
        if message.role == "user":
            return message_text(message)
    return ""


def _words(message: pb.Message) -> int:
    """sim-echo's count of a message's tokens: its words, in its string content or in each
    of its text parts (a text sent as parts counts as the same text sent as a string)."""
    if message.content is not None:
        return len(message.content.split())
    return sum(len(p.text.split()) for p in message.parts if p.type == "text")


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _tool_call_from_json(item: Any) -> pb.ToolCall:
    if not isinstance(item, dict):
        raise ScriptError("sim-script: a tool call is not an object")
    fn = item.get("function")
    source = fn if isinstance(fn, dict) else item
    return pb.ToolCall(
        id=str(item.get("id", "")),
        type=str(item.get("type", "function")),
        name=str(source.get("name", "")),
        arguments=_json_text(source.get("arguments", "")),
    )


def _token_bytes(value: Any) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(b, int) and 0 <= b < 256 for b in value):
        raise ScriptError("sim-script: a logprob's bytes is not a list of byte values")
    return bytes(value)


def _token_logprob(item: Any) -> pb.TokenLogprob:
    if not isinstance(item, dict):
        raise ScriptError("sim-script: a logprob is not an object")
    tops = item.get("top_logprobs") or []
    if not isinstance(tops, list) or not all(isinstance(t, dict) for t in tops):
        raise ScriptError("sim-script: top_logprobs is not a list of objects")
    return pb.TokenLogprob(
        token=str(item.get("token", "")),
        logprob=float(item.get("logprob", 0.0)),
        bytes=_token_bytes(item.get("bytes")),
        top_logprobs=[
            pb.TopLogprob(
                token=str(t.get("token", "")),
                logprob=float(t.get("logprob", 0.0)),
                bytes=_token_bytes(t.get("bytes")),
            )
            for t in tops
        ],
    )


def _echo_logprob(word: str, top: int) -> pb.TokenLogprob:
    """sim-echo's token for `word`: logprob -0.1, then `top` alternatives, the word first."""
    alternatives = [word] + [f"{word}~{k}" for k in range(1, top)]
    return pb.TokenLogprob(
        token=word,
        logprob=-0.1,
        top_logprobs=[
            pb.TopLogprob(token=t, logprob=-0.1 - 2.0 * k) for k, t in enumerate(alternatives[:top])
        ],
    )


def _logprobs_asked(request: pb.RunRequest) -> int | None:
    """None unless the request asked for logprobs; else how many top_logprobs (0-20)."""
    try:
        extra = json.loads(request.extra_json) if request.extra_json else {}
    except ValueError:
        return None
    if not isinstance(extra, dict) or extra.get("logprobs") is not True:
        return None
    top = extra.get("top_logprobs")
    return max(0, min(int(top), 20)) if isinstance(top, int) else 0


def event_from_item(item: dict[str, Any]) -> pb.RunEvent:
    """The RunEvent a script item (checked by `edge.nodes.sim.script`) sends."""
    usage = item.get("usage")
    metadata = {str(k): _json_text(v) for k, v in (item.get("metadata") or {}).items()}
    return pb.RunEvent(
        type=str(item.get("type", "")),
        delta=str(item.get("delta", "")) * int(item.get("delta_times", 1)),
        error=str(item.get("error", "")),
        message=str(item.get("message", "")),
        usage=pb.Usage(**{k: int(v) for k, v in usage.items()}) if usage else None,
        metadata=metadata,
        tool_calls=[_tool_call_from_json(c) for c in item.get("tool_calls") or ()],
        logprobs=[_token_logprob(t) for t in item.get("logprobs") or ()],
        http_status=int(item.get("http_status", 0)),
    )


def _request_json(request: pb.RunRequest) -> str:
    """What a `request` item sends: the RunRequest as received, less its continuation
    (so a continued run sends the same text as the run it continues, for the same request)."""
    text: str = dataclasses.replace(request, continuation=None).to_json()
    return text


def _from(event: pb.RunEvent, start: int) -> pb.RunEvent:
    """A text event sent from its character `start` on (the continuation holds the rest)."""
    return dataclasses.replace(
        event, delta=event.delta[start:], logprobs=cut_logprobs(event.logprobs, start)
    )


def _text_sends(cut: Cut | None, event: pb.RunEvent, repeat: int) -> Iterator[Send]:
    """`repeat` copies of a text event, less what the continuation holds of them."""
    if cut is None:
        yield Send(event, repeat)
        return
    if repeat > 1:
        skipped, start = cut.take_repeated(event.type, event.delta, repeat)
    else:
        skipped, start = 0, cut.take(event.type, event.delta)
    if start is None:
        return
    left = repeat - skipped
    if start:
        yield Send(_from(event, start))
        left -= 1
    if left:
        yield Send(event, left)


def _refused(exc: ContinuationError) -> Iterator[Step]:
    yield Send(pb.RunEvent(type="error", error=str(exc)))
    yield End("error")


def script_steps(
    items: list[dict[str, Any]],
    request: pb.RunRequest,
    *,
    usage: pb.Usage | None = None,
    cut: Cut | None = None,
) -> Iterator[Step]:
    """The steps of a script's items. A complete item without usage gets `usage` (the
    cache model's); with `cut`, what the continuation holds is skipped."""
    try:
        for item in items:
            if "accept_after_ms" in item:
                continue  # played before the run was accepted
            if "sleep_ms" in item:
                if cut is None or cut.passed:
                    yield Sleep(float(item["sleep_ms"]) / 1000)
                continue
            kind = item.get("type")
            if kind == "hang":
                yield Hang()
                return
            if kind == "abort":
                yield Abort()
                return
            if kind == "request":
                item = {"type": "delta", "delta": _request_json(request)}
            event = event_from_item(item)
            if kind == "complete" and usage is not None and "usage" not in item:
                event.usage = usage
            repeat = int(item.get("repeat", 1))
            if event.type in TEXT_KINDS:
                yield from _text_sends(cut, event, repeat)
                continue
            if kind in _TERMINAL and cut is not None:
                cut.end()
            yield Send(event, repeat)
            if kind in _TERMINAL:
                yield End("complete" if kind == "complete" else str(kind))
                return
        if cut is not None:
            cut.end()
    except ContinuationError as exc:
        yield from _refused(exc)
        return
    yield End("ended")


def echo_steps(
    request: pb.RunRequest, *, usage: pb.Usage | None = None, cut: Cut | None = None
) -> Iterator[Step]:
    """sim-echo's answer: the last user message word by word (each word one token when
    logprobs are asked), then complete; with `cut`, what the continuation holds is skipped.
    Its usage: `usage` (the cache model's) or the messages' words (`_words`), and the words
    echoed."""
    words = _last_user_text(request).split(" ")
    top = _logprobs_asked(request)
    try:
        for i, word in enumerate(words):
            piece = word if i == 0 else " " + word
            logprobs = [] if top is None else [_echo_logprob(piece, top)]
            event = pb.RunEvent(type="delta", delta=piece, logprobs=logprobs)
            yield from _text_sends(cut, event, 1)
        if cut is not None:
            cut.end()
    except ContinuationError as exc:
        yield from _refused(exc)
        return
    if usage is None:
        usage = pb.Usage(input_tokens=sum(map(_words, request.messages)))
    usage.output_tokens = len(words)
    yield Send(pb.RunEvent(type="complete", usage=usage, metadata={"finish_reason": "stop"}))
    yield End("complete")
