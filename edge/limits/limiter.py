"""A request's API key, its limits, and the policy when the store is down.

`KeyRing` tells which key a bearer header holds: a dict from the sha256 of
each key to the key, then `hmac.compare_digest` of the digests, so lookup
is O(1) in the number of keys and the comparison is constant-time. The
keys of `[server] api_keys` / `api_keys_file` are keys without limits,
each its own tenant (its stored responses, its share), named "api_keys-" and
a short hash of the key (`legacy_name`). No key's secret is kept anywhere
else, logged or labelled: names only.

`Limiter` admits a request of a key through its store and ends it (gives
the stream back, counts the run's tokens), counting metrics by key name. A
store that does not answer is logged (one line per `_LOG_EVERY_S`, with
how many failures it stands for), counted, and then `fail_open` decides:
let the request in (no rate-limit headers: nothing is known) or answer 503.

A stream is a lease that expires (`[limits] lease_s`) unless renewed. The
limiter knows the leases this process holds, and while it holds any, one task
of its own renews them all every `renew_s` in one store call (`renew`): one
call per process per renewal, however many streams, and no task per request.
A release the store did not take (down, or past its deadline) is retried in
the background, a few times with backoff (never holding the request), then
left to expire with its lease.

`Gate` is one chat request's part in it: the key, whether it was admitted,
its headers, and the one end (`end` is idempotent, shielded and bounded,
so it runs whatever way the request ended). A request is admitted as soon
as its key is known from its headers, before its body is read or parsed:
a key over its limits is answered 429 for the price of a store call. The
model, known once the body is parsed, is checked then; a model outside the
key's allow-list refunds the admission (not counted against `rpm`).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import trio
from loguru import logger

from edge.config import KeyConfig
from edge.errors import EdgeError, NotFoundError
from edge.limits.base import LimitStore, StoreUnavailable
from edge.limits.window import Decision, Limits, rate_headers, retry_after_s
from edge.observe.log import REQUEST_ID
from edge.observe.metrics import EdgeMetrics
from edge.stream.output import Outcome

# The keys of [server] api_keys (no names, no limits) go by this and a short hash of the
# key in metrics, logs and the response store (`legacy_name`).
LEGACY_NAME = "api_keys"
# Hex digits of the key's sha256 in its name: enough to tell a fleet's keys apart, too
# few to help guess one.
_LEGACY_HASH_HEX = 10
# At most one "store unavailable" line this often.
_LOG_EVERY_S = 10.0
# Bound on ending a request's gate (release, tokens) once its cycle is over.
_END_S = 1.0
# Failed releases: retried in rounds, the first this long after, each twice as late...
_RETRY_FIRST_S = 0.2
# ...this many rounds (0.2 + 0.4 + ... + 3.2 = 6.2 s), then left to expire with the lease.
_RETRY_ROUNDS = 5
# Failed releases kept for retrying at most; past it, one is left to expire at once.
_RETRY_MAX = 10_000


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
    # Whether its cached prompt prefixes are shared with the other keys that share theirs
    # (`[[keys]] cache_scope = "shared"`); else they are its own.
    shares_cache: bool = False
    # Its share of the slots when the fleet is full, the service tiers it may ask for and
    # the one it runs on unless it asks (`[[keys]] weight, service_tiers, service_tier`).
    weight: float = 1.0
    service_tiers: tuple[str, ...] = ("default", "flex")
    service_tier: str = "default"
    # A `[[keys]]` entry (its name is a metric label), not one of `[server] api_keys`.
    named: bool = False

    @property
    def cache_scope(self) -> str:
        """The KV-cache scope of its requests: its name, or "" (shared)."""
        return "" if self.shares_cache else self.name

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
        shares_cache=config.cache_scope == "shared",
        weight=config.weight,
        service_tiers=config.service_tiers,
        service_tier=config.service_tier,
        named=True,
    )


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def legacy_name(secret: str) -> str:
    """The name of a key of `[server] api_keys`: "api_keys-" and a short hash of it."""
    return f"{LEGACY_NAME}-{hashlib.sha256(secret.encode()).hexdigest()[:_LEGACY_HASH_HEX]}"


class KeyRing:
    """The accepted bearer keys: which key a header holds, in constant time."""

    def __init__(self, keys: Sequence[KeyConfig] = (), legacy: Sequence[str] = ()) -> None:
        self._by_digest: dict[bytes, tuple[bytes, Key]] = {}
        for secret in legacy:
            if secret:
                d = _digest(secret.encode())
                self._by_digest.setdefault(d, (d, Key(legacy_name(secret))))
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

    def __init__(
        self, store: LimitStore, *, fail_open: bool, metrics: EdgeMetrics, renew_s: float = 3.0
    ) -> None:
        self.store = store
        self.fail_open = fail_open
        self.metrics = metrics
        self.renew_s = renew_s
        self._logged_at: float | None = None
        self._unlogged = 0
        # The leases this process holds, by key name (a key stays, emptied, until the
        # next renewal has told the store that it holds none of its streams any more).
        self._live: dict[str, set[str]] = {}
        self._renewer: trio.CancelScope | None = None
        # Releases the store did not take, waiting for the retrier (key name, lease).
        self._unreleased: dict[tuple[str, str], None] = {}
        self._retrier: trio.CancelScope | None = None
        self._closed = False

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
        if key.limits.max_streams is not None:
            self._live.setdefault(key.name, set()).add(lease)
            if self._renewer is None and not self._closed:
                self._renewer = self._system_task(self._renew_leases, "limits: renew leases")
        return decision

    def rekey(self, keys: KeyRing) -> None:
        """A reload's keys: the store counts the limited ones of `keys` from now on (the
        streams held carry over: this process's are renewed by name)."""
        self.store.rekey([(k.name, k.limits) for k in keys.keys if k.limited])

    def held(self, key: Key, lease: str) -> bool:
        """Whether `lease` is a stream of `key` this process holds (and renews)."""
        return lease in self._live.get(key.name, ())

    async def end(self, key: Key, lease: str, tokens: int) -> None:
        if key.limits.max_streams is not None:
            await self._release(key.name, lease, self.store.release)
        if key.limits.tpm is not None and tokens > 0:
            try:
                await self.store.add_tokens(key.name, tokens)
            except StoreUnavailable as exc:
                self._store_failed("end", exc)

    async def refund(self, key: Key, lease: str) -> None:
        """Take back an admitted request (and its stream): it does not count after all."""
        await self._release(key.name, lease, self.store.refund)

    async def _release(
        self, name: str, lease: str, how: Callable[[str, str], Awaitable[None]]
    ) -> None:
        """Give the stream back through `how`; if the store does not take it (an error, or
        the caller's deadline), the retrier tries again later."""
        held = self._live.get(name)
        if held is not None:
            held.discard(lease)
        done = False
        try:
            await how(name, lease)
            done = True
        except StoreUnavailable as exc:
            self._store_failed("end", exc)
        finally:
            if not done:
                self._retry_later(name, lease)

    def _retry_later(self, name: str, lease: str) -> None:
        if self._closed or len(self._unreleased) >= _RETRY_MAX:
            return  # left to expire with its lease
        self._unreleased[(name, lease)] = None
        if self._retrier is None:
            self._retrier = self._system_task(self._retry_releases, "limits: retry releases")

    def _system_task(
        self, fn: Callable[[trio.CancelScope], Awaitable[None]], name: str
    ) -> trio.CancelScope:
        """Start `fn(scope)` as a system task: it outlives the request that started it,
        which never waits for it. In a copy of this context (the store's asyncio bridge
        lives there), minus the request. Returns the scope that stops it."""
        scope = trio.CancelScope()
        context = contextvars.copy_context()
        context.run(REQUEST_ID.set, None)
        trio.lowlevel.spawn_system_task(fn, scope, name=name, context=context)
        return scope

    async def _renew_leases(self, scope: trio.CancelScope) -> None:
        """Every `renew_s` while this process holds leases, all of them in one store
        call; a key whose last stream ended is named once more, empty (the store then
        forgets this process's count of it). Ends when nothing is held."""
        try:
            with scope:
                while self._live:
                    await trio.sleep(self.renew_s)
                    leases = {name: frozenset(held) for name, held in self._live.items()}
                    for name in [name for name, held in self._live.items() if not held]:
                        del self._live[name]
                    try:
                        await self.store.renew(leases)
                    except StoreUnavailable as exc:
                        self._store_failed("renew", exc)
        except Exception as exc:  # never out of a system task: it would end the edge
            logger.opt(exception=exc).error("renewing the limits store's leases failed")
        finally:
            self._renewer = None

    async def _retry_releases(self, scope: trio.CancelScope) -> None:
        """Rounds of the failed releases, with backoff, until none is left or the rounds
        are over (the rest expire with their leases). A round stops at the first failure:
        the store is still down."""
        delay = _RETRY_FIRST_S
        try:
            with scope:
                for _ in range(_RETRY_ROUNDS):
                    await trio.sleep(delay)
                    delay *= 2
                    for name, lease in list(self._unreleased):
                        try:
                            await self.store.release(name, lease)
                        except StoreUnavailable as exc:
                            self._store_failed("release (retried)", exc)
                            break
                        self._unreleased.pop((name, lease), None)
                    if not self._unreleased:
                        return
        except Exception as exc:  # never out of a system task: it would end the edge
            logger.opt(exception=exc).error("retrying the limits store's releases failed")
        finally:
            self._unreleased.clear()
            self._retrier = None

    async def aclose(self) -> None:
        self._closed = True
        for task in (self._retrier, self._renewer):
            if task is not None:
                task.cancel()
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
    """One chat request's key and limits: admit (before the body is read), check the
    model (once it is parsed), renew the stream while the request lives, end once."""

    __slots__ = (
        "_admitted", "_checked", "_ended", "_lease", "_limiter", "_metrics",
        "headers", "key",
    )  # fmt: skip

    def __init__(self, limiter: Limiter | None, metrics: EdgeMetrics) -> None:
        self._limiter = limiter
        self._metrics = metrics
        self.key: Key | None = None
        self._lease = secrets.token_hex(8)
        self._checked = False
        self._admitted = False
        self._ended = False
        # The rate-limit headers the answer carries (a limited key's, once admitted).
        self.headers: dict[str, str] = {}

    async def admit(self) -> None:
        """Count the request against its key's limits, once; raises RateLimitedError
        over a limit. Needs only the key: called before the body is read."""
        if self._checked:
            return
        self._checked = True
        key = self.key
        limiter = self._limiter
        if key is None or limiter is None or not key.limited:
            return
        try:
            decision = await limiter.admit(key, self._lease)
        except RateLimitedError as exc:
            self.headers = exc.headers
            raise
        self._admitted = True
        if decision is not None:
            self.headers = rate_headers(key.limits, decision)
        if key.limits.max_streams is not None:
            self._metrics.key_streams.labels(key.name).inc()

    async def check_model(self, model: str) -> None:
        """Admit the request (if not yet) for `model`, its body parsed: a model the key
        may not use is answered like one that does not exist, and not counted."""
        key = self.key
        if key is None:
            return
        if not key.allows(model):
            self._metrics.key_rejections.labels(key.name, "model").inc()
            await self._refund()
            raise model_not_found(model)
        await self.admit()
        self._metrics.key_requests.labels(key.name).inc()

    async def _refund(self) -> None:
        """Take back the admission (the request and its stream), once."""
        key, limiter = self.key, self._limiter
        if not self._admitted or key is None or limiter is None:
            return
        self._admitted = False
        self.headers = {}
        if key.limits.max_streams is not None:
            self._metrics.key_streams.labels(key.name).dec()
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + _END_S
            await limiter.refund(key, self._lease)

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
