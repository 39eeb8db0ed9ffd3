"""The TOML reader: one table at a time, typed, and one clear line per mistake.

Owns `ConfigError` (its message names the file and the key), `TableReader` (types,
ranges, unknown keys) and reading a file as TOML. Knows nothing of the edge's settings
(`edge.config.schema`): the node commands (`edge.nodes.upstream.cli`) read their own
tables with it without loading the edge's.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar, cast

# A read's default: a key read only when present passes None.
_D = TypeVar("_D")
# The readers made while `recording()` is on.
_recording: ContextVar[list[TableReader] | None] = ContextVar("_recording", default=None)


class ConfigError(Exception):
    """A configuration mistake; the message is one line naming the file and key."""


class TableReader:
    """Reads one table, checking types and rejecting unknown keys.

    `known` is every key read so far and what it takes (a TOML type, its range, its
    choices): the keys this table accepts, as the parser reads them, for the generated
    reference (docs/config-reference.md). Each read records its key whether or not the
    table has it; a key read only when present passes None as its default.
    """

    def __init__(self, source: str, prefix: str, table: object) -> None:
        self.source = source
        self.prefix = prefix
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{prefix}] must be a table")
        self.table: dict[str, Any] = dict(table)
        self.known: dict[str, str] = {}
        readers = _recording.get()
        if readers is not None:
            readers.append(self)

    def _key(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self._key(key)}: {message}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        self.known[key] = " or ".join(_KINDS.get(k, k.__name__) for k in kinds)
        if key not in self.table:
            return default
        value = self.table.pop(key)
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail(key, f"expected {_names(kinds)}, got a boolean")
        if not isinstance(value, kinds):
            raise self.fail(key, f"expected {_names(kinds)}, got {type(value).__name__}")
        return value

    def raw(self, key: str, takes: str) -> object:
        """The value as TOML gave it (None: absent), for the caller to check; `takes`
        says what it accepts."""
        self.known[key] = takes
        return self.table.pop(key, None)

    def number(
        self, key: str, default: _D, *, minimum: float = 0.0, maximum: float = 1e9
    ) -> float | _D:
        value = self.get(key, (int, float), None)
        self.known[key] = "number" + _range(minimum, maximum, 1e9)
        if value is None:
            return default
        value = float(value)
        if not math.isfinite(value):
            raise self.fail(key, "must be a finite number")
        if value < minimum:
            raise self.fail(key, f"must be >= {minimum}")
        if value > maximum:
            raise self.fail(key, f"must be <= {maximum:g}")
        return value

    def strings(self, key: str, default: _D) -> tuple[str, ...] | _D:
        value = self.get(key, list, None)
        self.known[key] = "list of strings"
        if value is None:
            return default
        if not all(isinstance(v, str) for v in value):
            raise self.fail(key, "expected a list of strings")
        return tuple(value)

    def choice(self, key: str, default: _D, choices: tuple[str, ...]) -> str | _D:
        value = self.get(key, str, None)
        self.known[key] = "one of " + ", ".join(f'"{c}"' for c in choices)
        if value is None:
            return default
        if value not in choices:
            raise self.fail(key, f"expected one of {', '.join(choices)}, got {value!r}")
        return cast(str, value)

    def integer(self, key: str, default: _D, *, minimum: int = 0, maximum: int = 10**9) -> int | _D:
        value = self.get(key, int, None)
        self.known[key] = "integer" + _range(minimum, maximum, 10**9)
        if value is None:
            return default
        if not minimum <= value <= maximum:
            raise self.fail(key, f"must be between {minimum} and {maximum}, got {value}")
        return cast(int, value)

    def done(self) -> None:
        for key in self.table:
            raise ConfigError(f"{self.source}: unknown key {self._key(key)}")


_KINDS: dict[type, str] = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    list: "list",
    dict: "table",
}


def _names(kinds: tuple[type, ...]) -> str:
    """The kinds as an error message names them: "an integer or a number"."""
    names = (_KINDS.get(k, k.__name__) for k in kinds)
    return " or ".join(f"{'an' if n[0] in 'aeiou' else 'a'} {n}" for n in names)


def _range(minimum: float, maximum: float, unbounded: float) -> str:
    """` >= 1`, or `, 1 to 10` when the maximum is not the reader's default, `unbounded`."""
    low, high = (f"{v:g}" if isinstance(v, float) else str(v) for v in (minimum, maximum))
    return f" >= {low}" if maximum == unbounded else f", {low} to {high}"


@contextmanager
def recording() -> Iterator[list[TableReader]]:
    """Every TableReader made inside the block, in order: parsing a document under it
    tells the tables and keys the parser accepts (the reference, its test)."""
    readers: list[TableReader] = []
    token = _recording.set(readers)
    try:
        yield readers
    finally:
        _recording.reset(token)


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML document at `path`; ConfigError when it cannot be read or parsed."""
    return parse_toml(read_bytes(path), path)


def read_bytes(path: Path) -> bytes:
    """The bytes of the file at `path`; ConfigError when it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None


def parse_toml(data: bytes, path: Path) -> dict[str, Any]:
    """`data`, the bytes of the file at `path`, as a TOML document; ConfigError when they
    are not UTF-8 TOML."""
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
