"""Translation between protobuf messages and the edge's own types.

Pure functions, both directions: RunEvent -> `edge.stream.events`, and the
parsed OpenAI request -> RunRequest. The only place protobuf types meet ours.

Every message goes through the code betterproto2 generates from the
`.proto`, with one measured exception: a RunEvent that is only `type`
("delta" or "reasoning_delta") and `delta`, most events of a stream, is
read by hand (~1 us against ~15 us for the generated parser). Measured end
to end, A/B in one sitting (quick benchmark, 6 rounds a variant), the edge
spends 41 us of CPU per chunk on one stream without it and 29 us with it
(8.5 against 6.6 calibration units). Any other bytes, including a delta
event with any other field set (its `logprobs`, say), take the generated parser; a hypothesis
property holds both paths to the same result on any input.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from edge.contract._proto.iop.node import v1 as pb
from edge.stream.events import (
    Complete,
    Delta,
    Failed,
    LogprobDelta,
    NodeEvent,
    ReasoningDelta,
    Usage,
)
from edge.stream.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, TopLogprob
from edge.stream.toolcall import ToolCall

if TYPE_CHECKING:
    from edge.api.request import ChatMessage, ChatRequest

__all__ = [
    "SKIP",
    "Refused",
    "RunEventDecoder",
    "decode_run_event",
    "event_from_pb",
    "run_request_from_chat",
]

# The most of an error's `error` and `message` kept, in characters: a node is not
# trusted, and the caller may be shown them (a refusal's words, a run_error's reason).
# Cut, never added to: what the caller sees is always what the node sent.
MAX_FAILURE_CHARS = 2048

# A RunEvent carrying only `type` and `delta`, serialized in field order, starts
# with one of these; its bytes are decoded by hand (most events of a stream).
_DELTA_PREFIX = b"\x0a\x05delta\x12"
_REASONING_PREFIX = b"\x0a\x0freasoning_delta\x12"


def _usage(message: pb.Usage | None) -> Usage | None:
    """A node's usage; its cached tokens are some of its input tokens, at most all."""
    if message is None:
        return None
    return Usage(
        input_tokens=message.input_tokens,
        output_tokens=message.output_tokens,
        reasoning_tokens=message.reasoning_tokens,
        cached_input_tokens=min(message.cached_input_tokens, message.input_tokens),
    )


