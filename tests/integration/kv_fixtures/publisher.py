"""A KV event publisher that speaks vLLM's ZMQ framing, as `ZmqEventPublisher` in
`vllm/distributed/kv_events.py` does it (SGLang's is the same code): a PUB socket
sending (topic, 8-byte big-endian number from 0, msgpack batch), a ROUTER socket
answering a replay request (its 8-byte start number) with (number, batch) for each
batch it still holds from there, then (-1, b""), and one thread doing both.

For the tests it can also: leave batches off the PUB socket while keeping them for
replay (`drop`: a gap the replay fills), forget what it holds (`forget`: a gap it
cannot fill), and start a new life (`restart`: numbers from 0, nothing held).
Events are built by a format module of this folder (`vllm_maps`, `sglang`, ...).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    """One server's publisher, on 127.0.0.1 ports of the kernel's (`endpoint`, `replay`)."""

    def __init__(self, fmt: ModuleType, topic: str = "", buffer_steps: int = 10_000) -> None:
        self.fmt = fmt
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        replay_port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay = f"tcp://127.0.0.1:{replay_port}"
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._dropping = 0
        self._encode = msgspec.msgpack.Encoder().encode
        self._work: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.replays = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-publisher")
        self._thread.start()

    def publish(self, events: list[Any]) -> None:
        """One batch of events (built by `fmt`)."""
        batch = self.fmt.batch(time.time(), events, 0)
        self._work.put(lambda: self._send(batch))

    def drop(self, count: int = 1) -> None:
        """The next `count` batches are held for replay but not sent live."""
        self._work.put(lambda: setattr(self, "_dropping", self._dropping + count))

    def forget(self) -> None:
        """Hold no batch for replay any more."""
        self._work.put(self._buffer.clear)

    def restart(self) -> None:
        """A new life: numbers from 0 again, nothing held."""

        def restart() -> None:
            self._seq = 0
            self._buffer.clear()

        self._work.put(restart)

    def settle(self) -> None:
        """Wait until everything asked so far is done."""
        done = threading.Event()
        self._work.put(done.set)
        done.wait(10)

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(10)
        self._pub.close(0)
        self._router.close(0)
        self._context.term()

    def _send(self, batch: Any) -> None:
        seq, self._seq = self._seq, self._seq + 1
        payload = self._encode(batch)
        self._buffer.append((seq, payload))
        if self._dropping:
            self._dropping -= 1
            return
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def _run(self) -> None:
        while True:
            if self._router.poll(0):
                self._service_replay()
            try:
                work = self._work.get(timeout=0.01)
            except queue.Empty:
                continue
            if work is None:
                return
            work()

    def _service_replay(self) -> None:
        frames = self._router.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        self.replays += 1
        for seq, payload in self._buffer:
            if seq >= start:
                self._router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._router.send_multipart((client, b"", END_SEQ, b""))
