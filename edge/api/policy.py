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
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from edge.errors import RequestError

if TYPE_CHECKING:
    from edge.api.request import ChatRequest

# Above every current model's output window (the largest are 128 Ki tokens),
# so a real request never meets it, while 2**32 - 1 is refused at the edge.
DEFAULT_MAX_OUTPUT_TOKENS: Final = 131_072
# What `media_url_schemes` may list. `data:` is always allowed: it carries the
# bytes inline and makes the node fetch nothing.
MEDIA_SCHEMES: Final = ("data", "http", "https")

# Keys of a content part that hold a URL (`image_url.url`, a bare `image_url`
# string, `video_url.url`, `audio_url.url`, ...), and those that hold inline
# data that may be a data: URL (`file.file_data`, `input_audio.data`).
_URL_KEYS: Final = frozenset({"url", "image_url", "video_url", "audio_url", "file_url"})
_DATA_KEYS: Final = frozenset({"file_data", "data"})
_SCHEME: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True, slots=True)
class ForwardPolicy:
    """One model's forwarding rules (`[models.NAME]` in the config)."""

    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    allow_chat_template: bool = False
    allow_ignore_eos: bool = False
    # Lower case; "data" is implied.
    media_url_schemes: frozenset[str] = frozenset({"data"})


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
    _check_tokens(request, policy.max_output_tokens)
    _check_media(request, policy.media_url_schemes | {"data"})
    extra = dict(request.extra)
    dropped: list[str] = []
    kwargs = extra.get("chat_template_kwargs")
    if not policy.allow_chat_template and isinstance(kwargs, dict) and "chat_template" in kwargs:
        kept = {k: v for k, v in kwargs.items() if k != "chat_template"}
        if kept:
            extra["chat_template_kwargs"] = kept
        else:
            del extra["chat_template_kwargs"]
        dropped.append("chat_template_kwargs.chat_template")
    if not policy.allow_ignore_eos and "ignore_eos" in extra:
        del extra["ignore_eos"]
        dropped.append("ignore_eos")
    if not dropped:
        return Forwarded(request)
    return Forwarded(replace(request, extra=extra), tuple(dropped))


def _too_large(param: str, value: int, cap: int) -> RequestError:
    return RequestError(
        f"{param} is too large: {value}. This model supports at most {cap} completion "
        f"tokens, whereas you provided {value}.",
        param=param,
        code="invalid_value",
    )


def _check_tokens(request: ChatRequest, cap: int) -> None:
    if request.max_tokens is not None and request.max_tokens > cap:
        raise _too_large("max_tokens", request.max_tokens, cap)
    min_tokens = request.extra.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
        if min_tokens > cap:
            raise _too_large("min_tokens", min_tokens, cap)
        if request.max_tokens is not None and min_tokens > request.max_tokens:
            raise RequestError(
                f"min_tokens ({min_tokens}) must be less than or equal to max_tokens "
                f"({request.max_tokens}).",
                param="min_tokens",
                code="invalid_value",
            )


def _check_media(request: ChatRequest, allowed: frozenset[str]) -> None:
    for i, message in enumerate(request.messages):
        for j, part in enumerate(message.parts):
            if part.type == "text":
                continue
            for path, value, is_url in _media_values(part.raw, f"messages[{i}].content[{j}]"):
                _check_url(path, value, is_url=is_url, allowed=allowed)


def _media_values(raw: dict[str, Any], at: str) -> Iterator[tuple[str, str, bool]]:
    """(param path, value, holds a URL) of a part's URL and inline-data fields, two deep."""
    for key, value in raw.items():
        if isinstance(value, dict):
            for inner, item in value.items():
                if isinstance(item, str) and (inner in _URL_KEYS or inner in _DATA_KEYS):
                    yield f"{at}.{key}.{inner}", item, inner in _URL_KEYS
        elif isinstance(value, str) and key in _URL_KEYS:
            yield f"{at}.{key}", value, True


def _check_url(path: str, value: str, *, is_url: bool, allowed: frozenset[str]) -> None:
    """A URL field must start with an allowed scheme, as written (no leading blanks).

    Inline data (base64) never holds a colon, so data that does must be an
    allowed URL too. A scheme hidden behind whitespace or control characters
    (which some URL parsers strip) is no scheme: refused.
    """
    if not is_url and ":" not in value:
        return
    match = _SCHEME.match(value)
    scheme = match.group(1).lower() if match else None
    if scheme in allowed:
        return
    names = ", ".join(f"{s}:" for s in sorted(allowed))
    if scheme is None:
        problem = "is not a URL with a scheme"
    else:
        problem = f"uses the URL scheme {scheme!r}, which this server does not accept"
    raise RequestError(
        f"Invalid value for {path}: it {problem}. Accepted: {names} "
        "(send media inline as a data: URL).",
        param=path,
        code="invalid_value",
    )
