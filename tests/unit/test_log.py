"""Log lines: no client string can put a control character into one (text escaping),
no value of any size makes one long (edge.observe.logbound), and no reader, however slow, makes
a log call wait (edge.observe.logwriter)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.observe.log import escape_controls
from edge.observe.logbound import (
    FIELDS,
    ITEMS,
    LINE_CHARS,
    MESSAGE_CHARS,
    TRACEBACK_CHARS,
    VALUE_CHARS,
    Mentions,
    bound_fields,
    bound_message,
    clip,
    clip_join,
    clip_repr,
    clip_tail,
)
from edge.observe.logwriter import LineWriter, fd_writer


def test_known_escapes() -> None:
    assert escape_controls("GET /a\nFORGED\x1b[2J\r\t") == "GET /a\\nFORGED\\x1b[2J\\r\\t"
    assert escape_controls("\x85\u2028\u2029\u202e\u2066") == "\\x85\\u2028\\u2029\\u202e\\u2066"
    assert escape_controls("plain text, é, 日本") == "plain text, é, 日本"


@given(st.text())
def test_escaped_text_has_no_control_character(text: str) -> None:
    """Whatever the input, the output is one line with no C0/C1 control, no line or
    paragraph separator and no bidi override; text without those is unchanged."""
    escaped = escape_controls(text)
    assert len(escaped.splitlines()) <= 1
    assert all(_safe(char) for char in escaped)
    if all(_safe(char) for char in text):
        assert escaped == text


def _safe(char: str) -> bool:
    return unicodedata.category(char) != "Cc" and char not in _SEPARATORS_AND_BIDI


_SEPARATORS_AND_BIDI = "\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"


# --- bounds (edge.observe.logbound) -----------------------------------------------------


def test_clip_says_how_much_it_left_out() -> None:
    assert clip("short") == "short"
    assert clip("x" * 600) == "x" * VALUE_CHARS + f"…(+{600 - VALUE_CHARS} chars)"
    assert clip_tail("abcdef", 2) == "…(+4 chars)ef"
    assert clip_join(["a", "b"]) == "a, b"
    joined = clip_join([f"tool{i}" for i in range(100)])
    assert joined.startswith("tool0, tool1")
    assert joined.endswith(f"…(+{100 - ITEMS} more)")
    assert clip_join(iter(["y" * 1000])) == clip("y" * 1000)


def test_clip_repr_of_client_values() -> None:
    assert clip_repr("web_search") == "'web_search'"
    assert clip_repr("\x7f" * 3_900_000, 64) == repr("\x7f" * 64) + f"…(+{3_900_000 - 64} chars)"
    assert clip_repr(None) == "None"
    assert clip_repr(2**80) == "int(81 bits)"
    assert clip_repr(list(range(10_000)), 64).endswith("more)]")
    assert clip_repr([[[[["deep"]]]]]) == "[[[list(1)]]]"


def test_mentions_keep_the_first_notes_and_count_the_rest() -> None:
    mentions = Mentions()
    assert not mentions
    assert mentions.notes() == ()
    for i in range(100_000):
        mentions.add(f"tools[{i}] " + "z" * 10_000)
    notes = mentions.notes()
    assert len(notes) == ITEMS
    assert notes[-1] == f"…(+{100_000 - ITEMS + 1} more)"
    assert clip_join(notes).endswith(notes[-1])  # a line shows every note kept
    assert all(len(note) <= VALUE_CHARS + 20 for note in notes)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=600),
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=40), inner),
    max_leaves=40,
)


def _size(value: object) -> int:
    """Characters a field's value holds, however it is written (repr or JSON)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_size(k) + _size(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_size(v) for v in value)
    return len(repr(value))


@given(st.dictionaries(st.text(max_size=8), _json, max_size=40), st.text(max_size=2100))
def test_every_field_and_the_message_are_bounded(extra: dict[str, Any], message: str) -> None:
    """Whatever a record carries, after the bounds: at most FIELDS fields (+ the count of
    the rest), each field's value small whatever its shape, the message at most
    MESSAGE_CHARS plus the marker; a value that was cut says so; a small value is kept."""
    original = dict(extra)
    bound_fields(extra)
    assert len(extra) <= FIELDS + 1
    if len(original) > FIELDS:
        assert extra["fields_dropped"] == len(original) - FIELDS
    for key, value in extra.items():
        assert _size(value) <= 4 * VALUE_CHARS
        if key == "fields_dropped" and len(original) > FIELDS:
            continue
        before = original[key]
        if isinstance(before, str) and len(before) > VALUE_CHARS:
            assert isinstance(value, str)
            assert value.endswith(" chars)")
            assert "…(+" in value
        elif isinstance(before, str | bool | float | None) or (
            isinstance(before, int) and before.bit_length() <= 64
        ):
            assert value == before or value != value  # NaN is kept as NaN
    bounded = bound_message(message)
    assert len(bounded) <= MESSAGE_CHARS + 20
    assert bounded == message or "…(+" in bounded


