"""iop-node's reading of its upstream's load: `/metrics`, asked every interval.

`LoadPoll` runs one task on the node's loop that GETs the upstream's
`/metrics` (at the upstream's origin: `http://host:8000/v1` -> `http://host:8000/metrics`)
every `interval_s`, reads it (`edge.nodes.upstream.load`, in a worker
thread: the text may be MAX_METRICS_BYTES) and keeps the latest `Load`,
calling `on_change` when it changed (the node's `state_changed`, so Watch
reports it).

Bounded: each scrape has SCRAPE_TIMEOUT_S and reads at most
MAX_METRICS_BYTES (a longer body is a failed scrape, never read whole). A
failed scrape (unreachable, an error status, too large, not metrics, none of
the known metrics) keeps the last load until FAILURES_UNSET scrapes in a row
have failed; then the load is unknown (None). The reader logs a line when
what it sees changes (working, or failing in another way), not at every scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Final, cast
from urllib.parse import urlsplit

import httpx
from loguru import logger

from edge.nodes.upstream.load import MAX_METRICS_BYTES, Load, LoadError, load_from_metrics

__all__ = ["FAILURES_UNSET", "SCRAPE_TIMEOUT_S", "LoadPoll", "metrics_url"]

SCRAPE_TIMEOUT_S: Final = 2.0
# Failed scrapes in a row after which the load is unknown rather than the last read.
FAILURES_UNSET: Final = 3


def metrics_url(upstream: str) -> str:
    """The upstream's `/metrics`: at its origin, whatever the API's path."""
    parts = urlsplit(upstream)
    return f"{parts.scheme}://{parts.netloc}/metrics"


class _ScrapeFailed(Exception):
    """One scrape failed: `kind` is the way (logged when it changes), the message says more."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class LoadPoll:
    """The upstream's latest load (`load`, None: unknown), read every `interval_s`.

    Args:
        client: the node's httpx client (its headers, the API key, go along).
        url: the `/metrics` URL.
        source: a dialect of `edge.nodes.upstream.load`, or `auto`.
        interval_s: seconds between scrapes (after one ends).
        on_change: called on the node's loop when `load` changed.
        name: the node's name, in the log lines.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        *,
        source: str,
        interval_s: float,
        on_change: Callable[[], None],
        name: str = "iop-node",
    ) -> None:
        self.url = url
        self.load: Load | None = None
        self._client = client
        self._source = source
        self._interval_s = interval_s
        self._on_change = on_change
        self._name = name
        self._failures = 0
        # How the last scrape went ("ok" or a failure's kind): a log line when it changes.
        self._state: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        """Start reading, on the running loop (again, or once closed: nothing)."""
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        """Stop reading (a scrape under way is abandoned)."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await self.scrape()
            await asyncio.sleep(self._interval_s)

    async def scrape(self) -> None:
        """One scrape: the load it reads (or, failing, the last one, for a while)."""
        load: Load | None
        try:
            read = await self._read()
        except _ScrapeFailed as exc:
            self._failures += 1
            self._note(exc.kind, f"cannot read its load from {self.url}: {exc}")
            load = self.load if self._failures < FAILURES_UNSET else None
        else:
            self._failures = 0
            self._note("ok", f"reads its load from {self.url} ({read.dialect})")
            load = read
        if load != self.load:
            self.load = load
            self._on_change()

    async def _read(self) -> Load:
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                body = await self._get()
        except TimeoutError:
            raise _ScrapeFailed("timeout", f"no answer in {SCRAPE_TIMEOUT_S} s") from None
        except httpx.HTTPError as exc:
            raise _ScrapeFailed("unreachable", str(exc) or type(exc).__name__) from None
        text = body.decode("utf-8", errors="replace")
        try:
            return await asyncio.to_thread(load_from_metrics, text, self._source)
        except LoadError as exc:
            raise _ScrapeFailed("unreadable", str(exc)) from None

    async def _get(self) -> bytes:
        """The body of GET /metrics, at most MAX_METRICS_BYTES; _ScrapeFailed otherwise."""
        headers = {"Accept": "text/plain"}
        async with self._client.stream("GET", self.url, headers=headers) as response:
            if response.status_code != 200:
                raise _ScrapeFailed(
                    f"status {response.status_code}", f"it answered {response.status_code}"
                )
            chunks: list[bytes] = []
            size = 0
            pieces = cast(AsyncGenerator[bytes, None], response.aiter_bytes())
            async with contextlib.aclosing(pieces) as body:
                async for chunk in body:
                    size += len(chunk)
                    if size > MAX_METRICS_BYTES:
                        raise _ScrapeFailed(
                            "too large", f"the body passes the limit of {MAX_METRICS_BYTES} bytes"
                        )
                    chunks.append(chunk)
        return b"".join(chunks)

    def _note(self, state: str, line: str) -> None:
        """Log `line` when the scrape's state differs from the last one's."""
        if state != self._state:
            log = logger.info if state == "ok" else logger.warning
            log("{}: {}", self._name, line)
            self._state = state
