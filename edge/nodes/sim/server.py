"""The simulated node: a real grpclib server implementing the node contract.

It runs on asyncio, standalone (`iop-sim-node`) or on the asyncio loop the
edge hosts (a node whose address is "embedded"). Models:

- `sim-echo`: streams the last user message back word by word. Asked for
  logprobs (`"logprobs": true` in the request's extra fields), each word's
  delta carries one token, the word, with logprob -0.1, and `top_logprobs`
  N alternatives: the word itself first, then `word~1`, `word~2`, ... at
  -2.1, -4.1, ... (plausible, deterministic values for testing clients).
- `sim-script`: plays a script, `{"events": [...]}`, item by item, or one turn
  of `{"turns": [{"events": [...]}, ...]}` (`edge.nodes.sim.script` says where the
  script may sit in the conversation and which turn plays). An item is:
  a RunEvent as JSON, `{"sleep_ms": N}`, `{"type": "hang"}` (wait until
  cancelled), or `{"type": "abort"}` (break the stream, no terminal event).
  A first item `{"accept_after_ms": N}` holds the run's acceptance (the
  response headers) back N ms.
  An item with `"on_node": NAME` is played only by the node named NAME
  (`--name`); other nodes skip it (one script, nodes that differ: failover).
  A delta item may carry `"repeat": N` to send the same delta N times (the
  benchmarks' fast path), and `"delta_times": K` to make its text K copies of
  `delta` (large events from a small script: a 64 KiB delta, or a message
  over the gRPC size limit, which this node sends as a broken node would).
  `{"type": "request"}` sends one delta holding the RunRequest this node
  received, as protobuf JSON (what the edge forwarded).
  A complete item's `"tool_calls"` (a list of `{"id", "name", "arguments"}`,
  or OpenAI's `{"id", "function": {"name", "arguments"}}`; object arguments
  are sent as JSON) go out in the typed `tool_calls` field; its
  `"metadata": {"tool_calls": ...}` is sent as metadata, as a node older than
  the typed field would.
  A delta item's `"logprobs"` is a list of tokens in OpenAI's shape,
  `{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}` (`bytes` a list of byte values, or null/absent for the
  token's UTF-8), sent in the delta's typed `logprobs`.
  Every number and shape of a script is checked before it plays
  (`edge.nodes.sim.script.check_item`, and its bounds: sleeps, repeats, delta
  sizes, what one turn sends): a script past one is answered with an error
  event naming it, never an exception in the node's loop. That error, as every
  script the node cannot find, parse or play, is a refusal (`script_refusal`:
  `http_status` 400, code `invalid_script`, the node's words): the request's
  fault, so the edge answers 400 and neither tries another node nor counts it
  on this node's breaker.
  The steps a run plays are built by `edge.nodes.sim.play` (pure); this
  module plays them.

Continuation: Describe says both models continue answers (`continuation`,
off with `continuation=False`, `--no-continuation`). A RunRequest with a
`continuation` plays the same answer as the same request without it, less
what the continuation holds (`edge.nodes.sim.play` says how; a continuation
that is not the answer's start is an error event), accepted at once (no
`accept_after_ms`). Its `complete` says the usage of the whole answer, as
the run it continues would have (the script's, or the echo's words); with
the cache model its prompt is the request's plus the continuation's text
(uncached: its prefill time, and `input_tokens`, count it).

Describe says both models give logprobs, and the node's load: `active_runs`
(runs playing), `waiting_runs` (runs queued) and `max_runs`. With
`max_runs` N (0: no cap, the default), at most N runs play at once; the
others wait in the node's queue (`Places`), first come first served, not yet
accepted: a CancelRun or a reset stream takes a waiting run out of the queue,
and a run that ends hands its place to the first one waiting.
With `watch=False` (`--no-watch`) the node has no Watch route: it answers
Watch UNIMPLEMENTED, as a node older than that RPC (the edge polls its
Describe).

The KV cache model (`kv`, `edge.nodes.sim.kvcache`; off by default): with a
capacity, a run (once it holds its place) finds its prompt's cached blocks,
stores its blocks (computed once its prefill ends; a run that finds blocks
another run is still computing waits for them), waits its prefill time
(`prefill_us_per_token` per uncached prompt token), then plays; its
`complete` event's usage says its prompt tokens and the cached ones
(`input_tokens`, `cached_input_tokens`) unless a script gives its own usage.
From its prefill's start to its end, however it ends (complete, error,
cancelled, aborted, its caller gone), the run holds its blocks (the cache's
`Lease`: its prompt's blocks pinned, and a block of its own for each
BLOCK_TOKENS tokens past them, its answer's deltas counted as they are sent),
released once in `play`'s `finally`.
Describe reports the capacity and use (`kv_cache_tokens`,
`kv_cache_used_tokens`: the blocks the runs in flight hold), and Watch the
blocks stored and evicted (the cache's `BlockLog`; none with
`kv_reports=False`, `--no-kv-reports`).
`decode_tokens_per_s` paces deltas, cache
model or not: a delta of N characters is max(1, N // 4) tokens, sent once
they are decoded.

The runs log (`edge.nodes.runslog.RunsLog`) gets one JSON line per run when it
ends; outcomes here are complete | error | cancelled | aborted | ended.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from grpclib.const import Handler, Status
from grpclib.exceptions import GRPCError
from opentelemetry.trace import Span

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.codec import Encoded
from edge.contract.prefix import BLOCK_TOKENS
from edge.contract.routes import WATCH_ROUTE
from edge.nodes.kit import NodeService
from edge.nodes.runslog import Events, RunRecord
from edge.nodes.sim.continuation import Cut
from edge.nodes.sim.kvcache import KVCache, KVSettings, Lease, delta_tokens, prompt
from edge.nodes.sim.play import Abort, End, Hang, Send, Sleep, Step, echo_steps, script_steps
from edge.nodes.sim.script import ScriptError, script_items
from edge.observe.tracing import Tracing

MODELS = ("sim-echo", "sim-script")
# A repeated event yields to the loop every this many messages.
YIELD_EVERY = 8


# The code of a script the node cannot play, on its refusal (the message says why).
INVALID_SCRIPT = "invalid_script"


def script_refusal(exc: ScriptError) -> pb.RunEvent:
    """A script the node cannot play (not found, not parseable, past a bound, past its
    last turn) is the request's fault: a refusal, 400 with the node's words, which the
    edge neither tries on another node nor counts on the node's breaker."""
    return pb.RunEvent(type="error", error=INVALID_SCRIPT, message=str(exc), http_status=400)


