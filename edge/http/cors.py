"""CORS: which browser origins may call the API, and the headers that tell them so.

Owns `[server] cors_allow_origins` at request time. With no origin listed
(the default) nothing here adds a header. Otherwise, for a request whose
`Origin` is listed (or any origin, with "*"):

- a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`,
  to one of the edge's paths) is answered 204 by the app before any API key
  is asked for (browsers send no credentials on a preflight), with the
  path's methods, the request headers the browser asked to send (echoed, so
  every SDK's own headers pass: `authorization`, `x-api-key`,
  `anthropic-version`, `x-stainless-*`, ...; a list that is not plain header
  names gets `DEFAULT_HEADERS` instead) and a `Max-Age`;
- every other answer, errors and SSE streams included, carries
  `Access-Control-Allow-Origin` (the origin itself, with `Vary: Origin`, or
  "*") and `Access-Control-Expose-Headers`, naming the headers clients read
  (`EXPOSED`).

An origin not listed gets no CORS header (the browser then refuses the
answer); its preflight is handled as any `OPTIONS` request: 405. No
credentials are allowed: keys travel in headers, not cookies.

Knows the app's request and response objects, nothing of the routes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from quart import Request, Response

# Answers to a preflight may be reused by the browser this long (seconds).
MAX_AGE_S: Final = 600
# What a preflight is allowed when its Access-Control-Request-Headers is not a plain list.
DEFAULT_HEADERS: Final = (
    "authorization, content-type, x-api-key, anthropic-version, anthropic-beta,"
    " anthropic-dangerous-direct-browser-access, x-request-id, x-session-id,"
    " openai-organization, openai-project, openai-beta, x-stainless-arch, x-stainless-lang,"
    " x-stainless-os, x-stainless-package-version, x-stainless-retry-count,"
    " x-stainless-runtime, x-stainless-runtime-version, x-stainless-timeout,"
    " x-stainless-helper-method, x-stainless-async"
)
# The response headers a browser client may read.
EXPOSED: Final = (
    "x-request-id, retry-after, x-ratelimit-limit-requests, x-ratelimit-remaining-requests,"
    " x-ratelimit-reset-requests, x-ratelimit-limit-tokens, x-ratelimit-remaining-tokens,"
    " x-ratelimit-reset-tokens"
)
# Header names separated by commas, within a bound: echoed as they are.
_HEADER_LIST: Final = re.compile(
    r"[!#$%&'*+.^_`|~0-9A-Za-z-]+(?:[ \t]*,[ \t]*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*"
)
_MAX_ECHOED_CHARS: Final = 4096


class Cors:
    """The edge's CORS policy (see the module doc)."""

    __slots__ = ("_any", "_origins")

    def __init__(self, origins: Iterable[str]) -> None:
        listed = frozenset(origins)
        self._any = "*" in listed
        self._origins = listed - {"*"}

    @property
    def enabled(self) -> bool:
        return self._any or bool(self._origins)

    def _allowed(self, request: Request) -> str | None:
        """The `Access-Control-Allow-Origin` value for `request`, or None: no CORS."""
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        if self._any:
            return "*"
        return origin if origin.lower() in self._origins else None

    def preflight(self, request: Request, methods: Iterable[str]) -> Response | None:
        """The 204 answer to `request` if it is a preflight from an allowed origin to a
        path whose methods are `methods`; else None (the request goes on as any other)."""
        if not self.enabled or request.method != "OPTIONS":
            return None
        if "Access-Control-Request-Method" not in request.headers:
            return None
        if self._allowed(request) is None:
            return None
        asked = request.headers.get("Access-Control-Request-Headers", "").strip()
        if asked and (len(asked) > _MAX_ECHOED_CHARS or not _HEADER_LIST.fullmatch(asked)):
            asked = DEFAULT_HEADERS
        response = Response(b"", status=204)
        del response.headers["Content-Type"]  # a 204 has no body to type
        response.headers["Access-Control-Allow-Methods"] = ", ".join(sorted(set(methods)))
        if asked:
            response.headers["Access-Control-Allow-Headers"] = asked
        response.headers["Access-Control-Max-Age"] = str(MAX_AGE_S)
        response.vary.update(("Access-Control-Request-Method", "Access-Control-Request-Headers"))
        return response

    def decorate(self, request: Request, response: Response) -> None:
        """Put the CORS headers on `response` when `request`'s origin is allowed."""
        if not self.enabled:
            return
        allowed = self._allowed(request)
        if allowed is None:
            if not self._any:
                response.vary.add("Origin")  # another origin may get a different answer
            return
        response.headers["Access-Control-Allow-Origin"] = allowed
        if allowed != "*":
            response.vary.add("Origin")
        response.headers["Access-Control-Expose-Headers"] = EXPOSED
