"""POST /v1/chat/completions, /v1/responses, /v1/messages: parse, start the answer,
render its output.

The three APIs are one path here: each parses its body into the one run
request and renders the one session's output its own way
(`edge.api.surfaces.Api`); the run, the session and every guarantee are
shared.

The handler parses, admits, starts and renders: the answer is the fleet's
(`edge.fleet.answer.Answer`: its runs, their nodes, slots, deadlines,
CancelRuns and outcomes, the attempts on other nodes and the moves after
output), the same for both kinds of answer. It lives in the request's scope
(`edge.http.scope.ChatScope`), which ends it when the request's HTTP cycle
ends, however it ends: the body finished, the client left (even before
quart began the body), or the connection was cut.

The status is committed at the first byte: the handler returns only once
the answer's first output (or first keep-alive comment) is ready. A run that
failed before it, after every retry, is a real status with an OpenAI error
body (`edge.errors.status_of` of its type; a node's refusal: the node's
status), never 200 and an error frame; a request no node slot was found for
in time is 503 `overloaded`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
import trio
from loguru import logger
from quart import Response

from edge.api.footprint import footprint
from edge.api.request import ChatRequest
from edge.api.responses_out import ResponsesRenderer
from edge.api.responses_state import Resolved
from edge.api.surfaces import CHAT, Api, ApiRequest, Folder, Heading, Streamer
from edge.api.tokencount import tokens_of
from edge.config import Config
from edge.contract.prefix import CHARS_PER_TOKEN
from edge.errors import NodeRateLimitedError, RequestError
from edge.fleet.admission import RETRY_AFTER_S
from edge.fleet.affinity import session_key
from edge.fleet.failover import Committed
from edge.fleet.fleet import Fleet
from edge.fleet.modelpolicy import forwarded_request, session_settings
from edge.fleet.run import OutcomeHook
from edge.fleet.tenants import Tenant
from edge.fleet.turns import Turns
from edge.http.gil import GilShare
from edge.http.live import Snapshots
from edge.http.scope import ChatScope
from edge.http.spans import RequestTrace
from edge.http.sse import SSE_HEADERS, SSEBody
from edge.http.stored import ResponseStates
from edge.limits.limiter import Gate, Key
from edge.node.wire import PreparedRunRequest, prepare_run_request
from edge.observe.logbound import clip_join
from edge.observe.metrics import EdgeMetrics
from edge.observe.tracing import Tracing
from edge.stream.output import ErrorOut
from edge.stream.session import StreamSession

SHUTDOWN_NOTICE = "the edge is shutting down; retry the request"
# Whom a request is counted for when nothing says (a caller without a client address).
ANONYMOUS = Tenant("")


def _trace(what: str, fields: Mapping[str, Any]) -> None:
    logger.bind(**fields).info("stream trace: {}", what)


# A request of at most this many bytes (its body and the stored items it refers to) is
# prepared on the loop, in its own turn: at worst ~1 ms of work (60 one-word messages),
# less than the GIL's switch interval (5 ms), so a parse thread would hold the loop as
# long; handed to a thread and back it took ~120 us more of its TTFT (p50 added
# 884 -> 762 us, 4 alternating runs).
INLINE_BYTES = 2048
# Requests parsed at once, each in a worker thread.
PARSE_THREADS = 4
# What a parse holds at its peak, per byte of body (measured: a 4 MB body of distinct
# one-character content parts peaks at ~90 MiB while parsed, ~63 MiB once parsed).
PARSE_PEAK_FACTOR = 24


class ChatService:
    """The chat completions endpoint's state: configuration, nodes, runs, metrics.

    Each request runs on the configuration it arrived under (its snapshot,
    `edge.http.live`): its model policies, keep-alive, failover and deadlines.
    """

    def __init__(
        self,
        snapshots: Snapshots,
        fleet: Fleet,
        metrics: EdgeMetrics,
        on_outcome: OutcomeHook | None = None,
        *,
        tracing: Tracing | None = None,
        responses: ResponseStates | None = None,
    ) -> None:
        self.snapshots = snapshots
        # The response store of /v1/responses (edge.http.stored); None: it keeps none.
        self.responses = responses
        # This edge's tracer (edge.observe.tracing); None: tracing is off.
        self.tracing = tracing
        # The fleet's parts this handler uses (`edge.fleet.fleet.Fleet`), built by the
        # daemon: the heavy steps of a request take turns (`edge.fleet.turns`).
        self.turns = fleet.turns
        self.pool = fleet.pool
        self.admission = fleet.admission
        self.runs = fleet.runs
        self.metrics = metrics
        self.on_outcome = on_outcome
        # Request parsing runs in worker threads (schema checks cost ms per KiB);
        # few at once, so the loop thread waits little for the GIL.
        self.parsing = trio.CapacityLimiter(PARSE_THREADS)
        # While a large one runs, the loop takes the GIL back sooner (edge.http.gil).
        self.gil = GilShare()

    async def handle(
        self,
        body: bytes,
        scope: ChatScope,
        *,
        session_id: str | None = None,
        gate: Gate | None = None,
        api: Api = CHAT,
        tenant: Tenant = ANONYMOUS,
    ) -> Response:
        """Answer one request of `api`; errors before the first byte raise an EdgeError.

        `session_id` is the caller's X-Session-Id (routing affinity; else `user`).
        `gate` is the request's API key: its allow-list is checked and its limits
        admit the request once the model is known, before any node is asked; it is
        ended with the run (stream given back, tokens counted) before the last byte.
        `tenant` is whom it is counted for in the admission queue (`tenant_of`).
        """
        self.admission.shed_if_full(tenant)
        await self.turns.turn()
        snapshot = self.snapshots.request()
        config = snapshot.config
        run_id = secrets.token_hex(12)
        owner = gate.key.name if gate is not None and gate.key is not None else ""
        # parse -> admit -> start -> render
        prepared = await self._parsed(body, scope, api, config, run_id, gate, owner)
        del body  # parsed: a request queued for a slot, or running, holds no body
        parsed = prepared.parsed
        request = parsed.chat
        scope.stream = request.stream
        if gate is not None:
            await gate.check_model(request.model)
            await gate.admit()
        scope.tier = tier = tenant.tier_for(request.service_tier)
        if request.model in self.pool.models():  # metric labels: only models nodes serve
            scope.model = request.model
        request, payload = prepared.forwarded()
        model = config.model(request.model)
        settings = session_settings(model, request, run_id, stream_holds_text=api.stream_holds_text)

        def new_session() -> StreamSession:  # one per attempt, all with the one run id
            return StreamSession(settings, _trace if settings.trace else None)

        failover = snapshot.failover
        plan = failover.plan(
            request, payload, request_id=scope.request_id, api=scope.api,
            keepalive_s=config.server.keepalive_s if request.stream else 0.0,
            metadata=scope.node_metadata,
            affinity_key=session_key(session_id or request.prompt_cache_key, request.user),
            tenant=tenant, tier=tier,
        )  # fmt: skip
        created = int(time.time())
        try:
            committed = await failover.start(scope.answer, plan, new_session)
        finally:
            scope.settled()  # an answer that failed before any byte is counted now
        prefix = payload.prefix
        prompt = 0 if prefix is None else tokens_of(prefix.chars, chars_per_token=CHARS_PER_TOKEN)
        heading = Heading(run_id, created, request.model, tier, prompt_tokens=prompt)
        reply = Reply(committed, scope, api, parsed, heading, gate, owner)
        return await (self._streamed(reply) if request.stream else self._whole(reply))

    async def _parsed(
        self,
        body: bytes,
        scope: ChatScope,
        api: Api,
        config: Config,
        run_id: str,
        gate: Gate | None,
        owner: str,
    ) -> Prepared:
        """`body` parsed, with the stored responses it refers to, its RunRequest
        serialized; what it holds is charged to the memory budget until the request's
        cycle ends.

        Everything that grows with the request (the parse, whose schema checks cost
        milliseconds per KiB, the forwarding policy's checks, the RunRequest's
        serialization) runs once, off the loop for a request over INLINE_BYTES: a
        large request never stalls other streams, and its attempts all send the same
        bytes. A parse in progress holds up to PARSE_PEAK_FACTOR times its body: that
        much comes out of the memory budget while it runs (503 overloaded when the
        budget has not that much left, before any work). The stored responses it
        refers to (`edge.http.stored`) are charged before, as they come to once each
        reference stands for its item (a 413 past the nodes' message limit), before
        the parse expands them.
        """
        budget = config.admission.memory_budget_bytes
        peaks = [self.admission.hold(min(PARSE_PEAK_FACTOR * len(body), budget))]
        try:
            resolved = None
            if api.stateful and self.responses is not None:
                resolved, expanded = await self.responses.resolve(api, body, owner, self.parsing)
                referred = max(resolved.nbytes, expanded)
                peaks.append(self.admission.hold(min(PARSE_PEAK_FACTOR * referred, budget)))
            # A key's cached prompt prefixes are its own unless it shares them.
            cache_scope = gate.key.cache_scope if gate is not None and gate.key is not None else ""
            large = len(body) + (resolved.nbytes if resolved is not None else 0)
            prepare = partial(
                self.prepare, api, body, run_id, scope.trace, config, resolved, cache_scope
            )
            prepared: Prepared
            if large <= INLINE_BYTES:
                prepared = prepare()
            else:
                with self.gil.large(large):
                    prepared = await trio.to_thread.run_sync(prepare, limiter=self.parsing)
        finally:
            for peak in peaks:
                peak()
        scope.answer.at_end(self.admission.hold(prepared.nbytes))
        return prepared

    async def _whole(self, reply: Reply) -> Response:
        """The non-streaming answer: the run's output folded into one body (saved in
        the response store when the request asks)."""
        scope, parsed, owner = reply.scope, reply.parsed, reply.owner
        trace = scope.trace
        folder = reply.api.folder(parsed, reply.heading)
        if trace is not None and trace.capture:
            folder = trace.capturing_folder(folder)
        save = None
        if self.responses is not None and parsed.store_context is not None:
            save = partial(self.responses.save, owner, parsed.store_context)
        return await _complete(reply, folder, self.turns, save=save)

    async def _streamed(self, reply: Reply) -> Response:
        """The streamed answer: SSE frames as the run's batches come (the first ones
        already taken), or the error that came before any byte as a real status."""
        committed, scope, api, parsed, gate = (
            reply.committed,
            reply.scope,
            reply.api,
            reply.parsed,
            reply.gate,
        )
        answer = committed.answer
        if committed.error is not None:
            await answer.end()
            scope.settled()
            if gate is not None:
                await gate.end(answer.outcome)
            return _error_answer(api, committed.error, scope.request_id)
        encoder = api.streamer(parsed, reply.heading)
        on_end = None
        if self.responses is not None and parsed.store_context is not None:
            on_end = partial(
                _save_streamed, self.responses, reply.owner, parsed.store_context, encoder
            )
        trace = scope.trace
        if trace is not None and trace.capture:
            encoder = trace.capturing_streamer(encoder)
        assert answer.leg is not None
        labels = self.metrics.inter_chunk.labels(reply.heading.model, answer.leg.info.node)
        sse = SSEBody(answer, encoder, self.turns, observe_gap=labels.observe,
                      observe_added=self.metrics.added_latency.observe,
                      first=committed.first, keepalive=committed.keepalive,
                      gate=gate, on_end=on_end, settled=scope.settled)  # fmt: skip
        response = Response(sse, status=200, headers=SSE_HEADERS)
        response.headers["X-Request-Id"] = scope.request_id
        return response

    def prepare(
        self,
        api: Api,
        body: bytes,
        run_id: str,
        trace: RequestTrace | None,
        config: Config,
        resolved: Resolved | None = None,
        cache_scope: str = "",
    ) -> Prepared:
        """In a worker thread (on the loop for a request of at most INLINE_BYTES):
        `body` parsed (with the stored responses it refers to), as forwarded (by
        `config`'s policy of its model), its RunRequest serialized. A refusal of the
        forwarding policy is kept for the caller to raise after the API key's checks
        (its 403 or 429 comes first, then the policy's)."""
        parsed = api.parse(body, resolved)
        nbytes = footprint(parsed)
        request = parsed.chat
        if parsed.dropped:
            logger.bind(model=request.model, api=api.name).info(
                "not used (the edge cannot run them): {}", clip_join(parsed.dropped)
            )
        if trace is not None:
            trace.request(request)
        try:
            forwarded = forwarded_request(config.model(request.model), request)
        except RequestError as exc:
            return Prepared(parsed, nbytes, refused=exc)
        # For nodes whose runs the edge relays itself, the RunRequest's message is kept
        # with its bytes, and counts too.
        payload = prepare_run_request(
            forwarded, run_id=run_id, model=forwarded.model, keep_message=config.relays_runs,
            cache_scope=cache_scope,
        )  # fmt: skip
        nbytes += len(payload)
        if payload.message is not None:
            nbytes += footprint(payload.message)
        return Prepared(parsed, nbytes, forwarded, payload)

    def shutdown_streams(self) -> int:
        """Drain deadline: end every run still in flight, with a notice. Returns how many."""
        return self.runs.shut_down(SHUTDOWN_NOTICE)


def tenant_of(key: Key | None, address: str | None) -> Tenant:
    """Whom a request is counted for in the admission queue: its API key (its weight
    and service tiers), else (no keys configured) its client's address."""
    if key is None:
        return Tenant(address) if address else ANONYMOUS
    return Tenant(key.name, key.weight, key.service_tiers, key.service_tier, named=key.named)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request made ready off the loop (`ChatService.prepare`)."""

    parsed: ApiRequest
    # The bytes it holds while queued and running: its parsed form (`edge.api.footprint`)
    # and its RunRequest (its body is let go once parsed), for the memory budget.
    nbytes: int
    # As forwarded to the node, and its RunRequest; None: the policy refused it.
    request: ChatRequest | None = None
    payload: PreparedRunRequest | None = None
    refused: RequestError | None = None

    def forwarded(self) -> tuple[ChatRequest, PreparedRunRequest]:
        """The request as forwarded and its RunRequest, or the policy's refusal raised."""
        if self.refused is not None:
            raise self.refused
        assert self.request is not None
        assert self.payload is not None
        return self.request, self.payload


@dataclass(frozen=True, slots=True)
class Reply:
    """What rendering an answer needs: the committed answer, the request's scope, its API
    and parsed form, what the answer is about, its key's gate and its owner (the key whose
    stored responses it may save)."""

    committed: Committed
    scope: ChatScope
    api: Api
    parsed: ApiRequest
    heading: Heading
    gate: Gate | None
    owner: str


def _error_answer(api: Api, error: ErrorOut, request_id: str) -> Response:
    """A run's error as the whole answer: its status and the API's error object (a
    node's refusal: the node's status and words; every node overloaded: 429 with
    Retry-After)."""
    status, body = api.run_error(error)
    response = Response(msgspec.json.encode(body), status=status, content_type="application/json")
    response.headers["X-Request-Id"] = request_id
    if status == NodeRateLimitedError.status:
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


async def _save_streamed(
    store: ResponseStates, owner: str, context: bytes, encoder: Streamer
) -> None:
    """A streamed Response, saved once its stream ended (edge.http.stored)."""
    if isinstance(encoder, ResponsesRenderer):
        await store.save(owner, context, encoder.response())


async def _complete(
    reply: Reply,
    builder: Folder,
    turns: Turns,
    *,
    save: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
) -> Response:
    """The non-streaming answer: the run's whole output folded into one JSON body.

    The run is left before the answer goes out, so its outcome is counted first
    (and its key's stream given back, its tokens counted); a stored response is
    saved (`save`) before it goes too, so the next request may refer to it.
    """
    committed, scope, gate = reply.committed, reply.scope, reply.gate
    answer = committed.answer
    builder.add(committed.first)
    session = answer.session
    request_id = scope.request_id
    try:
        while not session.terminated:
            batch = await answer.next_batch()
            if batch != "keepalive":
                builder.add(batch)
        builder.add(session.drain())
        await turns.turn()
    finally:
        await answer.end()
        scope.settled()
        if gate is not None:
            await gate.end(answer.outcome)
    if builder.error is not None:
        return _error_answer(reply.api, builder.error, request_id)
    body = builder.body()
    if save is not None:
        await save(body)
    response = Response(msgspec.json.encode(body), status=200, content_type="application/json")
    response.headers["X-Request-Id"] = request_id
    return response
