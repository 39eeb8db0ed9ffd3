"""`iop-node`'s NodeService: runs served by an OpenAI-compatible upstream.

A grpclib server on asyncio. Each Run is one streaming POST to the
upstream's `/chat/completions`, relayed by `edge.nodes.upstream.relay` in a
task of its own; CancelRun, a reset gRPC stream or the server stopping
cancel its scope (`UpstreamNode.play`), which closes the upstream request.
Describe lists the upstream's `/models` (or the configured models, with
the context length vLLM and SGLang give there) and fails UNAVAILABLE while
the upstream cannot be reached. It also says the upstream's load, read from
its `/metrics` every `load_interval_s` (`edge.nodes.upstream.loadpoll`) from
the first Describe on:
`waiting_runs` and the KV cache are the upstream's; `active_runs` is the
upstream's running requests, or, when more, this node's own runs less those
the upstream says wait (its own runs are at least that many, whatever a
scrape a second old says). A load the upstream does not say leaves those
fields unset and `active_runs` this node's own runs.

With KV events (`kv`: the server's publisher, `edge.nodes.upstream.kvfeed`), the
node's index of the server's prefix cache by the edge's prefix blocks is its
`block_log`: each Watch report carries the blocks stored and evicted (the edge's
index for it is exact); each run's prompt is registered before it is sent, and a
server that refuses the connection resets the index (it may be restarting; a slow
answer does not). Without, the reports carry no blocks (the edge's index for it is
approximate).

The runs log is the simulated node's (`edge.nodes.runslog.RunsLog`). With tracing
on (`edge.observe.tracing`), each run has a span continued from the edge's
`traceparent`, and its upstream request a child span whose `traceparent`
the upstream gets as a header.

This module owns the gRPC side and the upstream's model list; the run's HTTP
side is the relay's, the mappings are pure modules of their own (`request`,
`chunks`, `bodies`). It knows nothing of trio or of the edge that calls it.
"""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import httpx
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from loguru import logger
from opentelemetry.trace import Span

from edge.contract._proto.iop.node import v1 as pb
from edge.forwarding import ForwardPolicy
from edge.nodes.kit import NodeService
from edge.nodes.runslog import RunRecord
from edge.nodes.upstream.bodies import context_limits_from_body, error_message
from edge.nodes.upstream.bodies import models_from_body as parse_models
from edge.nodes.upstream.continuation import AUTO, MODES, NONE, is_llamacpp, mode_for
from edge.nodes.upstream.kvfeed import KVFeed, KVSettings
from edge.nodes.upstream.load import SOURCES
from edge.nodes.upstream.loadpoll import LoadPoll, metrics_url
from edge.nodes.upstream.probe import probe_continuation
from edge.nodes.upstream.relay import CONNECT_TIMEOUT_S, TERMINAL, Relay, exc_reason
from edge.observe.tracing import Tracing

MODELS_TTL_S = 2.0
# Under the edge's 2 s Describe timeout, so the edge hears our UNAVAILABLE.
DESCRIBE_TIMEOUT_S = 1.5
# On shutdown, how long runs get to close their upstream requests.
CLOSE_TIMEOUT_S = 2.0


