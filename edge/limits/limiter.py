"""A request's API key, its limits, and the policy when the store is down.

`KeyRing` tells which key a bearer header holds: a dict from the sha256 of
each key to the key, then `hmac.compare_digest` of the digests, so lookup
is O(1) in the number of keys and the comparison is constant-time. The
keys of `[server] api_keys` / `api_keys_file` are keys without limits,
all named "api_keys". No key's secret is kept anywhere else, logged or
labelled: names only.

`Limiter` admits a request of a key through its store and ends it (gives
the stream back, counts the run's tokens), counting metrics by key name. A
store that does not answer is logged (one line per `_LOG_EVERY_S`, with
how many failures it stands for), counted, and then `fail_open` decides:
let the request in (no rate-limit headers: nothing is known) or answer 503.

`Gate` is one chat request's part in it: the key, whether it was admitted,
its headers, and the one end (`end` is idempotent, shielded and bounded,
so it runs whatever way the request ended).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio
from loguru import logger

from edge.config import KeyConfig
from edge.errors import EdgeError, NotFoundError
from edge.limits.store import LimitStore, StoreUnavailable
from edge.limits.window import Decision, Limits, rate_headers, retry_after_s
from edge.metrics import EdgeMetrics
from edge.stream.output import Outcome

# The name the keys of [server] api_keys (no names, no limits) go by in metrics and logs.
LEGACY_NAME = "api_keys"
# At most one "store unavailable" line this often.
_LOG_EVERY_S = 10.0
# Bound on ending a request's gate (release, tokens) once its cycle is over.
_END_S = 1.0


class RateLimitedError(EdgeError):
    """The key is over one of its limits: retry after `retry_after_s` (Retry-After)."""

    status = 429
    type = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int, headers: dict[str, str]) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.retry_after_s = retry_after_s
        self.headers = headers


class LimitsUnavailableError(EdgeError):
    """The limits store does not answer and `[limits] fail_open = false`: the operator acts."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="limits_unavailable")


@dataclass(frozen=True, slots=True)
class Key:
    """An accepted API key as the edge knows it: name, limits, allowed models."""

    name: str
    limits: Limits = field(default_factory=Limits)
    # None: every model.
    models: frozenset[str] | None = None

    @property
    def limited(self) -> bool:
        lim = self.limits
        return lim.rpm is not None or lim.tpm is not None or lim.max_streams is not None

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


def key_of(config: KeyConfig) -> Key:
    return Key(
        config.name,
        Limits(config.rpm, config.tpm, config.max_streams),
        None if config.models is None else frozenset(config.models),
    )


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


class KeyRing:
    """The accepted bearer keys: which key a header holds, in constant time."""

    def __init__(self, keys: Sequence[KeyConfig] = (), legacy: Sequence[str] = ()) -> None:
        self._by_digest: dict[bytes, tuple[bytes, Key]] = {}
        legacy_key = Key(LEGACY_NAME)
        for secret in legacy:
            if secret:
                d = _digest(secret.encode())
                self._by_digest.setdefault(d, (d, legacy_key))
        for config in keys:
            d = _digest(config.secret.encode())
            self._by_digest[d] = (d, key_of(config))
        self.keys = tuple({k.name: k for _, k in self._by_digest.values()}.values())

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def identify(self, header: str | None) -> Key | None:
        """The key `header` (`Bearer <key>`) holds, or None.

        The scheme is matched case-insensitively (RFC 9110, section 11.1), so
        `bearer` and `BEARER` work; the key itself is compared exactly.
        """
        if header is None:
            return None
        scheme, _, credentials = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        offered = _digest(credentials.strip().encode())
        # A miss compares against a digest of the same length: the same work either way.
        stored, key = self._by_digest.get(offered, (bytes(len(offered)), None))
        if hmac.compare_digest(offered, stored) and key is not None:
            return key
        return None


