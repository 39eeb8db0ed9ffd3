"""The forwarding policy: what of a valid request a model's node may receive.

A request can be well-formed and still ask a node for more than the operator
wants any caller to have: billions of output tokens, a Jinja template of its
own (`chat_template_kwargs.chat_template`: older vLLM versions had template
advisories), `ignore_eos` (a run that never stops before its token cap), or
media the node would fetch itself from a URL the caller chose (`http(s)`:
the node's network position, not the caller's; `file:`: the node's disk).

`apply_policy(request, policy)` is pure: a `ChatRequest` and a model's
`ForwardPolicy` in; the request to forward, with the names of what was
dropped, out; or a `RequestError` (400) naming the field. It knows nothing
of config files, nodes or HTTP. No trio, quart, grpclib or asyncio.

The rules themselves (the caps, the schemes, the fields dropped) are
`edge.forwarding`'s, which `iop-node` applies to its runs as well; this module
maps a `ChatRequest` onto them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from edge.forwarding import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    MEDIA_SCHEMES,
    ForwardPolicy,
    check_part,
    check_tokens,
    drop_unallowed,
)

if TYPE_CHECKING:
    from edge.api.request import ChatRequest

__all__ = [
    "DEFAULT_MAX_OUTPUT_TOKENS",
    "MEDIA_SCHEMES",
    "ForwardPolicy",
    "Forwarded",
    "apply_policy",
]


@dataclass(frozen=True, slots=True)
class Forwarded:
    """The request to send to the node, and the fields the policy left out of it."""

    request: ChatRequest
    dropped: tuple[str, ...] = ()


def apply_policy(request: ChatRequest, policy: ForwardPolicy) -> Forwarded:
    """The request as `policy` lets it reach the node.

    Raises:
        RequestError: a token count over the model's cap, or a media URL whose
            scheme is not allowed; `param` names the field.
    """
    min_tokens = request.extra.get("min_tokens")
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool):
        min_tokens = None
    limits = {} if request.max_tokens is None else {"max_tokens": request.max_tokens}
    check_tokens(limits, min_tokens, policy.max_output_tokens)
    allowed = policy.schemes
    for i, message in enumerate(request.messages):
        for j, part in enumerate(message.parts):
            if part.type != "text":
                check_part(part.raw, f"messages[{i}].content[{j}]", allowed)
    extra, dropped = drop_unallowed(request.extra, policy)
    if not dropped:
        return Forwarded(request)
    return Forwarded(replace(request, extra=extra), dropped)