def _node_items(request: pb.RunRequest, node: str) -> list[dict[str, Any]]:
    """The script's items this node plays: those with no `on_node`, or its own name."""
    return [
        {k: v for k, v in item.items() if k != "on_node"}
        for item in script_items(request)
        if item.get("on_node", node) == node
    ]


def _accept_delay_s(request: pb.RunRequest, node: str) -> float:
    """A sim-script that starts with {"accept_after_ms": N} is accepted N ms late (a run
    that continues another is accepted at once: the answer was accepted before)."""
    if request.model != "sim-script" or request.continuation is not None:
        return 0.0
    try:
        items = _node_items(request, node)
    except ScriptError:
        return 0.0
    if items and "accept_after_ms" in items[0]:
        return float(items[0]["accept_after_ms"]) / 1000
    return 0.0


class Places:
    """At most `cap` runs play at once (0: no cap); the others wait, first come first served.

    A waiting run is a future in `_queue`; a run that leaves hands its place
    straight to the first one still waiting (so a newcomer never overtakes
    the queue). A waiting run that is stopped leaves its future behind,
    cancelled, and is skipped; the queue is rebuilt once such leftovers
    outnumber the runs still waiting, so a stream of stopped runs costs
    constant time each and the queue holds at most twice the runs waiting.
    """

    def __init__(self, cap: int = 0) -> None:
        if cap < 0:
            raise ValueError(f"max_runs must be 0 (no cap) or more, not {cap}")
        self.cap = cap
        self.playing = 0
        self.waiting = 0
        self._queue: deque[asyncio.Future[None]] = deque()

    async def take(self, on_wait: Callable[[], None]) -> None:
        """Return once the caller has a place (calling `on_wait` if it has to wait first).

        Cancelled while waiting: it leaves the queue (or, handed a place at that
        very moment, passes it on) and the CancelledError goes on.
        """
        if self.waiting == 0 and (self.cap == 0 or self.playing < self.cap):
            self.playing += 1
            return
        place = asyncio.get_running_loop().create_future()
        self._queue.append(place)
        self.waiting += 1
        on_wait()
        try:
            await place
        except asyncio.CancelledError:
            if place.done() and not place.cancelled():
                self.give_back()  # handed a place as it was stopped: the next one has it
            else:
                place.cancel()
                self.waiting -= 1
                if len(self._queue) > 2 * self.waiting + 16:
                    self._queue = deque(p for p in self._queue if not p.done())
            raise

    def give_back(self) -> None:
        """A playing run left: its place goes to the first run waiting, or is free."""
        while self._queue:
            place = self._queue.popleft()
            if not place.done():
                self.waiting -= 1
                place.set_result(None)
                return
        self.playing -= 1