def normalize_upstream(url: str) -> str:
    """The upstream's API base: `http(s)://host[:port]/path`, `/v1` when no path is given."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
    base = url.strip().rstrip("/")
    return base if parts.path.strip("/") else base + "/v1"


class UpstreamNode(NodeService):
    """The NodeService of a node whose model server speaks OpenAI's chat completions.

    Args:
        upstream: the API base URL, e.g. `http://127.0.0.1:8000/v1`.
        name: the node name Describe reports.
        api_key: sent as `Authorization: Bearer ...` when set.
        models: the models to list; empty = the upstream's `/models`.
        runs_log: append one JSON line per run.
        read_timeout_s: the longest silence tolerated from the upstream.
        logprobs: whether Describe says the models give token logprobs
            (False for an upstream that cannot: the edge then refuses such
            requests with a 400 instead of answering without them).
        load_source: how the upstream's `/metrics` is read: `auto` (by its
            metric prefix), `vllm`, `sglang`, `llamacpp`, or `none` (not read).
        load_interval_s: seconds between reads of `/metrics` (0: not read).
        continuation: how the upstream continues an answer (RunRequest.continuation):
            `auto` (by what the upstream is), `vllm`, `llamacpp` or `none`
            (`edge.nodes.upstream.continuation`); Describe says `continuation`
            for a model unless it comes to `none`.
        policy: the forwarding policy each run's body must pass before it is sent
            (`edge.nodes.upstream.admit`; `iop-node` always has one); None: runs are
            sent as they come (inside the edge, which applied its own).
        kv: where the server publishes its KV events (`edge.nodes.upstream.kvfeed`);
            None: the node reports no KV blocks.
    """

    def __init__(
        self,
        upstream: str,
        *,
        name: str = "iop-node",
        api_key: str | None = None,
        models: tuple[str, ...] = (),
        runs_log: Path | None = None,
        read_timeout_s: float = 600.0,
        logprobs: bool = True,
        tracing: Tracing | None = None,
        load_source: str = "auto",
        load_interval_s: float = 1.0,
        continuation: str = "auto",
        policy: ForwardPolicy | None = None,
        kv: KVSettings | None = None,
    ) -> None:
        if continuation not in MODES:
            raise ValueError(f"continuation {continuation!r} is not one of {', '.join(MODES)}")
        if load_source not in SOURCES:
            raise ValueError(f"load source {load_source!r} is not one of {', '.join(SOURCES)}")
        if load_interval_s < 0:
            raise ValueError(f"load interval must be 0 (off) or more, not {load_interval_s}")
        super().__init__(name, runs_log, tracing=tracing)
        self._logprobs = logprobs
        self._continuation = continuation
        self.upstream = normalize_upstream(upstream)
        self._models_url = self.upstream + "/models"
        self._configured = models
        self._read_timeout_s = read_timeout_s
        # The models and the load; the runs have the relay's connections.
        self._client = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            timeout=httpx.Timeout(CONNECT_TIMEOUT_S, pool=None),
        )
        self.kv: KVFeed | None = None
        if kv is not None:
            self.kv = KVFeed(
                kv, upstream=self.upstream, client=self._client,
                on_change=self.state_changed, name=name,
            )  # fmt: skip
            self.block_log = self.kv.map.log
        self.relay = Relay(
            self.upstream, name=name, continuation_mode=self.continuation_mode,
            llamacpp=self.is_llamacpp, spans=self.spans, api_key=api_key,
            read_timeout_s=read_timeout_s, policy=policy,
            prepare=self.kv.prompt if self.kv is not None else None,
        )  # fmt: skip
        self._models: list[tuple[str, str]] = []
        # Each model's context length, where the upstream's /models says it.
        self._context: dict[str, int] = {}
        self._models_at = -MODELS_TTL_S
        self._models_lock = asyncio.Lock()
        # `auto` on llama.cpp: whether the probe showed the server continues (True), or
        # starts over (False); None: not asked yet, or it could not say (asked again).
        self._continues: bool | None = None
        self._probe: asyncio.Task[None] | None = None
        # The runs' relay tasks (strong references until done), each with its stop.
        self._work: dict[asyncio.Task[None], anyio.CancelScope] = {}
        self.load_poll: LoadPoll | None = None
        if load_source != "none" and load_interval_s > 0:
            self.load_poll = LoadPoll(
                self._client,
                metrics_url(self.upstream),
                source=load_source,
                interval_s=load_interval_s,
                on_change=self.state_changed,
                name=name,
            )

    # --- Describe ---------------------------------------------------------------

    async def describe(self, message: pb.DescribeRequest) -> pb.DescribeResponse:
        """The models, and the load: read from the first Describe (or Watch) on, so a
        node nobody asks asks its upstream nothing; until the first read, unset."""
        if self.load_poll is not None:
            self.load_poll.start()
        if self.kv is not None:
            self.kv.start()
        models = await self.models()
        described = pb.DescribeResponse(
            node_name=self.name,
            instance_id=self.instance_id,
            models=[
                pb.ModelInfo(
                    id=m,
                    owned_by=owner,
                    logprobs=self._logprobs,
                    max_context_tokens=self._context.get(m),
                    continuation=self.continuation_mode(m) != NONE,
                )
                for m, owner in models
            ],
            active_runs=self.active_runs,
        )
        load = self.load_poll.load if self.load_poll is not None else None
        if load is not None:
            own_running = max(0, self.active_runs - (load.waiting or 0))
            described.active_runs = max(load.running or 0, own_running)
            described.waiting_runs = load.waiting
            described.kv_cache_tokens = load.kv_cache_tokens
            described.kv_cache_used_tokens = load.kv_cache_used_tokens
        return described

    def continuation_mode(self, model: str) -> str:
        """How `model`'s answers are continued (`edge.nodes.upstream.continuation`): the
        setting, or with `auto` what the upstream's load (its dialect) and its model list
        (the model's owner) say of it, as read last."""
        dialect, owner = self._kind(model)
        return mode_for(self._continuation, dialect, owner, probed=self._continues is True)

    @property
    def continues(self) -> bool | None:
        """With `auto` on llama.cpp, what the probe found: True (the server continues
        answers), False (it starts them over), None (not asked yet, or no answer)."""
        return self._continues

    def is_llamacpp(self, model: str) -> bool:
        """Whether `model` is served by llama.cpp's server (its load dialect, or the
        model's owner), as read last."""
        return is_llamacpp(*self._kind(model))

    def _kind(self, model: str) -> tuple[str | None, str]:
        """What the upstream is, as read last: its load dialect (None: not read, or
        none) and `model`'s owner in its model list ("" when it says none)."""
        load = self.load_poll.load if self.load_poll is not None else None
        owner = next((o for m, o in self._models if m == model), "")
        return (load.dialect if load is not None else None), owner

    def _ask_continuation(self) -> None:
        """With `auto`, probe a llama.cpp upstream once (in the background) for whether it
        continues answers: until it says so, its models say no `continuation`."""
        if self._continuation != AUTO or self._continues is not None or self._probe is not None:
            return
        model = next((m for m, _ in self._models if self.is_llamacpp(m)), None)
        if model is not None:
            self._probe = asyncio.create_task(self._probe_continuation(model))

    async def _probe_continuation(self, model: str) -> None:
        url = self.upstream + "/chat/completions"
        try:
            self._continues = await probe_continuation(self._client, url, model)
        except (httpx.HTTPError, ValueError) as exc:
            logger.info("{}: cannot tell yet whether {} continues answers: {}",
                        self.name, url, exc_reason(exc))  # fmt: skip
            self._probe = None  # asked again with the next model list
            return
        if self._continues:
            logger.info("{}: {} continues answers (llama.cpp): runs continue there", self.name, url)
            self.state_changed()
        else:
            logger.warning(
                "{}: {} starts a continued answer over (llama.cpp): it continues none",
                self.name, url,
            )  # fmt: skip

    async def models(self) -> list[tuple[str, str]]:
        """(id, owned_by) per model; GRPCError UNAVAILABLE while the upstream is not healthy."""
        async with self._models_lock:
            loop = asyncio.get_running_loop()
            if loop.time() - self._models_at < MODELS_TTL_S:
                return self._models
            self._models = await self._fetch_models()
            self._models_at = loop.time()
            self._ask_continuation()
            return self._models

    async def _fetch_models(self) -> list[tuple[str, str]]:
        url = self._models_url
        try:
            response = await self._client.get(url, timeout=DESCRIBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            if self.kv is not None and isinstance(exc, httpx.ConnectError):
                self.kv.reset(f"the server cannot be reached ({exc_reason(exc)}): it may restart")
            raise GRPCError(
                Status.UNAVAILABLE, f"upstream {url} is unreachable: {exc_reason(exc)}"
            ) from None
        configured = [(m, "") for m in self._configured]
        if response.status_code == 200:
            self._context = context_limits_from_body(response.content)
        # With configured models any answer short of a server error means "up".
        if configured and response.status_code < 500:
            return configured
        if response.status_code >= 400:
            detail = error_message(response.status_code, response.content, response.reason_phrase)
            raise GRPCError(Status.UNAVAILABLE, f"{url}: {detail}")
        try:
            return parse_models(response.content)
        except ValueError as exc:
            raise GRPCError(Status.UNAVAILABLE, f"{url}: not a model list: {exc}") from None

    # --- Run --------------------------------------------------------------------

    async def play(self, run: RunRecord, request: pb.RunRequest, span: Span | None) -> str:
        """One run. The upstream request runs in a task of its own, inside a cancel scope
        that is the only way it is stopped (`run.stop`: CancelRun, the caller's stream
        reset, the node stopping; once or many times).

        Not `Task.cancel()`: httpcore closes an abandoned request's connection in a
        shielded scope, and on asyncio a shield keeps out a cancel scope's cancellation
        but not a task's. A run whose relay was unwinding (its caller's stream reset
        under a send) when CancelRun cancelled its task left the close half done, the
        connection in the pool, unread, and the model server generating to the end.
        The outcome is the terminal event's; stopped before one, "cancelled".
        """

        async def emit(event: pb.RunEvent) -> None:
            await run.send(event)
            if event.type in TERMINAL:
                run.outcome = "complete" if event.type == "complete" else event.type

        scope = anyio.CancelScope()

        async def relay() -> None:
            with scope:
                await self.relay.run(request, emit, span)

        work = run.task = asyncio.create_task(relay())
        run.stop = scope.cancel
        self._work[work] = scope
        work.add_done_callback(self._forget)
        try:
            await asyncio.wait({work})
        except asyncio.CancelledError:  # the caller reset the stream, or the server stops
            scope.cancel()
            work.add_done_callback(partial(_unheard, run.run_id))
            raise
        work.result()  # an unexpected error: grpclib logs it and fails the stream
        if run.outcome is None and scope.cancelled_caught:
            return "cancelled"
        return run.outcome or "error"

    def _forget(self, work: asyncio.Task[None]) -> None:
        self._work.pop(work, None)

    async def aclose(self) -> None:
        """Stop reading the load and the runs still working (their upstream requests
        close), then the client."""
        if self._probe is not None:
            self._probe.cancel()
        if self.load_poll is not None:
            await self.load_poll.aclose()
        if self.kv is not None:
            await self.kv.aclose()
        for scope in self._work.values():
            scope.cancel()
        if self._work:
            await asyncio.wait(set(self._work), timeout=CLOSE_TIMEOUT_S)
        await self.relay.aclose()
        await self._client.aclose()
        await super().aclose()


def _unheard(run_id: str, work: asyncio.Task[None]) -> None:
    """The end of a relay whose caller had gone: an error there (a send to the reset
    stream, most often) is expected, and nobody is left to hear it but the debug log."""
    if not work.cancelled() and (exc := work.exception()) is not None:
        logger.debug("run {} ended after its caller left: {!r}", run_id, exc)
