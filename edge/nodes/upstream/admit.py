"""What of a run's upstream body the node's forwarding policy lets reach the model server.

`iop-node` serves whoever reaches its gRPC port, and sends its model server, with its
own upstream key, whatever a run asks: so it applies the edge's forwarding policy
itself (`edge.forwarding`, the same rules and defaults as the edge's `[models.NAME]`),
to the body `edge.nodes.upstream.request.chat_request_body` made of the run, that is
to exactly what would be sent. Token counts over the cap (`max_tokens`,
`max_completion_tokens`, `min_tokens`; a count that is not an integer) and media
URLs of a scheme not allowed are refused (`RequestError`, a 400 naming the field);
a caller's chat template and `ignore_eos` are dropped unless allowed.

Pure: a body and a `ForwardPolicy` in, the body to send and the names of what was
dropped out. It knows nothing of sockets, gRPC or the upstream's answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from edge.errors import RequestError
from edge.forwarding import ForwardPolicy, check_part, check_tokens, drop_unallowed

__all__ = ["Admitted", "admit"]

# The body's output-token limits, as OpenAI-compatible servers name them.
_LIMITS: Final = ("max_tokens", "max_completion_tokens")


@dataclass(frozen=True, slots=True)
class Admitted:
    """The body to send upstream, and the fields the policy left out of it."""

    body: dict[str, Any]
    dropped: tuple[str, ...] = ()


def admit(body: dict[str, Any], policy: ForwardPolicy) -> Admitted:
    """`body` as `policy` lets it reach the model server (`body` itself when nothing
    is dropped).

    Raises:
        RequestError: a token count over the cap or not an integer, or a media URL
            whose scheme is not allowed; `param` names the field.
    """
    limits = {key: _count(body, key) for key in _LIMITS if body.get(key) is not None}
    min_tokens = _count(body, "min_tokens") if body.get("min_tokens") is not None else None
    check_tokens(limits, min_tokens, policy.max_output_tokens)
    allowed = policy.schemes
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            # Every part, a text one too: the node sends the part's JSON as the run has it.
            if isinstance(part, dict):
                check_part(part, f"messages[{i}].content[{j}]", allowed)
    out, dropped = drop_unallowed(body, policy)
    return Admitted(out, dropped)


def _count(body: dict[str, Any], key: str) -> int:
    """A token count of the body: an integer, else refused (a server would read
    `4e9` or `"4000000000"` as a number the cap never saw)."""
    value = body[key]
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise RequestError(
        f"Invalid type for {key}: expected an integer, got {type(value).__name__}.",
        param=key,
        code="invalid_type",
    )
