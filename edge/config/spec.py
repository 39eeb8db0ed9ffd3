"""What a key of the configuration file is, said once: on the settings field it sets.

A field of a settings dataclass is a key of the file when its `metadata` has a `doc`:
its meaning, one line of docs/config-reference.md. The field's name is the key, its type
what the key takes (a boolean, a string, an integer, a number, a list of strings; None
allowed: unset), its default the key's. The metadata may bound it further:

- `min`, `max`: the range of an integer or a number (the reader's own when left out);
- `choices`: the strings a string key accepts;
- `number`: an integer setting the file may write as any number (it is truncated);
- `takes`: the key is read as TOML gives it, for a check of the parser to make it the
  setting; `takes` says what it accepts.

`setting()` writes such a field; a layer below writes the same dict itself
(`TracingConfig` in `edge.observe.tracing`). `read_settings`, `read_keys` and `read_key`
read keys by their fields, through a `TableReader` (types, ranges and unknown keys, with
its messages); `meaning` is a field's doc, for the reference.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, Field, field, fields, replace
from functools import cache
from typing import (
    TYPE_CHECKING,
    Any,
    TypedDict,
    TypeVar,
    Union,
    Unpack,
    get_args,
    get_origin,
    get_type_hints,
)

from edge.config.toml import TableReader

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T")
_S = TypeVar("_S", bound="DataclassInstance")
# A check of one key, run right after it is read: (reader, key, value) -> the setting.
Check = Callable[[TableReader, str, Any], Any]
# A default not given: the field's own.
_MISSING: Any = object()


class Bounds(TypedDict, total=False):
    """What a key's metadata may add to its doc: its bounds, its choices, a number
    written any way (`number`), or a value read raw for a check of its own (`takes`)."""

    min: float
    max: float
    choices: tuple[str, ...]
    number: bool
    takes: str


def setting(default: _T, doc: str, **bounds: Unpack[Bounds]) -> _T:
    """A settings field that is a key of the file: its default, its meaning, its bounds."""
    return field(default=default, metadata=about(doc, **bounds))


def about(doc: str, **bounds: Unpack[Bounds]) -> dict[str, object]:
    """The metadata of a key (for a field with a default factory, or without a default)."""
    return {"doc": doc, **{name: value for name, value in bounds.items() if value is not False}}


def meaning(cls: type, key: str) -> str:
    """The doc of the key `key` of the settings `cls`; LookupError when it has none."""
    return str(_key(cls, key).metadata["doc"])


def read_settings(
    r: TableReader, cls: type[_S], base: _S | None = None, checks: Mapping[str, Check] | None = None
) -> _S:
    """The settings `cls` of the table `r`: every key of `cls`, in field order; a key left
    out keeps `base`'s value (default: the field's default). `checks` run after their key."""
    base = cls() if base is None else base
    return replace(base, **read_keys(r, cls, base, checks=checks))


def read_keys(
    r: TableReader,
    cls: type,
    base: object = None,
    *,
    skip: Collection[str] = (),
    checks: Mapping[str, Check] | None = None,
) -> dict[str, Any]:
    """The keys of `cls` but `skip`, in field order, by their field names; a key left out
    is `base`'s value, else its field's default (None when it has none)."""
    values: dict[str, Any] = {}
    for name in _keys(cls):
        if name not in skip:
            default = getattr(base, name) if base is not None else _MISSING
            values[name] = read_key(r, cls, name, default)
            if checks is not None and name in checks:
                values[name] = checks[name](r, name, values[name])
    return values


def read_key(r: TableReader, cls: type, key: str, default: Any = _MISSING) -> Any:
    """The key `key` of the table `r`, as the field of `cls` named so says; left out:
    `default` when given, else its field's default (None when it has none)."""
    found = _key(cls, key)
    if default is _MISSING:
        default = None if found.default is MISSING else found.default
    meta = found.metadata
    if "takes" in meta:
        given = r.raw(key, meta["takes"])
        return default if given is None else given
    if "choices" in meta:
        return r.choice(key, default, meta["choices"])
    kind = _kind(_hints(cls)[key])
    bounds = {arg: meta[k] for k, arg in (("min", "minimum"), ("max", "maximum")) if k in meta}
    if kind is bool or kind is str:
        return r.get(key, kind, default)
    if kind is int and meta.get("number"):
        number = r.number(key, default, **bounds)
        return None if number is None else int(number)
    if kind is int:
        return r.integer(key, default, **bounds)
    if kind is float:
        return r.number(key, default, **bounds)
    if kind == tuple[str, ...]:
        return r.strings(key, default)
    raise TypeError(f"{cls.__name__}.{key}: no reader for a {kind}")


@cache
def _keys(cls: type) -> dict[str, Field[Any]]:
    """The fields of `cls` that are keys of the file, in order."""
    return {f.name: f for f in fields(cls) if "doc" in f.metadata}


def _key(cls: type, key: str) -> Field[Any]:
    """The field of `cls` that is the key `key`; LookupError when there is none."""
    found = _keys(cls).get(key)
    if found is None:
        raise LookupError(f"{cls.__name__}.{key}: not a key of the file (no doc in its metadata)")
    return found


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _kind(hint: Any) -> Any:
    """A field's type without its None: `int | None` is read as an int."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint
