"""The configuration reference, docs/config-reference.md, generated from the code.

`python -m edge.config.reference` prints it; `make config-ref` writes it, and `make
check` and tests/unit/test_config_reference.py fail when the committed file is stale.

Each source says one thing once. The tables and keys are the ones the parser reads
(`PROBE` parsed under `edge.config.toml.recording`), each with what the reader accepts
(type, range, choices: the bounds of the key's field). The default, and the meaning, are
the settings field's of that name (`edge.config.spec`: in `edge.config.schema`,
`edge.config.routing`, and `TracingConfig` in `edge.observe.tracing`), and for the keys no
field is named after, the secret sources of `[[keys]]`, `edge.config.keys.SECRET_SOURCES`.
A key without a meaning is an error, not a blank cell. Nothing of the edge imports this
module.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import MISSING, Field, fields
from typing import Any, get_args, get_origin, get_type_hints

from edge.config.keys import SECRET_SOURCES
from edge.config.parse import parse_config
from edge.config.schema import Config
from edge.config.spec import meaning
from edge.config.toml import TableReader, recording

# One entry of each array of tables and one model: the parser then reads every key once.
PROBE: dict[str, Any] = {
    "nodes": [{"address": "embedded"}],
    "keys": [{"name": "probe", "key": "probe"}],
    "models": {"NAME": {}},
}

HEADER = """\
# Configuration reference

<!-- Generated from edge/config/ by `make config-ref`: do not edit by hand. -->

Every table and key of `config.toml` that the edge reads, as the code reads it: what
the key takes, its default, and what it sets. Every key is optional unless its meaning
says required; an unknown key is an error. A default of — has none of its own: the
meaning says what applies. How the settings fit together, with examples:
[Configuration](configuration.md).
"""

_ONE_SECRET = f"Give exactly one of {', '.join(SECRET_SOURCES)}."


def accepted() -> dict[str, TableReader]:
    """Each table the parser reads, by its name in `Config` ("" for the top level), with
    its reader: `known` is every key the table accepts and what it takes."""
    with recording() as readers:
        parse_config(PROBE, "<reference>")
    return {r.prefix.split("[")[0].split(".")[0]: r for r in readers}


def render() -> str:
    """The reference, in the order the parser reads the tables and their keys."""
    readers = accepted()
    hints = get_type_hints(Config)
    parts = [HEADER]
    for name in readers[""].known:
        kind, cls = _shape(hints[name])
        heading = {"array": f"[[{name}]]", "named": f"[{name}.NAME]"}.get(kind, f"[{name}]")
        parts.append(f"\n## `{heading}`\n\n{meaning(Config, name)}\n\n")
        parts.append("| key | takes | default | meaning |\n| --- | --- | --- | --- |\n")
        defaults = {f.name: f for f in fields(cls)}
        reader = readers[name]
        for key, takes in reader.known.items():
            if name == "keys" and key in SECRET_SOURCES:
                default, doc = "—", f"{SECRET_SOURCES[key]} {_ONE_SECRET}"
            else:
                default, doc = _default(defaults, cls, key), meaning(cls, key)
            cells = (f"`{key}`", takes, default, doc)
            parts.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |\n")
    return "".join(parts)


def _shape(hint: Any) -> tuple[str, type]:
    """A table's settings class, and whether it is one table, an array, or one per name."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is tuple:
        return "array", args[0]
    if origin is Mapping:
        return "named", args[1]
    return "table", hint


def _default(defaults: Mapping[str, Field[Any]], cls: type, key: str) -> str:
    if key not in defaults:
        raise LookupError(f"{cls.__name__} has no field {key!r}, the key the parser reads")
    field = defaults[key]
    if field.default is not MISSING:
        value = field.default
    elif field.default_factory is not MISSING:
        value = field.default_factory()
    else:
        return "—"
    return "unset" if value is None else f"`{_toml(value)}`"


def _toml(value: object) -> str:
    """A default as it would be written in the file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
