"""The bytes a parsed request holds: its objects, counted one by one, as CPython sizes them.

What a parsed request holds in memory, estimated in bytes: one walk over its values.

Owns the estimate the memory budget (`edge.fleet.admission.Admission.hold`) charges a request
for while it is queued and running. Knows nothing of HTTP, nodes or the budget.

A request body's bytes are a poor measure of what it costs once parsed: a 4 MB body
of tiny content parts or empty JSON containers holds 10-25 times its size as Python
objects (a dict is 184 bytes, a str 49 plus its characters, an object a few words
per field). So the budget charges what the parse built: `footprint` walks it (the
frozen dataclasses of `edge.api.request`, the JSON values passed through: dicts,
lists, strings, numbers) and adds up `sys.getsizeof` of each object, which counts
the object's own memory and its garbage-collector header.

What it does not see: sharing between objects, other than an object repeated in one
tuple (counted once: equal content parts share one object) and the singletons None,
True and False (counted as nothing). Dict keys are counted in full, although msgspec
shares short ones between the dicts it decodes. So it errs high, never far:
`tests/unit/test_footprint.py` holds it against tracemalloc, between 1 and 2 times
what the parse holds for bodies heavy in small parts, in empty containers and in text.

The walk is linear in the objects (no recursion, so no depth limit applies to it)
and runs where the parse runs, off the event loop.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

# Field names of each dataclass met, looked up once per type.
_FIELDS: dict[type, tuple[str, ...]] = {}


def footprint(value: object) -> int:
    """The bytes `value` and everything it refers to hold (see the module doc)."""
    sizeof = sys.getsizeof
    total = 0
    stack: list[Any] = [value]
    pop = stack.pop
    push = stack.append
    extend = stack.extend
    while stack:
        item = pop()
        if item is None or item is True or item is False:
            continue
        kind = type(item)
        total += sizeof(item)
        if kind is str or kind is int or kind is float or kind is bytes:
            continue
        if kind is dict:
            extend(item.keys())
            extend(item.values())
        elif kind is list:
            extend(item)
        elif kind is tuple:
            # Equal parts of one message share one object (edge.api.request): once.
            extend({id(x): x for x in item}.values() if len(item) > 1 else item)
        elif dataclasses.is_dataclass(item):
            names = _FIELDS.get(kind)
            if names is None:
                names = _FIELDS[kind] = tuple(f.name for f in dataclasses.fields(item))
            for name in names:
                push(getattr(item, name))
    return total