def test_lists_and_mappings_in_a_field_are_cut_to_a_few_items() -> None:
    extra: dict[str, Any] = {
        "tools": [f"t{i}" for i in range(1000)],
        "headers": {f"h{i}": "v" * 1000 for i in range(1000)},
        "nested": [[["x" * 10_000] * 100] * 100],
        "obj": Path("p" * 10_000),
    }
    bound_fields(extra)
    assert extra["tools"][:2] == ["t0", "t1"]
    assert extra["tools"][-1] == f"…(+{1000 - ITEMS} more)"
    assert len(extra["tools"]) == ITEMS + 1
    assert len(extra["headers"]) == ITEMS + 1
    assert extra["headers"]["…"] == f"+{1000 - ITEMS} more"
    assert all(len(v) <= 64 for v in extra["headers"].values())
    assert len(extra["nested"]) == 1
    assert len(extra["nested"][0]) < 100
    assert extra["obj"].startswith("p")
    assert extra["obj"].endswith(" chars)")


# --- the writer (edge.observe.logwriter) --------------------------------------------------


class _Pipe:
    """A pipe whose reader the test drives: nothing is read until `read_all`."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.lines: list[bytes] = []
        self._reader: threading.Thread | None = None

    def start_reading(self) -> None:
        def read() -> None:
            with os.fdopen(self.read_fd, "rb") as stream:
                for line in stream:
                    self.lines.append(line)

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def close(self) -> None:
        os.close(self.write_fd)
        if self._reader is not None:
            self._reader.join(10)
        else:
            os.close(self.read_fd)


def test_a_stuck_reader_never_blocks_put_and_drops_are_counted() -> None:
    """With nobody reading the pipe, 20,000 puts all return; what did not fit in the queue
    (and the pipe) is dropped and counted, each drop reported once to `on_drop`; once the
    reader reads, every line kept arrives whole and in order, then one line says how many
    were dropped, and lines put after flow again."""
    pipe = _Pipe()
    notices: list[int] = []
    noticed = threading.Event()
    reported: list[int] = []

    def notice(lines: int) -> None:
        notices.append(lines)
        writer.put(f"dropped {lines}\n")
        noticed.set()

    # A queue larger than the pipe's buffer (64 KiB on Linux): what is queued cannot all
    # fit in the pipe, so the flush below cannot succeed while nobody reads.
    writer = LineWriter(fd_writer(pipe.write_fd), max_bytes=256 * 1024, on_caught_up=notice)
    writer.on_drop = reported.append
    for i in range(20_000):
        writer.put(f"line {i:05} {'x' * 100}\n")
    assert writer.dropped > 10_000
    assert sum(reported) == writer.dropped
    assert not writer.flush(0.05)  # the reader is stuck: the flush gives up
    pipe.start_reading()
    while sum(notices) < writer.dropped:  # at most one notice a second
        assert noticed.wait(30)
        noticed.clear()
    assert writer.flush(30)
    writer.put("after\n")
    assert writer.flush(30)
    writer.stop(10)
    pipe.close()
    kept = [line for line in pipe.lines if line.startswith(b"line ")]
    said = [line for line in pipe.lines if line.startswith(b"dropped ")]
    # A notice put while the queue was full is dropped (and counted) too.
    assert len(kept) + writer.dropped == 20_000 + len(notices) - len(said)
    numbers = [int(line.split()[1]) for line in kept]
    assert numbers == sorted(numbers)
    assert all(line.endswith(b"x\n") and len(line) == 112 for line in kept)
    assert sum(notices) == writer.dropped
    assert pipe.lines[-1] == b"after\n"
    assert said


def test_a_reader_that_went_away_drops_lines_without_blocking() -> None:
    """EPIPE (the reader closed its end): lines are dropped and counted, put never raises."""
    pipe = _Pipe()
    os.close(pipe.read_fd)
    writer = LineWriter(fd_writer(pipe.write_fd), max_bytes=64 * 1024)
    for i in range(100):
        writer.put(f"line {i}\n")
    writer.flush(30)
    assert writer.dropped == 100
    writer.stop(10)
    os.close(pipe.write_fd)


def test_lines_of_a_write_are_whole_and_at_most_pipe_buf_together() -> None:
    """Lines are written in chunks of whole lines of at most PIPE_BUF bytes (a longer
    line alone), so lines of processes sharing the pipe never interleave."""
    chunks: list[bytes] = []
    gate = threading.Event()

    def write(data: bytes) -> None:
        gate.wait(30)
        chunks.append(data)

    writer = LineWriter(write, max_bytes=4 * 1024 * 1024)
    lines = [f"{i} {'y' * (i * 37 % 9000)}\n" for i in range(300)]
    for line in lines:
        writer.put(line)
    gate.set()
    assert writer.flush(30)
    writer.stop(10)
    assert b"".join(chunks) == "".join(lines).encode()
    for chunk in chunks:
        assert chunk.endswith(b"\n")
        assert len(chunk) <= select.PIPE_BUF or chunk.count(b"\n") == 1


# --- the sinks, in a process of their own ----------------------------------------


_LOG_SCRIPT = """
import sys
from loguru import logger
from edge.observe.log import setup_logging
setup_logging("INFO", sys.argv[1])
huge = "\\x7f" * 3_900_000
logger.bind(model=huge, tools=[huge] * 1000, path="/v1/" + huge).info("not used: {}", huge)
logger.bind(**{f"f{i}": "v" * 10 for i in range(100)}).info("many fields")
logger.bind(**{f"f{i}": "w" * 600 for i in range(100)}).info("long fields")
try:
    raise ValueError(huge)
