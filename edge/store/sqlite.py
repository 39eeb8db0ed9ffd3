"""The response store in one SQLite file, shared by the workers of one edge.

stdlib sqlite3 in WAL mode (readers never wait for the writer; `synchronous=NORMAL`: a
commit is not an fsync, the WAL is synced at checkpoints), one file every worker opens.
Every call runs in a worker thread (`trio.to_thread.run_sync`), at most `threads` at
once, each on a connection of its own from a fixed pool: the event loop never waits on
the disk, and a call that waits for another process's write lock waits in its thread,
up to `busy_timeout_s` (then `StoreUnavailable`).

Tables: `responses` (one row per response: owner, id, expiry, bytes, the Response
object and its context), `items` (each output item by owner and id, with the row it
belongs to) and `totals` (the count and the bytes of `responses`, kept by triggers,
so the bounds are checked without a scan), and `owner_totals` (the same per owner). A
write, in one transaction: drop expired rows, insert, drop the owner's oldest rows while
it is over its own bounds, then the oldest rows while over `max_responses` or `max_bytes`.
A read sees only rows not expired. The schema's version is the file's `user_version`;
a file of another version is not opened.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, TypeVar

import trio

from edge.api.responses_state import Resolved, StoredResponse
from edge.store.base import Bounds, StoreUnavailable, TooMuchReferenced, make_record

_T = TypeVar("_T")
SCHEMA_VERSION: Final = 2
# Version 2: each owner's count and bytes, kept by triggers as `totals` is, and its
# records in order, so an owner past its bounds loses its own oldest.
_OWNERS: Final = (
    """CREATE TABLE IF NOT EXISTS owner_totals (
        owner TEXT PRIMARY KEY,
        count INTEGER NOT NULL,
        bytes INTEGER NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS responses_of_owner ON responses (owner, seq)",
    """INSERT OR REPLACE INTO owner_totals
        SELECT owner, COUNT(*), SUM(nbytes) FROM responses GROUP BY owner""",
    """CREATE TRIGGER IF NOT EXISTS owner_added AFTER INSERT ON responses BEGIN
        INSERT OR IGNORE INTO owner_totals VALUES (NEW.owner, 0, 0);
        UPDATE owner_totals SET count = count + 1, bytes = bytes + NEW.nbytes
            WHERE owner = NEW.owner;
    END""",
    """CREATE TRIGGER IF NOT EXISTS owner_gone AFTER DELETE ON responses BEGIN
        UPDATE owner_totals SET count = count - 1, bytes = bytes - OLD.nbytes
            WHERE owner = OLD.owner;
        DELETE FROM owner_totals WHERE owner = OLD.owner AND count <= 0;
    END""",
)
_SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS responses (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        owner TEXT NOT NULL,
        id TEXT NOT NULL,
        expires_at REAL NOT NULL,
        nbytes INTEGER NOT NULL,
        response BLOB NOT NULL,
        context BLOB NOT NULL,
        UNIQUE (owner, id)
    )""",
    "CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires_at)",
    """CREATE TABLE IF NOT EXISTS items (
        owner TEXT NOT NULL,
        id TEXT NOT NULL,
        response_seq INTEGER NOT NULL,
        body BLOB NOT NULL,
        PRIMARY KEY (owner, id)
    )""",
    "CREATE INDEX IF NOT EXISTS items_of_response ON items (response_seq)",
    """CREATE TABLE IF NOT EXISTS totals (
        one INTEGER PRIMARY KEY CHECK (one = 1),
        count INTEGER NOT NULL,
        bytes INTEGER NOT NULL
    )""",
    "INSERT OR IGNORE INTO totals VALUES (1, 0, 0)",
    """CREATE TRIGGER IF NOT EXISTS response_added AFTER INSERT ON responses BEGIN
        UPDATE totals SET count = count + 1, bytes = bytes + NEW.nbytes WHERE one = 1;
    END""",
    """CREATE TRIGGER IF NOT EXISTS response_gone AFTER DELETE ON responses BEGIN
        UPDATE totals SET count = count - 1, bytes = bytes - OLD.nbytes WHERE one = 1;
        DELETE FROM items WHERE response_seq = OLD.seq;
    END""",
    *_OWNERS,
)
# Expired rows dropped by one write, at most (the rest by the next ones).
_EXPIRED_PER_WRITE = 256
# Item ids looked up per statement (SQLite's bound on variables is far above).
_IDS_PER_QUERY = 500
DEFAULT_THREADS = 4


class SqliteStore:
    """Responses in one SQLite file (see the module doc)."""

    kind = "sqlite"

    def __init__(
        self,
        path: Path,
        bounds: Bounds,
        *,
        threads: int = DEFAULT_THREADS,
        busy_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Opens the file (creating it and its tables) with `threads` connections: call
        it off the event loop (`open`). Raises OSError or sqlite3.Error when it cannot."""
        self.path = path
        self._bounds = bounds
        self._clock = clock
        self._limiter = trio.CapacityLimiter(threads)
        self._free: list[sqlite3.Connection] = []
        self._closed = False
        try:
            for _ in range(threads):
                self._free.append(self._connect(busy_timeout_s))
        except BaseException:
            for conn in self._free:
                conn.close()
            raise

    @classmethod
    async def open(cls, path: Path, bounds: Bounds, **kwargs: Any) -> SqliteStore:
        """The store of `path`, opened in a worker thread."""
        return await trio.to_thread.run_sync(lambda: cls(path, bounds, **kwargs))

    def _connect(self, busy_timeout_s: float) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        try:
            _wal(conn, busy_timeout_s)
            conn.execute("PRAGMA synchronous=NORMAL")
            with _transaction(conn, immediate=True):  # the workers open it at once
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version not in (0, 1, SCHEMA_VERSION):
                    raise sqlite3.DatabaseError(
                        f"{self.path} holds responses of schema version {version}, not "
                        f"{SCHEMA_VERSION}: give [responses] path another file"
                    )
                # A new file gets every table; one of version 1 its owners' totals.
                for statement in _SCHEMA if version == 0 else _OWNERS if version == 1 else ():
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        return conn

    async def _run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """`fn(connection)` in a worker thread; a SQLite error is `StoreUnavailable`."""
        async with self._limiter:
            conn = self._free.pop()
            try:
                return await trio.to_thread.run_sync(fn, conn)
            except sqlite3.Error as exc:
                raise StoreUnavailable(f"sqlite: {type(exc).__name__}: {exc}") from None
            finally:
                if self._closed:
                    conn.close()
                else:
                    self._free.append(conn)

    # --- writes -----------------------------------------------------------------

    async def put(self, owner: str, response: Mapping[str, Any], context: bytes) -> bool:
        return await self._run(lambda conn: self._put(conn, owner, response, context))

    def _put(
        self, conn: sqlite3.Connection, owner: str, response: Mapping[str, Any], context: bytes
    ) -> bool:
        record = make_record(owner, response, context)
        nbytes = record.nbytes
        bounds = self._bounds
        owner_count, owner_bytes, record_bytes = bounds.of(owner)
        if nbytes > record_bytes:
            return False
        now = self._clock()
        with _transaction(conn, immediate=True):
            conn.execute(
                "DELETE FROM responses WHERE seq IN (SELECT seq FROM responses"
                " WHERE expires_at <= ? ORDER BY expires_at LIMIT ?)",
                (now, _EXPIRED_PER_WRITE),
            )
            conn.execute("DELETE FROM responses WHERE owner = ? AND id = ?", (owner, record.id))
            cursor = conn.execute(
                "INSERT INTO responses (owner, id, expires_at, nbytes, response, context)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (owner, record.id, now + bounds.ttl_s, nbytes, record.response, record.context),
            )
            seq = cursor.lastrowid
            conn.executemany(
                "INSERT OR REPLACE INTO items (owner, id, response_seq, body) VALUES (?, ?, ?, ?)",
                ((owner, item_id, seq, body) for item_id, body in record.items),
            )
            # The owner's own oldest first (its bounds), then anyone's (the store's).
            while True:
                count, held = conn.execute(
                    "SELECT count, bytes FROM owner_totals WHERE owner = ?", (owner,)
                ).fetchone()
                if count <= owner_count and held <= owner_bytes:
                    break
                conn.execute(
                    "DELETE FROM responses WHERE seq ="
                    " (SELECT MIN(seq) FROM responses WHERE owner = ?)",
                    (owner,),
                )
            while True:
                count, held = conn.execute("SELECT count, bytes FROM totals").fetchone()
                if count <= bounds.max_responses and held <= bounds.max_bytes:
                    break
                conn.execute("DELETE FROM responses WHERE seq = (SELECT MIN(seq) FROM responses)")
        return True

    async def delete(self, owner: str, response_id: str) -> bool:
        def delete(conn: sqlite3.Connection) -> bool:
            with _transaction(conn, immediate=True):
                cursor = conn.execute(
                    "DELETE FROM responses WHERE owner = ? AND id = ? AND expires_at > ?",
                    (owner, response_id, self._clock()),
                )
            return cursor.rowcount > 0

        return await self._run(delete)

    # --- reads --------------------------------------------------------------------

    async def fetch(self, owner: str, response_id: str | None, items: Sequence[str]) -> Resolved:
        return await self._run(lambda conn: self._fetch(conn, owner, response_id, items))

    def _fetch(
        self, conn: sqlite3.Connection, owner: str, response_id: str | None, ids: Sequence[str]
    ) -> Resolved:
        now = self._clock()
        previous: StoredResponse | None = None
        found: dict[str, bytes] = {}
        room = self._bounds.max_response_bytes
        with _transaction(conn):  # one snapshot for every read
            if response_id is not None:
                row = conn.execute(
                    "SELECT response, context FROM responses"
                    " WHERE owner = ? AND id = ? AND expires_at > ?",
                    (owner, response_id, now),
                ).fetchone()
                if row is not None:
                    previous = StoredResponse(bytes(row[0]), bytes(row[1]))
                    room -= len(previous.response) + len(previous.context)
            for start in range(0, len(ids), _IDS_PER_QUERY):
                if room < 0:
                    break
                chunk = ids[start : start + _IDS_PER_QUERY]
                marks = ", ".join("?" * len(chunk))
                rows = conn.execute(
                    "SELECT items.id, items.body FROM items JOIN responses"
                    " ON responses.seq = items.response_seq WHERE items.owner = ?"
                    f" AND items.id IN ({marks}) AND responses.expires_at > ?",
                    (owner, *chunk, now),
                )
                for item_id, body in rows:
                    room -= len(body)
                    if room < 0:
                        break
                    found[item_id] = bytes(body)
        if room < 0:
            raise TooMuchReferenced(self._bounds.max_response_bytes)
        return Resolved(previous, found)

    def totals(self) -> tuple[int, int]:
        """(responses, bytes) held now, as the triggers keep them (tests, off the loop)."""
        conn = self._free[0]
        count, held = conn.execute("SELECT count, bytes FROM totals").fetchone()
        return int(count), int(held)

    async def aclose(self) -> None:
        """Close the connections; one a call holds is closed when the call ends."""
        self._closed = True
        free, self._free = self._free, []
        for conn in free:
            conn.close()


def _wal(conn: sqlite3.Connection, within_s: float) -> None:
    """WAL mode. Switching to it takes the file's exclusive lock without waiting (no
    busy handler): while another worker opens the file at the same moment it fails,
    and is tried again, in this (worker) thread, for up to `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


@contextmanager
def _transaction(conn: sqlite3.Connection, *, immediate: bool = False) -> Iterator[None]:
    """A transaction on `conn` (autocommit mode otherwise): committed, or rolled back on
    any error. `immediate` takes the write lock at once (no lock upgrade to fail)."""
    conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
