"""iop-node's exact KV index: its model server's KV events read as they are published,
each run's prompt registered before it is sent, and the claims reported on Watch.

`KVFeed` owns one `KVMap` (`edge.nodes.upstream.kvmap`, whose `log` the node's
Watch reports from) and, on the node's asyncio loop:

- a SUB socket on the server's publisher (`--kv-events`, pyzmq's asyncio
  sockets; topic filter `--kv-topic`), read from the first Describe on. Each
  message's number is checked (`kvwire.Sequence`): the next one is applied; past
  a gap, a DEALER socket asks the replay endpoint (`--kv-replay`) for the
  batches from the first missed one, and applies them; a gap it cannot fill
  (no replay endpoint, the buffer moved past it, no answer in
  REPLAY_TIMEOUT_S), a number not above the last one received (a new life of
  the publisher: it counts from 0), a batch that is not one, and a server that
  refuses the connection (`reset`, called by the node: it may be restarting) reset
  the map: the watchers get a snapshot of nothing, never a set the server no
  longer holds.
- `prompt`, the relay's hook before each run is sent: the server's tokens of
  the run's prompt (`edge.nodes.upstream.kvtokenize`, bounded by
  TOKENIZE_TIMEOUT_S) registered in the map. A run that cannot be mapped is
  sent as it is (its blocks are then not claimed); each reason is logged once.

Bounded: the SUB socket holds at most RECEIVE_HWM messages (more are dropped by
ZMQ: a gap), each at most MAX_MESSAGE_BYTES; the map its `max_blocks`
(`KVSettings.table_mib`, at BLOCK_BYTES a block, measured); a replay applies
what the server's buffer sends, in order, within REPLAY_TIMEOUT_S. Closing
cancels the reader and closes its sockets and context.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import anyio
import httpx
import zmq
import zmq.asyncio
from loguru import logger

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.kvmap import KVMap
from edge.nodes.upstream.kvtokenize import (
    TOKENIZE_TIMEOUT_S,
    mappable,
    read_tokenized,
    run_prompt,
    tokenize_url,
)
from edge.nodes.upstream.kvwire import (
    Sequence,
    WireError,
    decode_batch,
    replay_request,
    split_frames,
    split_replay,
)

__all__ = ["BLOCK_BYTES", "KVFeed", "KVSettings"]

# The live messages the SUB socket holds for the reader (ZMQ drops past it: a gap).
RECEIVE_HWM: Final = 10_000
# The longest message read (a batch of a long prompt's blocks, its token ids with them).
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
# How long a replay may take, the request and every batch it sends.
REPLAY_TIMEOUT_S: Final = 5.0
# The map's memory per block (measured, tests/unit/test_kvmap.py), for `table_mib`.
BLOCK_BYTES: Final = 768
# Prompts of more tokens than this are mapped in a worker thread.
OFFLOAD_TOKENS: Final = 4096


@dataclass(frozen=True, slots=True)
class KVSettings:
    """Where the server publishes its KV events, and the map's bounds (`iop-node
    --kv-events ...`, docs/nodes.md)."""

    events: str
    replay: str | None = None
    topic: str = ""
    # The server's block size in tokens until its first event says it.
    block_size: int = 16
    table_mib: int = 64

    @property
    def max_blocks(self) -> int:
        return max(1, self.table_mib * 2**20 // BLOCK_BYTES)


class KVFeed:
    """The map, fed by the server's events and the runs' prompts (the module doc).

    Args:
        settings: the publisher's endpoints and the map's bounds.
        upstream: the server's API base (its `/tokenize` is at its origin).
        client: the node's httpx client (the API key goes along).
        on_change: called on the loop when the claims changed (the node's
            `state_changed`: its watchers report).
        name: the node's name, in the log lines.
    """

    def __init__(
        self,
        settings: KVSettings,
        *,
        upstream: str,
        client: httpx.AsyncClient,
        on_change: Callable[[], None],
        name: str = "iop-node",
    ) -> None:
        self.settings = settings
        self.map = KVMap(settings.block_size, settings.max_blocks)
        self._url = tokenize_url(upstream)
        self._client = client
        self._on_change = on_change
        self._name = name
        self._sequence = Sequence()
        self._context: zmq.asyncio.Context | None = None
        self._reader: asyncio.Task[None] | None = None
        # Why runs were not mapped, each logged once.
        self._told: set[str] = set()
        # Runs registered, and batches applied (for the log and the tests).
        self.registered = 0
        self.batches = 0

    def start(self) -> None:
        """Read the server's events from now on (once; later calls do nothing)."""
        if self._reader is None:
            self._context = zmq.asyncio.Context()
            self._reader = asyncio.create_task(self._read(self._context))

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._context is not None:
            self._context.term()

    def reset(self, reason: str) -> None:
        """Nothing is known stored any more (`KVMap.reset`); logged when something was."""
        if self.map.stored() or self.map.claimed:
            logger.info("{}: kv index: reset: {}", self._name, reason)
        self.map.reset()
        self._on_change()

    # --- runs ------------------------------------------------------------------------

    async def prompt(self, request: pb.RunRequest, body: bytes) -> None:
        """Register `request`'s prompt (its upstream `body`) before it is sent; a run
        that cannot be mapped is sent all the same."""
        if (why := mappable(request)) is not None:
            self._unmapped(why)
            return
        with anyio.move_on_after(TOKENIZE_TIMEOUT_S) as waited:
            try:
                tokenized = await read_tokenized(self._client, self._url, body)
            except (httpx.HTTPError, ValueError) as exc:
                self._unmapped(f"the server's tokens could not be read: {exc}", server=True)
                return
        if waited.cancelled_caught:
            why = f"the server's /tokenize took over {TOKENIZE_TIMEOUT_S:g}s"
            self._unmapped(why, server=True)
            return
        size = self.map.block_size
        try:
            if len(tokenized.tokens) > OFFLOAD_TOKENS:
                prompt = await anyio.to_thread.run_sync(run_prompt, request, tokenized, size)
            else:
                prompt = run_prompt(request, tokenized, size)
            if isinstance(prompt, str):
                self._unmapped(prompt, server=tokenized.token_strs is None)
                return
            self.registered += 1
            if self.map.register(prompt):
                self._on_change()
        except Exception:  # a bug of the mapping's: the run is sent all the same
            logger.exception("{}: kv index: run {} not mapped", self._name, request.run_id)

    def _unmapped(self, why: str, *, server: bool = False) -> None:
        """A run sent unmapped: the first of each reason logged (a warning when the
        server is why: then no run is mapped), the others at debug."""
        kind = why.split(":", 1)[0]
        if kind not in self._told and len(self._told) < 64:
            self._told.add(kind)
            logger.log("WARNING" if server else "INFO",
                       "{}: kv index: a run is sent unmapped: {}", self._name, why)  # fmt: skip
        else:
            logger.debug("{}: kv index: a run is sent unmapped: {}", self._name, why)

    # --- the server's events ---------------------------------------------------------

    async def _read(self, context: zmq.asyncio.Context) -> None:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, self.settings.topic.encode())
        sub.connect(self.settings.events)
        try:
            while True:
                frames = await sub.recv_multipart()
                await self._message(frames, context)
        finally:
            sub.close(0)

    async def _message(self, frames: list[bytes], context: zmq.asyncio.Context) -> None:
        try:
            seq, payload = split_frames(frames)
        except WireError as exc:
            logger.warning("{}: kv index: a message ignored: {}", self._name, exc)
            return
        sequence = self._sequence
        verdict = sequence.check(seq)
        if verdict == "seen":
            return
        if verdict == "restart":
            self.reset("the server's events count from the start again (a new process)")
        elif verdict == "gap":
            expected = sequence.expected
            if not await self._replay(context, seq):
                self.reset(f"batches {expected} to {seq - 1} were missed, and not replayed")
            elif sequence.expected is not None and sequence.expected > seq:
                return  # the replay brought this one too
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        """One batch, in its turn."""
        self._sequence.advance(seq)
        self.batches += 1
        try:
            batch = decode_batch(payload)
        except WireError as exc:
            self.reset(f"batch {seq} is not one: {exc}")
            return
        changed = False
        for event in batch.events:
            changed |= self.map.apply(event)
        if changed:
            self._on_change()

    async def _replay(self, context: zmq.asyncio.Context, upto: int) -> bool:
        """Ask the replay endpoint for the batches from the next expected one and apply
        them; whether they reached `upto` (the live message's number)."""
        endpoint = self.settings.replay
        start = self._sequence.expected
        if endpoint is None or start is None:
            return False
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.connect(endpoint)
        try:
            with anyio.move_on_after(REPLAY_TIMEOUT_S):
                await dealer.send_multipart(replay_request(start))
                while (item := split_replay(await dealer.recv_multipart())) is not None:
                    seq, payload = item
                    expected = self._sequence.expected
                    if expected is not None and seq > expected:
                        return False  # the server's buffer lost it
                    if expected is None or seq == expected:
                        self._apply(seq, payload)
        except WireError as exc:
            logger.warning("{}: kv index: the replay sent {}", self._name, exc)
            return False
        finally:
            dealer.close(0)
        expected = self._sequence.expected
        return expected is not None and expected >= upto