except ValueError:
    logger.exception("failed: {}", "\\x1b" * 100_000)
logger.info("done")
"""


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_record_of_any_size_writes_a_bounded_line(fmt: str) -> None:
    """A record whose message, fields, lists and traceback hold megabytes of a client's
    text writes lines of at most LINE_CHARS + TRACEBACK_CHARS (json: valid JSON), with
    markers saying what was cut, and every record is written (the exit flushes)."""
    done = subprocess.run(
        [sys.executable, "-c", _LOG_SCRIPT, fmt], capture_output=True, timeout=60, check=True
    )
    text = done.stderr.decode()
    assert len(text) < 4 * (LINE_CHARS + TRACEBACK_CHARS)
    if fmt == "json":
        records = [json.loads(line) for line in text.splitlines()]
        assert [r["msg"][:6] for r in records] == ["not us", "many f", "long f", "failed", "done"]
        for line in text.splitlines():
            assert len(line) <= LINE_CHARS + TRACEBACK_CHARS
        first = records[0]
        assert "…(+" in first["msg"] or "line_chars" in first
        assert records[1]["fields_dropped"] == 100 - FIELDS
        assert records[2]["line_chars"] > LINE_CHARS  # 32 fields of 512 characters: cut
        assert records[3]["exception"].rstrip().endswith(" chars)")
    else:
        assert text.count("\n") >= 5
        assert "…(+" in text
        assert text.splitlines()[-1].endswith("done")
        assert all(len(line) <= LINE_CHARS + 20 for line in text.splitlines())


_CHATTER_SCRIPT = """
import logging
from edge.observe.log import setup_logging
setup_logging("DEBUG", "text")
quiet = ("h2", "hpack", "grpclib", "httpcore.connection", "httpcore.http11")
print(all(not logging.getLogger(n).isEnabledFor(logging.INFO) for n in quiet))
print(logging.getLogger("quart.app").isEnabledFor(logging.DEBUG))
"""


def test_library_step_chatter_is_off_even_at_debug() -> None:
    """Per-frame (h2, hpack, grpclib) and per-request-step (httpcore: iop-node's
    upstream calls) debug records are not even created, whatever the edge's level; other
    libraries' records reach the sink at its level."""
    done = subprocess.run(
        [sys.executable, "-c", _CHATTER_SCRIPT], capture_output=True, timeout=60, check=True
    )
    assert done.stdout.decode().split() == ["True", "True"]
