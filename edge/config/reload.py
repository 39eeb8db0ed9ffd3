"""What a new configuration changes in a running edge, and what of it waits for a restart.

A reload (`edge.process.reload`) applies a new `Config` to an edge that runs
on another. Most settings are read per request or per decision and change at
once; the ones in `RESTART_ONLY` are bound when the process starts (the
listening socket, the worker processes, the connection limits, the logging
sink, the tracing exporter, the limits store, the response store) and keep
their running values until a restart. `restart_needed` names those whose values differ,
`applied` is the new configuration with them put back to the running
values (what the edge then runs on), and `changes` says what the reload
changes, for its log line.

Pure: no I/O, nothing but the settings dataclasses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields, replace
from typing import Any

from edge.config.schema import Config

# The settings bound at start, by table: a reload keeps their running values. A table
# named with None: every key of it.
RESTART_ONLY: Mapping[str, tuple[str, ...] | None] = {
    "server": (
        "listen",
        "workers",
        "drain_timeout_s",
        "max_body_bytes",
        "max_connections",
        "idle_timeout_s",
        "body_timeout_s",
    ),
    "log": ("format", "queue_bytes"),
    "timeouts": ("slow_client_s", "slow_client_backlog_chars"),
    "limits": None,
    "responses": None,
    "tracing": ("enabled", "exporter", "endpoint"),
}
# The tables of single settings (the others are lists or maps of entries: nodes, keys,
# models), in the order `changes` names them.
_TABLES = (
    "server", "log", "timeouts", "routing", "admission", "discovery", "limits", "responses",
    "tracing",
)  # fmt: skip
# Not settings of their own: the keys of `api_keys_file` are counted with `api_keys`.
_NOT_COMPARED = {"server": ("api_keys", "api_keys_file")}


def _restart_keys(table: str, settings: object) -> tuple[str, ...]:
    keys = RESTART_ONLY.get(table, ())
    return tuple(f.name for f in fields(settings)) if keys is None else keys  # type: ignore[arg-type]


def restart_needed(running: Config, new: Config) -> list[str]:
    """The settings of `new` that differ from `running` and take effect only at a
    restart, as `table.key`."""
    names: list[str] = []
    for table in RESTART_ONLY:
        old_settings, new_settings = getattr(running, table), getattr(new, table)
        for key in _restart_keys(table, old_settings):
            if getattr(old_settings, key) != getattr(new_settings, key):
                names.append(f"{table}.{key}")
    return names


def applied(running: Config, new: Config) -> Config:
    """`new` as a running edge applies it: the settings bound at start keep `running`'s
    values (see `restart_needed`)."""
    tables: dict[str, Any] = {}
    for table in RESTART_ONLY:
        old_settings = getattr(running, table)
        kept = {key: getattr(old_settings, key) for key in _restart_keys(table, old_settings)}
        tables[table] = replace(getattr(new, table), **kept)
    return replace(new, **tables)


def _named(kind: str, old: Mapping[str, object], new: Mapping[str, object]) -> str | None:
    """`kind +added -removed ~changed`, by name; None when nothing changed."""
    parts = [f"+{n}" for n in new if n not in old]
    parts += [f"-{n}" for n in old if n not in new]
    parts += [f"~{n}" for n in new if n in old and old[n] != new[n]]
    return f"{kind} {' '.join(parts)}" if parts else None


def changes(old: Config, new: Config) -> list[str]:
    """What going from `old` to `new` changes: `table.key` per setting, and the entries
    of the lists by name (`nodes +b -a ~c`: added, removed, changed)."""
    out: list[str] = []
    for table in _TABLES:
        old_settings, new_settings = getattr(old, table), getattr(new, table)
        skip = _NOT_COMPARED.get(table, ())
        for f in fields(old_settings):
            before, after = getattr(old_settings, f.name), getattr(new_settings, f.name)
            if f.name not in skip and before != after:
                out.append(f"{table}.{f.name}")
    if set(old.server.api_keys) != set(new.server.api_keys):
        out.append(f"server.api_keys ({len(new.server.api_keys)} keys)")
    entries: Iterable[str | None] = (
        _named("keys", {k.name: k for k in old.keys}, {k.name: k for k in new.keys}),
        _named("nodes", {n.name: n for n in old.nodes}, {n.name: n for n in new.nodes}),
        _named("models", old.models, new.models),
    )
    out += [entry for entry in entries if entry is not None]
    return out
