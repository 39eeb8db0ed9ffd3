"""The balanced JSON objects a text holds, whatever words stand around them: `json_objects`.

Frameworks wrap what the user wrote in their own words (CrewAI's task and
criteria, DSPy's field markers, an agent's reminders), so a script may sit
inside a longer text. The text is read once, from the start. An object
opens at a `{` followed (after any blanks) by a `"`, the quote of its first
key, so a brace in prose (`{name}`, `{ and }`) opens nothing; it closes at
its matching `}`, braces inside its strings not counted. That balanced text
is parsed as JSON when it names a key the caller looks for (a script's
`events` or `turns`), and the reading goes on after it: an object inside
another is part of it, never one of its own, and an object that does not
parse is passed over whole. An object that never closes ends the reading.

Linear in the text, whatever it holds: the words between objects are
skipped by one regular-expression search, an object's strings by one match
each, its braces counted one by one, and each balanced text searched for the
names, and parsed, at most once (no two overlap).

Pure: text in, values out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Where an object with a key may start: a brace, then (after any blanks) a quote.
_OPEN = re.compile(r'\{\s*"')
# Inside an object: a brace, or a whole string (to its closing quote, or to the end of
# the text when it has none); possessive, so a string that never closes is read once.
_TOKEN = re.compile(r'[{}]|"(?:[^"\\]++|\\.)*+"?', re.DOTALL)


@dataclass(frozen=True, slots=True)
class Found:
    """A balanced object a text holds, `text[start:end]`: its value, or why it is not JSON
    (`error`; the value is then None)."""

    value: Any
    error: str | None
    start: int
    end: int


def json_objects(text: str, naming: tuple[str, ...]) -> Iterator[Found]:
    """The balanced objects `text` holds that name one of `naming` (hold it as a quoted
    string: a key, most likely), left to right (see the module doc); the others are
    passed over unparsed."""
    quoted = tuple(f'"{name}"' for name in naming)
    pos = 0
    while (opening := _OPEN.search(text, pos)) is not None:
        start = opening.start()
        end = _closing(text, start)
        if end is None:
            return
        pos = end
        if not any(text.find(name, start, end) >= 0 for name in quoted):
            continue
        try:
            value = json.loads(text[start:end])
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser
            yield Found(None, str(exc) or type(exc).__name__, start, end)
        else:
            yield Found(value, None, start, end)


def _closing(text: str, start: int) -> int | None:
    """Where the object opened at `start` ends (after its matching `}`), or None when it
    never does."""
    depth = 0
    for token in _TOKEN.finditer(text, start):
        char = text[token.start()]  # a brace, or a string's opening quote
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return token.end()
    return None