class Limiter:
    """Admits and ends the requests of limited keys through one store (see the module doc)."""

    def __init__(self, store: LimitStore, *, fail_open: bool, metrics: EdgeMetrics) -> None:
        self.store = store
        self.fail_open = fail_open
        self.metrics = metrics
        self._logged_at: float | None = None
        self._unlogged = 0

    def _store_failed(self, what: str, exc: StoreUnavailable) -> None:
        """One log line per _LOG_EVERY_S, however many failures; each one counted."""
        self.metrics.limits_store_errors.labels(self.store.kind).inc()
        now = trio.current_time()
        if self._logged_at is not None and now - self._logged_at < _LOG_EVERY_S:
            self._unlogged += 1
            return
        policy = "letting requests in (fail_open)" if self.fail_open else "answering 503"
        more = f" ({self._unlogged} more since the last line)" if self._unlogged else ""
        logger.bind(store=self.store.kind, error=str(exc)).warning(
            "limits store ({}) unavailable on {}: {}; {}{}",
            self.store.kind, what, exc, policy, more,
        )  # fmt: skip
        self._logged_at = now
        self._unlogged = 0

    async def admit(self, key: Key, lease: str) -> Decision | None:
        """The key's verdict (raises RateLimitedError), or None when the store is down
        and fail_open lets the request in (raises LimitsUnavailableError when not)."""
        try:
            decision = await self.store.admit(key.name, key.limits, lease)
        except StoreUnavailable as exc:
            self._store_failed("admit", exc)
            if self.fail_open:
                return None
            self.metrics.key_rejections.labels(key.name, "store").inc()
            raise LimitsUnavailableError(
                "The rate-limit store is unavailable; retry later."
            ) from None
        if not decision.admitted:
            assert decision.over is not None
            self.metrics.key_rejections.labels(key.name, decision.over).inc()
            raise RateLimitedError(
                _over_message(key, decision),
                retry_after_s=retry_after_s(decision),
                headers=rate_headers(key.limits, decision),
            )
        return decision

    async def end(self, key: Key, lease: str, tokens: int) -> None:
        try:
            if key.limits.max_streams is not None:
                await self.store.release(key.name, lease)
            if key.limits.tpm is not None and tokens > 0:
                await self.store.add_tokens(key.name, tokens)
        except StoreUnavailable as exc:
            self._store_failed("end", exc)

    async def aclose(self) -> None:
        await self.store.aclose()


def _over_message(key: Key, decision: Decision) -> str:
    lim = key.limits
    if decision.over == "requests":
        what = f"requests per minute (limit {lim.rpm})"
    elif decision.over == "tokens":
        what = f"tokens per minute (limit {lim.tpm}, used {decision.tokens})"
    else:
        what = f"requests in flight (limit {lim.max_streams})"
    return f"Rate limit reached for key {key.name!r} on {what}. Retry after the reset."


def model_not_found(model: str) -> NotFoundError:
    """What a model outside a key's allow-list is answered: as if it did not exist."""
    return NotFoundError(
        f"The model {model!r} does not exist or is not served here.",
        param="model",
        code="model_not_found",
    )


class Gate:
    """One chat request's key and limits: check the model, admit, end once."""

    __slots__ = ("_admitted", "_ended", "_lease", "_limiter", "_metrics", "headers", "key")

    def __init__(self, limiter: Limiter | None, metrics: EdgeMetrics) -> None:
        self._limiter = limiter
        self._metrics = metrics
        self.key: Key | None = None
        self._lease = secrets.token_hex(8)
        self._admitted = False
        self._ended = False
        # The rate-limit headers the answer carries (a limited key's, once admitted).
        self.headers: dict[str, str] = {}

    def check_model(self, model: str) -> None:
        """A model the key may not use is answered like one that does not exist."""
        key = self.key
        if key is not None and not key.allows(model):
            self._metrics.key_rejections.labels(key.name, "model").inc()
            raise model_not_found(model)

    async def admit(self) -> None:
        """Count the request against its key; raises RateLimitedError over a limit."""
        key = self.key
        if key is None:
            return
        limiter = self._limiter
        if limiter is not None and key.limited:
            try:
                decision = await limiter.admit(key, self._lease)
            except RateLimitedError as exc:
                self.headers = exc.headers
                raise
            self._admitted = True
            if decision is not None:
                self.headers = rate_headers(key.limits, decision)
            if key.limits.max_streams is not None:
                limiter.metrics.key_streams.labels(key.name).inc()
        self._metrics.key_requests.labels(key.name).inc()

    async def end(self, outcome: Outcome | None) -> None:
        """The request's run is over, or its cycle (whichever comes first; once): give its
        stream back, count its run's tokens (`outcome.usage`, when the node reported it)."""
        if self._ended:
            return
        self._ended = True
        key, limiter = self.key, self._limiter
        if key is None:
            return
        usage = outcome.usage if outcome is not None and outcome.usage_sample else None
        input_tokens = usage.input_tokens if usage is not None else 0
        output_tokens = usage.output_tokens if usage is not None else 0
        metrics = self._metrics
        if input_tokens:
            metrics.key_tokens.labels(key.name, "input").inc(input_tokens)
        if output_tokens:
            metrics.key_tokens.labels(key.name, "output").inc(output_tokens)
        if not self._admitted or limiter is None:
            return
        if key.limits.max_streams is not None:
            metrics.key_streams.labels(key.name).dec()
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + _END_S
            await limiter.end(key, self._lease, input_tokens + output_tokens)
