"""A run that continues an answer (`RunRequest.continuation`) as its upstream's request.

Upstreams continue a final assistant message their own way; `--continuation`
names it (`MODES`), or `auto` tells it from what the upstream is (`mode_for`):

- `vllm`: vLLM's and SGLang's OpenAI servers take the partial answer as the last
  message, `{"role": "assistant", "content": text}`, with the extra parameters
  `continue_final_message: true` and `add_generation_prompt: false` (their chat
  template then leaves the message open, without an end-of-turn token); the
  reasoning goes on that message as `reasoning` (vLLM's name) and
  `reasoning_content` (SGLang's), which their chat templates render before
  the content. `echo` is dropped (vLLM would send the partial answer again).
- `llamacpp`: llama.cpp's `llama-server` takes the partial answer as the last
  message too, with `continue_final_message: true` and `add_generation_prompt:
  false`. It prefills a final assistant message by itself ("assistant
  prefill", on unless the server runs with `--no-prefill-assistant`), but
  builds that know `continue_final_message` (b1-0c1e570, llama-cpp-python
  0.3.36, verified by `make real`) stream the prefilled text back before the
  new text unless the request names it: the parameter is what makes a
  streamed answer continue rather than start over (an older build ignores
  it, and never echoed). The reasoning is dropped (older servers append the
  content only, and refuse a prefill while thinking is on). A request that
  already ends with an assistant message (the client's own prefill) has the
  text appended to it.
- `none`: the node does not continue answers (Ollama has no way to).

`auto` is `vllm` for an upstream whose `/metrics` reads as vLLM's or SGLang's
(`edge.nodes.upstream.load`) or whose `/models` says `owned_by` `vllm` or
`sglang` for the model; `llamacpp` for a llama.cpp server (its `/metrics`, or
`owned_by` `llamacpp`) once a probe showed that it continues rather than
starts over (`probe_body`: one streamed token after a made-up answer, which
must not come back first); and `none` otherwise. The probe cannot tell a
build older than the assistant prefill (early 2025), which answers a new
turn: name `none` for one.

The upstream streams only what comes after the partial answer. Its usage
counts only that output: `whole_usage` adds the tokens the earlier runs
counted (`continuation.output_tokens`), so `complete` says the whole
answer's, as an uncut run would. `max_tokens` (and `max_completion_tokens`)
bound the whole answer: the upstream is asked for what is left of them.
An upstream that refuses a continuation (a 4xx: a prefill it cannot do) is
the node's failure, not the request's, which another node accepted
(`as_failure`).

Pure: it must not know sockets, httpx, grpclib or asyncio.
"""

from __future__ import annotations

from typing import Any, Final

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.load import LLAMACPP, SGLANG, VLLM

__all__ = [
    "AUTO",
    "LLAMACPP_MODE",
    "MODES",
    "NONE",
    "PROBE_TEXT",
    "VLLM_MODE",
    "as_failure",
    "continued_body",
    "is_llamacpp",
    "mode_for",
    "probe_body",
    "probe_continues",
    "whole_usage",
]

AUTO: Final = "auto"
VLLM_MODE: Final = "vllm"
LLAMACPP_MODE: Final = "llamacpp"
NONE: Final = "none"
# What `--continuation` takes.
MODES: Final = (AUTO, VLLM_MODE, LLAMACPP_MODE, NONE)
_UINT32_MAX: Final = 2**32 - 1
# Owners (`/models`' `owned_by`) and load dialects that say the server continues the vLLM way.
_VLLM_LIKE: Final = frozenset({VLLM, SGLANG})


def mode_for(setting: str, dialect: str | None, owner: str, *, probed: bool = False) -> str:
    """How a model is continued: `setting` unless it is `auto`; then by the upstream's
    load dialect (`dialect`, None: not read yet or none) or the model's `owned_by`, and
    for llama.cpp by the probe (`probed`: it showed the server continues)."""
    if setting not in MODES:
        raise ValueError(f"continuation {setting!r} is not one of {', '.join(MODES)}")
    if setting != AUTO:
        return setting
    if dialect in _VLLM_LIKE or owner in _VLLM_LIKE:
        return VLLM_MODE
    if probed and is_llamacpp(dialect, owner):
        return LLAMACPP_MODE
    return NONE


def is_llamacpp(dialect: str | None, owner: str) -> bool:
    """Whether the upstream is llama.cpp's server, by its load dialect or the model's
    `owned_by` (llama-server says `llamacpp` in its `/models`)."""
    return dialect == LLAMACPP or owner == LLAMACPP


# The probe of a llama.cpp server's continuation (`probe_body`, `probe_continues`).
PROBE_TEXT: Final = "Continuation probe: the rest follows"


def probe_body(model: str) -> dict[str, Any]:
    """A streamed request that continues the answer PROBE_TEXT by one token, as `llamacpp`
    continues answers."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
    }
    return continued_body(body, pb.Continuation(text=PROBE_TEXT), LLAMACPP_MODE)


def probe_continues(content: str) -> bool:
    """Whether the text a probe streamed shows the server continues: it does not start
    over with the answer it was given."""
    return not content.startswith(PROBE_TEXT)


def continued_body(
    body: dict[str, Any], continuation: pb.Continuation, mode: str
) -> dict[str, Any]:
    """`body` (`chat_request_body`'s) as the request that continues `continuation`."""
    if mode not in (VLLM_MODE, LLAMACPP_MODE):
        raise ValueError(f"this node does not continue answers (continuation {mode})")
    messages: list[dict[str, Any]] = list(body["messages"])
    last = messages[-1] if messages else None
    if (
        mode == LLAMACPP_MODE
        and last is not None
        and last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
        and not last.get("tool_calls")
    ):
        messages[-1] = {**last, "content": last["content"] + continuation.text}
    else:
        partial: dict[str, Any] = {"role": "assistant", "content": continuation.text}
        if mode == VLLM_MODE and continuation.reasoning:
            partial["reasoning"] = partial["reasoning_content"] = continuation.reasoning
        messages.append(partial)
    out = {**body, "messages": messages}
    out.pop("echo", None)
    out["continue_final_message"] = True
    out["add_generation_prompt"] = False
    for key in ("max_tokens", "max_completion_tokens"):
        limit = out.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            out[key] = max(1, limit - continuation.output_tokens)
    return out


def whole_usage(event: pb.RunEvent, continuation: pb.Continuation) -> pb.RunEvent:
    """A `complete` event's usage with the earlier runs' output tokens added (the whole
    answer's count); any other event (or a complete without usage) as it is."""
    if event.type == "complete" and event.usage is not None:
        total = event.usage.output_tokens + continuation.output_tokens
        event.usage.output_tokens = min(total, _UINT32_MAX)
    return event


def as_failure(event: pb.RunEvent) -> pb.RunEvent:
    """An upstream's refusal of a continuation (an `error` with a 4xx other than 408 and
    429) as the node's failure (status 0, the refusal quoted); any other event as it is."""
    status = event.http_status
    if event.type != "error" or not 400 <= status <= 499 or status in (408, 429):
        return event
    words = event.message or event.error or "no details"
    return pb.RunEvent(
        type="error",
        error=f"upstream refused to continue the answer ({status}): {words}",
        usage=event.usage,
    )
