"""The forwarding policy's rules, on plain values: what a model server may be sent.

One implementation for both ends of the node hop. The edge applies it to a parsed
request (`edge.api.policy.apply_policy`); `iop-node` applies it again to each run's
upstream body (`edge.nodes.upstream.admit`), because anyone who reaches a node's gRPC
port could otherwise have it send its model server, with the node's own upstream key,
what the edge refuses. It lives here, under both, because neither may import the
other: `edge.api` parses the APIs' bodies and `edge.nodes` must not load it (a node's
command starts without the edge's parsers), and `edge.contract` sits beside `edge.api`.

Owns the policy's settings (`ForwardPolicy`, with the edge's defaults), the token caps
(`check_tokens`), the media URL schemes (`check_part`, `media_schemes`) and the fields
dropped unless allowed (`drop_unallowed`). A refusal is a `RequestError` (400) naming
the field. Pure: it imports only `edge.errors`, and knows nothing of requests, runs,
config files, nodes or HTTP.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from edge.errors import RequestError

# Above every current model's output window (the largest are 128 Ki tokens),
# so a real request never meets it, while 2**32 - 1 is refused.
DEFAULT_MAX_OUTPUT_TOKENS: Final = 131_072
# What `media_url_schemes` may list. `data:` is always allowed: it carries the
# bytes inline and makes the model server fetch nothing.
MEDIA_SCHEMES: Final = ("data", "http", "https")

# Keys of a content part that hold a URL (`image_url.url`, a bare `image_url`
# string, `video_url.url`, `audio_url.url`, ...), and those that hold inline
# data that may be a data: URL (`file.file_data`, `input_audio.data`).
_URL_KEYS: Final = frozenset({"url", "image_url", "video_url", "audio_url", "file_url"})
_DATA_KEYS: Final = frozenset({"file_data", "data"})
_SCHEME: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True, slots=True)
class ForwardPolicy:
    """One model's forwarding rules (`[models.NAME]` in the edge's config, `iop-node`'s
    flags)."""

    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    allow_chat_template: bool = False
    allow_ignore_eos: bool = False
    # Lower case; "data" is implied.
    media_url_schemes: frozenset[str] = frozenset({"data"})

    @property
    def schemes(self) -> frozenset[str]:
        """The media URL schemes allowed, `data` always among them."""
        return self.media_url_schemes | {"data"}


def media_schemes(names: Iterable[str]) -> tuple[str, ...]:
    """Scheme names as a setting lists them (`https`, `HTTPS:`), lower case.

    Raises:
        ValueError: a scheme other than data, http and https.
    """
    schemes = tuple(name.strip().lower().removesuffix(":") for name in names)
    for scheme in schemes:
        if scheme not in MEDIA_SCHEMES:
            raise ValueError(f"unsupported scheme {scheme!r} (allowed: {', '.join(MEDIA_SCHEMES)})")
    return schemes


def check_tokens(limits: Mapping[str, int], min_tokens: int | None, cap: int) -> None:
    """Each output-token limit (`max_tokens`, ...: by the name the caller sees) at most
    `cap`; `min_tokens` at most `cap` and at most each limit.

    Raises:
        RequestError: the first count out of bounds; `param` names it.
    """
    for param, value in limits.items():
        if value > cap:
            raise _too_large(param, value, cap)
    if min_tokens is None:
        return
    if min_tokens > cap:
        raise _too_large("min_tokens", min_tokens, cap)
    for param, value in limits.items():
        if min_tokens > value:
            raise RequestError(
                f"min_tokens ({min_tokens}) must be less than or equal to {param} ({value}).",
                param="min_tokens",
                code="invalid_value",
            )


def check_part(part: Mapping[str, Any], at: str, allowed: frozenset[str]) -> None:
    """Every URL and inline-data field of one content part (two deep) starts with an
    allowed scheme. `at` is the part's param path (`messages[0].content[1]`).

    Raises:
        RequestError: a field whose scheme is not allowed; `param` names it.
    """
    for path, value, is_url in _media_values(part, at):
        _check_url(path, value, is_url=is_url, allowed=allowed)


def drop_unallowed(
    fields: dict[str, Any], policy: ForwardPolicy
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`fields` (a request's extra sampling fields, or a whole body) without what the
    policy does not forward, and the names of what it left out: a caller's Jinja
    template (`chat_template_kwargs.chat_template`, or vLLM's top-level `chat_template`)
    and `ignore_eos`. `fields` itself when nothing was dropped, else a new dict."""
    dropped: list[str] = []
    out = dict(fields)
    if not policy.allow_chat_template:
        kwargs = out.get("chat_template_kwargs")
        if isinstance(kwargs, dict) and "chat_template" in kwargs:
            kept = {k: v for k, v in kwargs.items() if k != "chat_template"}
            if kept:
                out["chat_template_kwargs"] = kept
            else:
                del out["chat_template_kwargs"]
            dropped.append("chat_template_kwargs.chat_template")
        if "chat_template" in out:
            del out["chat_template"]
            dropped.append("chat_template")
    if not policy.allow_ignore_eos and "ignore_eos" in out:
        del out["ignore_eos"]
        dropped.append("ignore_eos")
    if not dropped:
        return fields, ()
    return out, tuple(dropped)


def _too_large(param: str, value: int, cap: int) -> RequestError:
    return RequestError(
        f"{param} is too large: {value}. This model supports at most {cap} completion "
        f"tokens, whereas you provided {value}.",
        param=param,
        code="invalid_value",
    )


def _media_values(raw: Mapping[str, Any], at: str) -> Iterator[tuple[str, str, bool]]:
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