class Pace:
    """One run's decode pace: at most `tokens_per_s` tokens of deltas a second (0: no
    pace). A delta waits until its tokens are decoded, counted from the later of the
    previous delta's time and now (a reader that stalls the run earns no burst)."""

    __slots__ = ("_due", "tokens_per_s")

    def __init__(self, tokens_per_s: float) -> None:
        self.tokens_per_s = tokens_per_s
        self._due = 0.0

    async def wait(self, text: str) -> None:
        """Wait for a delta of `text` (`delta_tokens` of it) to be due."""
        if not self.tokens_per_s:
            return
        now = asyncio.get_running_loop().time()
        tokens = delta_tokens(text)
        self._due = max(self._due, now) + tokens / self.tokens_per_s
        await asyncio.sleep(self._due - now)


_PACED = frozenset({"delta", "reasoning_delta"})


class SimNode(NodeService):
    """The NodeService of the simulated node.

    `max_runs`: at most this many runs play at once (0: no cap); the others
    wait in `hold`, before they are accepted. `kv`: the KV cache model and
    the run's timing (the module says what they do). `continuation`: whether
    the models continue answers (Describe says so; without it, a run that
    continues one answers an error event). `kv_reports` False: Watch reports
    carry no KV block events (the cache model still runs and its capacity and
    use are reported), as a node whose model server publishes none: the edge
    keeps an approximate index of it.
    """

    def __init__(
        self,
        name: str = "iop-sim-node",
        runs_log: Path | None = None,
        *,
        tracing: Tracing | None = None,
        max_runs: int = 0,
        watch: bool = True,
        kv: KVSettings | None = None,
        continuation: bool = True,
        kv_reports: bool = True,
    ) -> None:
        super().__init__(name, runs_log, tracing=tracing)
        self.serves_watch = watch
        # Whether Describe says the models continue answers (RunRequest.continuation).
        self.continuation = continuation
        self.places = Places(max_runs)
        self.kv = kv or KVSettings()
        # The cache (None: the model is off), whose block log Watch reports from.
        self.cache = KVCache(self.kv.kv_tokens // BLOCK_TOKENS) if self.kv.kv_tokens else None
        # The blocks each run past its prefill's start holds in the cache, by the run's
        # id(), until it ends.
        self._leases: dict[int, Lease] = {}
        if self.cache is not None and kv_reports:
            self.block_log = self.cache.log
        # The handler tasks of the runs holding a place (given back when they end).
        self._placed: set[asyncio.Task[Any]] = set()

    @property
    def active_runs(self) -> int:
        """The runs playing (holding a place); those waiting are `places.waiting`."""
        return self.places.playing

    def __mapping__(self) -> dict[str, Handler]:
        mapping = super().__mapping__()
        if not self.serves_watch:
            del mapping[WATCH_ROUTE]
        return mapping

    # --- RPCs -------------------------------------------------------------------

    @staticmethod
    def _kv_used(cache: KVCache) -> int:
        """The KV cache in use, as vLLM counts it: the blocks of the runs in flight, not
        those kept only for reuse (a model server evicts them as it needs room)."""
        return min(cache.in_use, cache.capacity) * BLOCK_TOKENS

    async def describe(self, message: pb.DescribeRequest) -> pb.DescribeResponse:
        cache = self.cache
        return pb.DescribeResponse(
            node_name=self.name,
            instance_id=self.instance_id,
            models=[
                pb.ModelInfo(
                    id=m, owned_by="iop-sim", logprobs=True, continuation=self.continuation
                )
                for m in MODELS
            ],
            active_runs=self.places.playing,
            max_runs=self.places.cap,
            waiting_runs=self.places.waiting,
            kv_cache_tokens=None if cache is None else cache.capacity * BLOCK_TOKENS,
            kv_cache_used_tokens=None if cache is None else self._kv_used(cache),
        )

    async def serve_run(self, stream: Events) -> None:
        """The kit's run, whose place (taken in `hold`) is given back however it ends."""
        task = asyncio.current_task()
        try:
            await super().serve_run(stream)
        finally:
            if task in self._placed:
                self._placed.discard(task)
                self.places.give_back()
                self.state_changed()

    async def hold(self, request: pb.RunRequest) -> None:
        """Wait for a place (the queue), then for the script's `accept_after_ms`."""
        task = asyncio.current_task()
        assert task is not None
        try:
            await self.places.take(self.state_changed)
        except asyncio.CancelledError:
            self.state_changed()  # it left the queue
            raise
        self._placed.add(task)
        self.state_changed()
        delay_s = _accept_delay_s(request, self.name)
        if delay_s:
            await asyncio.sleep(delay_s)

    async def play(self, run: RunRecord, request: pb.RunRequest, span: Span | None) -> str:
        """The model's events (after the prefill, with the cache model); a script past a
        bound ends in an error event naming it. A continuation (`RunRequest.continuation`)
        plays the same answer less what it holds (`edge.nodes.sim.play`)."""
        cut = Cut.of(request)
        if cut is not None and not self.continuation:
            error = "this node does not continue answers (--no-continuation)"
            await run.send(pb.RunEvent(type="error", error=error))
            return "error"
        try:
            if request.model == "sim-echo":
                usage = await self._prefill(run, request)
                steps = echo_steps(request, usage=usage, cut=cut)
                return await self._play(run, steps, self._leases.get(id(run)))
            if request.model == "sim-script":
                items = _node_items(request, self.name)  # a bad script fails before prefill
                usage = await self._prefill(run, request)
                steps = script_steps(items, request, usage=usage, cut=cut)
                return await self._play(run, steps, self._leases.get(id(run)))
        except ScriptError as exc:
            await run.send(script_refusal(exc))
            return "error"
        finally:
            # However the run ends (its outcome, an exception, a cancellation), its blocks
            # are freed here, once.
            lease = self._leases.pop(id(run), None)
            if lease is not None and self.cache is not None:
                self.cache.end(lease)
                self.state_changed()
        error = f"model {request.model!r} is not served here"
        await run.send(pb.RunEvent(type="error", error=error))
        return "error"

    async def _prefill(self, run: RunRecord, request: pb.RunRequest) -> pb.Usage | None:
        """With the cache model: match the prompt's blocks, store them all at once (the
        new ones computed when this prefill ends: `edge.nodes.sim.kvcache`), then wait
        the prefill time of the uncached ones, or until the cached ones another run is
        still computing are done, whichever is later. Returns the usage the cache model
        gives the run (its prompt and cached tokens), else None. From here to its end
        the run holds its blocks (its lease, which `play` ends; `kv_cache_used_tokens`)."""
        cache = self.cache
        if cache is None:
            return None
        asked = prompt(request)
        hit = cache.match(asked.blocks)
        cached = min(hit * BLOCK_TOKENS, asked.tokens)
        now = asyncio.get_running_loop().time()
        done = now + (asked.tokens - cached) * self.kv.prefill_us_per_token / 1e6
        done = max(done, cache.ready(asked.blocks, hit))
        self._leases[id(run)] = cache.start(asked.blocks, asked.tokens, ready=done)
        self.state_changed()
        if done > now:
            await asyncio.sleep(done - now)
        return pb.Usage(input_tokens=asked.tokens, cached_input_tokens=cached)

    def _held_tokens(self, lease: Lease | None, event: pb.RunEvent) -> int:
        """What a send of `event` adds to the blocks its run (`lease`) holds, in tokens;
        0: nothing (not a delta, or no cache model)."""
        if lease is None or self.cache is None or event.type not in _PACED:
            return 0
        return delta_tokens(event.delta)

    def _decoded(self, lease: Lease | None, tokens: int) -> None:
        """The run of `lease` sent a delta of `tokens` (`_held_tokens`, not 0: so there is
        a lease and a cache model): they count in the blocks it holds."""
        assert lease is not None
        assert self.cache is not None
        if self.cache.decoded(lease, tokens):
            self.state_changed()

    async def _send(
        self, run: RunRecord, event: pb.RunEvent, n: int, pace: Pace, lease: Lease | None
    ) -> None:
        """Send `event` `n` times (a script's `repeat`), each delta at the decode pace and
        counted in the blocks the run holds: serialized once, its bytes sent n times."""
        payload = Encoded(bytes(event))
        send = run.send
        paced = event.type in _PACED and pace.tokens_per_s
        tokens = self._held_tokens(lease, event)  # worked out once for every send
        for i in range(n):
            if paced:
                await pace.wait(event.delta)
            await send(payload)
            if tokens:
                self._decoded(lease, tokens)
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                # send_message does not yield while the window is open: never
                # starve other RPCs (CancelRun among them).
                await asyncio.sleep(0)

    async def _play(self, run: RunRecord, steps: Iterator[Step], lease: Lease | None) -> str:
        """Play `steps` (deltas at the decode pace, each counted in the blocks the run
        holds, `lease`); returns the run's outcome."""
        pace = Pace(self.kv.decode_tokens_per_s)
        for step in steps:
            if isinstance(step, Send):
                await self._send(run, step.event, step.repeat, pace, lease)
            elif isinstance(step, Sleep):
                await asyncio.sleep(step.seconds)
            elif isinstance(step, Hang):
                await asyncio.Event().wait()
            elif isinstance(step, Abort):
                run.outcome = "aborted"
                # Non-OK trailers: the events sent so far still arrive, in order.
                raise GRPCError(Status.ABORTED, "simulated abort")
            elif isinstance(step, End):
                return step.outcome
        return "ended"
