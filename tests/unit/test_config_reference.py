"""docs/config-reference.md is current, and names every key the parser accepts.

Invariants:
- The committed file is what `python -m edge.config.reference` prints (`make config-ref`
  writes it; `make check` runs the same comparison).
- Its tables and keys are exactly the ones `parse_config` reads: learnt from the parser's
  own table readers (`edge.config.toml.recording`), not listed here.
- The parser reads every key through the reader, which records it; it never tests for a
  key in the table first (a key read that way could be accepted and go unrecorded).
- Each default the reference gives is a value its key accepts.
- Every settings field that says it is a key of the file (a `doc` in its metadata,
  `edge.config.spec`) is one the parser reads.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

from edge.config import DEFAULT_MODEL, Config, parse_config
from edge.config.reference import render
from edge.config.toml import recording

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "config-reference.md"
# A heading and the key of a table row.
HEADING = re.compile(r"^## `\[\[?([a-z_]+)(?:\.NAME)?\]\]?`$")
ROW = re.compile(r"^\| `([a-z_]+)` \| [^|]*(?:\\\|[^|]*)* \| (.*?) \| ")


def _documented() -> dict[str, dict[str, str]]:
    """Each table of the committed reference, with its keys and their defaults."""
    tables: dict[str, dict[str, str]] = {}
    keys: dict[str, str] = {}
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        if heading := HEADING.match(line):
            keys = tables.setdefault(heading.group(1), {})
        elif row := ROW.match(line):
            keys[row.group(1)] = row.group(2)
    return tables


def _accepted() -> dict[str, set[str]]:
    """Each table `parse_config` reads, with the keys it accepts there."""
    probe = {
        "nodes": [{"address": "embedded"}, {"address": "127.0.0.1:50051"}],
        "keys": [{"name": "a", "key": "secret-a"}],
        "models": {"some-model": {}, "sim-echo": {}},
    }
    with recording() as readers:
        parse_config(probe, "<probe>")
    tables: dict[str, set[str]] = {}
    for reader in readers:
        tables.setdefault(reader.prefix.split("[")[0].split(".")[0], set()).update(reader.known)
    return tables


def _settings(hint: Any) -> type:
    """The settings class of a table of `Config` (an array's or a map's entries)."""
    args = [arg for arg in get_args(hint) if arg is not Ellipsis]
    return args[-1] if args else hint


def test_every_key_of_the_settings_is_read() -> None:
    """A field with a doc that the parser never reads would be a key the file cannot set."""
    accepted = _accepted()
    hints = get_type_hints(Config)
    assert set(accepted.pop("")) == {f.name for f in fields(Config) if "doc" in f.metadata}
    for table, keys in accepted.items():
        declared = {f.name for f in fields(_settings(hints[table])) if "doc" in f.metadata}
        assert declared <= keys, (table, declared - keys)


def test_the_committed_reference_is_current() -> None:
    assert REFERENCE.read_text(encoding="utf-8") == render(), (
        "docs/config-reference.md is stale: run 'make config-ref'"
    )


def test_the_reference_names_every_table_and_key_the_parser_accepts() -> None:
    accepted, documented = _accepted(), _documented()
    assert set(documented) == accepted.pop("")
    assert {table: set(keys) for table, keys in documented.items()} == accepted


def test_the_parser_reads_every_key_through_the_reader() -> None:
    for module in ("parse", "keys"):
        source = (ROOT / "edge" / "config" / f"{module}.py").read_text(encoding="utf-8")
        assert ".table" not in source, f"edge/config/{module}.py looks into a reader's table"


def test_every_default_in_the_reference_is_accepted() -> None:
    """A document setting each key to the default the reference gives parses, to the
    settings' defaults."""
    lines = []
    for table, keys in _documented().items():
        values = {
            key: default.strip("`").replace("\\|", "|")
            for key, default in keys.items()
            if default.startswith("`")
        }
        heading = {"nodes": "[[nodes]]", "keys": "[[keys]]", "models": "[models.m]"}
        lines.append(heading.get(table, f"[{table}]"))
        lines += [f"{key} = {value}" for key, value in values.items()]
        lines += {"nodes": ['address = "embedded"'], "keys": ['name = "a"', 'key = "k"']}.get(
            table, []
        )
    config = parse_config(tomllib.loads("\n".join(lines)), "<defaults>")
    for table in ("server", "log", "timeouts", "routing", "admission", "limits", "tracing"):
        assert getattr(config, table) == getattr(Config(), table), table
    assert config.models["m"] == DEFAULT_MODEL
