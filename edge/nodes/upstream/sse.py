"""Server-sent events from a response body that arrives in arbitrary pieces.

`SSEDecoder` is a sans-IO parser in the h11 manner: `feed(text)` with the
body split anywhere (even inside a `\r\n`), `close()` when it ends; the same
body whole or character by character gives the same events.

It knows the SSE framing only: not what the data means, nor where it came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = ["DONE", "MAX_LINE_CHARS", "SSEDecoder", "SSEMessage"]

DONE: Final = "[DONE]"
# A line longer than this (no line break in sight) is not an SSE stream.
MAX_LINE_CHARS: Final = 8 * 1024 * 1024
_LINE_BREAK: Final = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class SSEMessage:
    """One server-sent event: its `event` name ("" = message) and its data."""

    data: str
    event: str = ""


class SSEDecoder:
    """Incremental SSE parser: `feed(text)` in any split, `close()` at the end of the body.

    Standard framing (data lines joined, dispatched on a blank line, comments
    skipped), plus one tolerance: a single data line that is `[DONE]` or a whole
    JSON object is dispatched at once, so a server that omits blank lines
    between events still works.
    """

    __slots__ = ("_buffer", "_data", "_data_chars", "_event", "_pieces", "_pieces_chars")

    def __init__(self) -> None:
        self._buffer = ""
        # A line still without its break, in pieces: joined once, when it ends
        # (a long line costs its length, not its length times its pieces).
        self._pieces: list[str] = []
        self._pieces_chars = 0
        self._data: list[str] = []
        self._data_chars = 0
        self._event = ""

    @property
    def pending_chars(self) -> int:
        """Characters held for events not dispatched yet: what the next `feed` may parse
        on top of its own text."""
        return len(self._buffer) + self._pieces_chars + self._data_chars

    def feed(self, text: str) -> list[SSEMessage]:
        if "\n" not in text and "\r" not in text:
            self._pieces.append(text)
            self._pieces_chars += len(text)
            if len(self._buffer) + self._pieces_chars > MAX_LINE_CHARS:
                raise ValueError(f"upstream sent a line of over {MAX_LINE_CHARS} characters")
            return []
        buffer = self._buffer + "".join(self._pieces) + text
        self._pieces.clear()
        self._pieces_chars = 0
        held = ""
        if buffer.endswith("\r"):  # maybe the first half of "\r\n"
            buffer, held = buffer[:-1], "\r"
        lines = _LINE_BREAK.split(buffer)
        self._buffer = lines.pop() + held
        if len(self._buffer) > MAX_LINE_CHARS:
            raise ValueError(f"upstream sent a line of over {MAX_LINE_CHARS} characters")
        out: list[SSEMessage] = []
        for line in lines:
            self._line(line, out)
        return out

    def close(self) -> list[SSEMessage]:
        """The events still held when the body ends (a last line without a break)."""
        out: list[SSEMessage] = []
        last = (self._buffer + "".join(self._pieces)).strip("\r")
        if last:
            self._line(last, out)
        self._buffer = ""
        self._pieces.clear()
        self._pieces_chars = 0
        self._dispatch(out)
        return out

    def _line(self, line: str, out: list[SSEMessage]) -> None:
        if not line:
            self._dispatch(out)
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            if not self._data and (
                value == DONE or (value.startswith("{") and value.endswith("}"))
            ):
                out.append(SSEMessage(value, self._event))
                self._event = ""
            else:
                self._data.append(value)
                self._data_chars += len(value)
                if self._data_chars > MAX_LINE_CHARS:
                    raise ValueError(f"upstream sent an event of over {MAX_LINE_CHARS} characters")
        elif name == "event":
            self._event = value

    def _dispatch(self, out: list[SSEMessage]) -> None:
        if self._data:
            out.append(SSEMessage("\n".join(self._data), self._event))
        self._data = []
        self._data_chars = 0
        self._event = ""