def _logprobs(tokens: list[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    """A delta's token logprobs; at most MAX_TOP_LOGPROBS alternatives each are kept."""
    return tuple(
        TokenLogprob(
            t.token,
            t.logprob,
            t.bytes,
            tuple(
                TopLogprob(a.token, a.logprob, a.bytes) for a in t.top_logprobs[:MAX_TOP_LOGPROBS]
            ),
        )
        for t in tokens
    )


def event_from_pb(message: pb.RunEvent) -> NodeEvent | None:
    """One RunEvent as our event; None for a type this edge does not know (skipped)."""
    kind = message.type
    if kind == "delta":
        if message.logprobs:
            return LogprobDelta(message.delta, _logprobs(message.logprobs))
        return Delta(message.delta)
    if kind == "reasoning_delta":
        return ReasoningDelta(message.delta)
    if kind == "complete":
        return Complete(
            usage=_usage(message.usage),
            metadata=dict(message.metadata),
            tool_calls=tuple(
                ToolCall(id=c.id, name=c.name, arguments=c.arguments, type=c.type or "function")
                for c in message.tool_calls
            ),
        )
    if kind == "error" or kind == "cancelled":
        status = message.http_status
        return Failed(
            kind=kind,
            error=message.error[:MAX_FAILURE_CHARS],
            message=message.message[:MAX_FAILURE_CHARS],
            usage=_usage(message.usage),
            http_status=status if 100 <= status <= 599 else 0,
        )
    return None


def decode_run_event(data: bytes) -> NodeEvent | None:
    """RunEvent bytes as our event: deltas by hand, everything else through betterproto2.

    The hand path accepts exactly `type` then `delta` and nothing else;
    anything it does not recognise whole takes the general path, so both
    paths give the same event for the same bytes.
    """
    if data.startswith(_DELTA_PREFIX):
        offset, kind = len(_DELTA_PREFIX), Delta
    elif data.startswith(_REASONING_PREFIX):
        offset, kind = len(_REASONING_PREFIX), ReasoningDelta  # type: ignore[assignment]
    else:
        return event_from_pb(pb.RunEvent.FromString(data))
    # The delta's length, a varint.
    length = shift = 0
    end = len(data)
    complete = False
    while offset < end and shift < 64:
        byte = data[offset]
        offset += 1
        length |= (byte & 0x7F) << shift
        if byte < 0x80:
            complete = True
            break
        shift += 7
    if complete and offset + length == end:
        try:
            return kind(data[offset:].decode())
        except UnicodeDecodeError:
            pass
    return event_from_pb(pb.RunEvent.FromString(data))


class Skip:
    """A RunEvent of a type this edge does not know: skipped."""

    __slots__ = ()


SKIP = Skip()

# How much of a decoding error's text `Refused` quotes.
REASON_CHARS = 200


class Refused(Skip):
    """A message the edge refuses (over the size limit, or bytes that are no RunEvent):
    why, in a short string, and nothing of the message.

    Returned by the decoder, not raised: an exception raised while a frame holds
    the message would keep it (megabytes) alive through its traceback, and a
    stored error (the run handle's) ties that traceback into a cycle that only
    a full garbage collection frees. The read loop raises the run's error from
    its own frame, once the message is gone (`edge.node.grpc.GrpcNode.read_run`).
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _decode_for_grpclib(data: bytes) -> NodeEvent | Skip:
    # grpclib reads None as the end of the stream: an unknown event is SKIP.
    try:
        event = decode_run_event(data)
    except Exception as exc:  # bytes that are no RunEvent: the node's failure, not ours
        # str, not repr: a decoding error's args may hold the bytes themselves.
        problem = f"{type(exc).__name__}: {exc}"[:REASON_CHARS]
    else:
        return SKIP if event is None else event
    return Refused(f"the node sent a message that is not a RunEvent ({problem})")


class RunEventDecoder:
    """The reply type of the Run route: grpclib's codec calls `FromString` on it."""

    FromString = staticmethod(_decode_for_grpclib)


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _message_to_pb(msg: ChatMessage) -> pb.Message:
    parts = [
        pb.ContentPart(
            type=p.type,
            text=p.text,
            json="" if p.type == "text" else _compact(p.raw),
        )
        for p in msg.parts
    ]
    return pb.Message(
        role=msg.role,
        content=msg.content,
        parts=parts,
        name=msg.name or "",
        tool_call_id=msg.tool_call_id or "",
        tool_calls=[
            pb.ToolCall(id=c.id, type=c.type, name=c.name, arguments=c.arguments)
            for c in msg.tool_calls
        ],
        reasoning_content=msg.reasoning_content,
    )


def run_request_from_chat(
    request: ChatRequest, *, run_id: str, model: str, deadline_unix_ms: int = 0
) -> pb.RunRequest:
    """Every field of the caller's request that a node needs, as a RunRequest."""
    policy = request.tools
    return pb.RunRequest(
        run_id=run_id,
        model=model,
        messages=[_message_to_pb(m) for m in request.messages],
        tools=[
            pb.Tool(
                type="function",
                name=t.name,
                description=t.description,
                parameters_json="" if t.parameters is None else _compact(t.parameters),
                strict=t.strict,
            )
            for t in policy.tools
        ],
        tool_choice=_tool_choice(request),
        parallel_tool_calls=policy.parallel_tool_calls if policy.tools else None,
        temperature=request.temperature,
        top_p=request.top_p,
        max_tokens=request.max_tokens,
        stop=list(request.stop),
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        response_format_json=""
        if request.response_format is None
        else _compact(request.response_format),
        metadata=dict(request.metadata),
        deadline_unix_ms=deadline_unix_ms,
        include_reasoning=request.include_reasoning,
        extra_json=_extra_json(request),
    )


def _tool_choice(request: ChatRequest) -> str:
    """The contract's tool_choice: "" without tools, a mode, or a function's name."""
    policy = request.tools
    if not policy.tools:
        return ""
    if policy.choice.mode == "function":
        return policy.choice.name or ""
    return policy.choice.mode


def _extra_json(request: ChatRequest) -> str:
    """Request fields the contract has no field of its own for, as one JSON object."""
    extra = dict(request.extra)
    if request.reasoning_effort is not None:
        extra["reasoning_effort"] = request.reasoning_effort
    if request.user is not None:
        extra["user"] = request.user
    return _compact(extra) if extra else ""
