"""The TOML reader: one table at a time, typed, and one clear line per mistake.

Owns `ConfigError` (its message names the file and the key), `TableReader` (types,
ranges, unknown keys) and reading a file as TOML. Knows nothing of the edge's settings
(`edge.config.schema`): the node commands (`edge.nodes.upstream.cli`) read their own
tables with it without loading the edge's.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any


class ConfigError(Exception):
    """A configuration mistake; the message is one line naming the file and key."""


class TableReader:
    """Reads one table, checking types and rejecting unknown keys."""

    def __init__(self, source: str, prefix: str, table: object) -> None:
        self.source = source
        self.prefix = prefix
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{prefix}] must be a table")
        self.table: dict[str, Any] = dict(table)

    def _key(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self._key(key)}: {message}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        if key not in self.table:
            return default
        value = self.table.pop(key)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail(key, f"expected {_names(kinds)}, got a boolean")
        if not isinstance(value, kinds):
            raise self.fail(key, f"expected {_names(kinds)}, got {type(value).__name__}")
        return value

    def number(
        self, key: str, default: float, *, minimum: float = 0.0, maximum: float = 1e9
    ) -> float:
        value = float(self.get(key, (int, float), default))
        if not math.isfinite(value):
            raise self.fail(key, "must be a finite number")
        if value < minimum:
            raise self.fail(key, f"must be >= {minimum}")
        if value > maximum:
            raise self.fail(key, f"must be <= {maximum:g}")
        return value

    def strings(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self.get(key, list, None)
        if value is None:
            return default
        if not all(isinstance(v, str) for v in value):
            raise self.fail(key, "expected a list of strings")
        return tuple(value)

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        value = str(self.get(key, str, default))
        if value not in choices:
            raise self.fail(key, f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    def integer(self, key: str, default: int, *, minimum: int = 0, maximum: int = 10**9) -> int:
        value: int = self.get(key, int, default)
        if not minimum <= value <= maximum:
            raise self.fail(key, f"must be between {minimum} and {maximum}, got {value}")
        return value

    def done(self) -> None:
        for key in self.table:
            raise ConfigError(f"{self.source}: unknown key {self._key(key)}")


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(
        {
            int: "an integer",
            float: "a number",
            str: "a string",
            bool: "a boolean",
            list: "a list",
            dict: "a table",
        }.get(k, k.__name__)
        for k in kinds
    )


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML document at `path`; ConfigError when it cannot be read or parsed."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
