"""Bounds on what one log line may carry, whoever sent the values in it.

Log lines quote what clients send (model names, paths, tool types, quoted
errors) and what nodes send (error messages, model lists): values of any size.
A line is bounded here, in one place: `edge.observe.log` passes every record's
message and fields through `bound_message` and `bound_fields` (a loguru
patcher), so no call site can forget to. A value past its bound is cut, with
a marker saying how much was left out (`…(+N chars)`, `…(+N more)`).

The patcher runs after loguru has formatted the message: a call site whose
argument can be large formats `clip(value)` or `clip_join(values)` instead,
so the work done for a line never grows with what a client sent. `Mentions`
keeps the first few of a request's notes (the tools the edge dropped) and
counts the rest, so even the list a line would be made from stays small.

Pure: no loguru, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# One value: a field of a record, an argument of a message.
VALUE_CHARS = 512
# A record's message.
MESSAGE_CHARS = 2048
# Items of a list named in a line (a field's list, `clip_join`, `Mentions`).
ITEMS = 16
# Fields of one record; the rest are counted in `fields_dropped`.
FIELDS = 32
# The last guard: one record's line, without its traceback, in characters
# once written (escaped); and its traceback, after it.
LINE_CHARS = 8192
TRACEBACK_CHARS = 8192
# A string inside a field's list or mapping, and the repr of anything else there.
_ITEM_CHARS = VALUE_CHARS // ITEMS
# A repr shows containers this deep.
_DEPTH = 3


def clip(text: str, limit: int = VALUE_CHARS) -> str:
    """`text`, cut to `limit` characters with `…(+N chars)` saying how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…(+{len(text) - limit} chars)"


def clip_tail(text: str, limit: int) -> str:
    """`text`'s last `limit` characters, after `…(+N chars)` (a traceback's end says most)."""
    if len(text) <= limit:
        return text
    return f"…(+{len(text) - limit} chars){text[-limit:]}"


def clip_join(
    items: Iterable[object], sep: str = ", ", *, count: int = ITEMS, limit: int = VALUE_CHARS
) -> str:
    """The first `count` items (strings clipped to `limit`, anything else a `clip_repr`)
    joined by `sep`, then `…(+N more)` when there were more."""
    shown: list[str] = []
    more = 0
    for item in items:
        if len(shown) < count:
            shown.append(clip(item, limit) if isinstance(item, str) else clip_repr(item, limit))
        else:
            more += 1
    if more:
        shown.append(f"…(+{more} more)")
    return sep.join(shown)


def clip_repr(value: object, limit: int = VALUE_CHARS) -> str:
    """`repr(value)` of a JSON value (what a client's body holds), cut after about
    `limit` characters of it, in work bounded by `limit` too: a long string is cut
    before it is quoted, a list or mapping after the items that fill `limit`, and
    containers are shown a few levels deep."""
    return _repr(value, max(limit, 1), _DEPTH)


def _repr(value: object, limit: int, depth: int) -> str:
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}…(+{len(value) - limit} chars)"
    if isinstance(value, bytes | bytearray):
        if len(value) <= limit:
            return repr(value)
        return f"{bytes(value[:limit])!r}…(+{len(value) - limit} bytes)"
    if value is None or isinstance(value, bool | float):
        return repr(value)
    if isinstance(value, int):
        # A huge int's digits cost time to write (and past 4,300 digits, an error).
        return repr(value) if value.bit_length() <= 64 else f"int({value.bit_length()} bits)"
    if isinstance(value, list | tuple | dict):
        if depth == 0:
            return f"{type(value).__name__}({len(value)})"
        items = value.items() if isinstance(value, dict) else value
        parts: list[str] = []
        used = 0
        for item in items:
            if used >= limit:
                break
            left = limit - used
            if isinstance(value, dict):
                key, inner = item
                part = f"{_repr(key, left, depth - 1)}: {_repr(inner, left, depth - 1)}"
            else:
                part = _repr(item, left, depth - 1)
            parts.append(part)
            used += len(part) + 2
        if len(parts) < len(value):
            parts.append(f"…(+{len(value) - len(parts)} more)")
        opened, closed = ("{", "}") if isinstance(value, dict) else ("[", "]")
        return opened + ", ".join(parts) + closed
    if isinstance(value, Mapping | Sequence | set | frozenset):
        return f"{type(value).__name__}({len(value)})"
    return clip(_safe_str(value), limit)


def _first(items: Iterable[Any], n: int) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if len(out) == n:
            break
        out.append(item)
    return out


def _safe_str(value: object) -> str:
    try:
        return str(value)
    except Exception:  # a value that cannot say what it is must not lose the line
        return f"<{type(value).__name__}>"


def bound_message(message: str) -> str:
    """A record's message, at most MESSAGE_CHARS (and the marker)."""
    return clip(message, MESSAGE_CHARS)


def bound_fields(extra: dict[str, Any]) -> None:
    """Bound a record's fields in place: at most FIELDS of them (then `fields_dropped`
    says how many more), every value as `bound_value` makes it."""
    if len(extra) > FIELDS:
        kept = dict(_first(extra.items(), FIELDS))
        dropped = len(extra) - FIELDS
        extra.clear()
        extra.update(kept)
        extra["fields_dropped"] = dropped
    for key, value in extra.items():
        if not _small(value):
            extra[key] = bound_value(value)


def _small(value: object) -> bool:
    """Values that need no work: most fields are these."""
    if isinstance(value, str):
        return len(value) <= VALUE_CHARS
    if isinstance(value, int):
        return value.bit_length() <= 64
    return value is None or isinstance(value, float)


def bound_value(value: object) -> object:
    """`value` as a field may hold it, bounded: a string clipped, a list or mapping
    cut to ITEMS items that are themselves small (strings of _ITEM_CHARS, anything
    else as a clipped repr), numbers kept, anything else a clipped `str`."""
    if isinstance(value, str):
        return clip(value)
    if _small(value):
        return value
    if isinstance(value, Mapping):
        out: dict[str, object] = {
            clip(k if isinstance(k, str) else _safe_str(k), _ITEM_CHARS): _item(v)
            for k, v in _first(value.items(), ITEMS)
        }
        if len(value) > ITEMS:
            out["…"] = f"+{len(value) - ITEMS} more"
        return out
    if isinstance(value, list | tuple | set | frozenset):
        items = [_item(v) for v in _first(value, ITEMS)]
        if len(value) > ITEMS:
            items.append(f"…(+{len(value) - ITEMS} more)")
        return items
    return clip_repr(value)


def _item(value: object) -> object:
    if isinstance(value, str):
        return clip(value, _ITEM_CHARS)
    return value if _small(value) else clip_repr(value, _ITEM_CHARS)


class Mentions:
    """The first few notes a request gives a log line, and how many more there were.

    A body can hold a hundred thousand tools the edge drops: the line names the
    first few, each note clipped (and its client values `clip_repr`ed by its
    writer), and counts the rest, so the notes kept never grow with the body.
    """

    __slots__ = ("_more", "_notes")

    def __init__(self) -> None:
        self._notes: list[str] = []
        self._more = 0

    def add(self, note: str) -> None:
        if len(self._notes) < ITEMS:
            self._notes.append(clip(note))
        else:
            self._more += 1

    def __bool__(self) -> bool:
        return bool(self._notes)

    def notes(self) -> tuple[str, ...]:
        """At most ITEMS: the notes kept, the last of them `…(+N more)` when there were more."""
        if self._more:
            return (*self._notes[:-1], f"…(+{self._more + 1} more)")
        return tuple(self._notes)
