"""Logging: loguru for the edge, with the stdlib loggers of hypercorn and grpclib routed in.

`text` is for a terminal; `json` writes one small JSON object per line (for
journald). Each line is formatted where it is logged and handed to one
writer thread through a queue bounded in bytes (`edge.observe.logwriter`,
`[log] queue_bytes`): a slow or stuck reader of stderr never blocks the trio
loop; lines that do not fit are dropped and counted
(`iop_edge_log_lines_dropped_total`, wired by `count_dropped_lines`), and a
line says how many once the writer is writing again. At exit the queue is
flushed, waiting at most FLUSH_AT_EXIT_S for a reader that is stuck.

Every record is bounded whatever its call site logs (`edge.observe.logbound`, applied
by the patcher): its message, each of its fields, their lists, their number,
and last the whole line and its traceback. A call site whose argument may be
large (a client's value, a node's message) formats `clip(value)` instead, so
that formatting the message never grows with it either.

Log lines quote what clients send (paths, methods, model names, error
messages). The text sink escapes every control character of the message and
the extra fields (`\\n`, `\\x1b`, ...), so no call site can forget to and no
client can forge a line or send escape sequences to an operator's terminal;
JSON escapes them by construction.

`REQUEST_ID` holds the id of the HTTP request the current task serves; every
record logged while it is set carries it as `request_id`. Tasks started from
a request's task (its run) inherit it, since trio copies the context.

With worker processes (`edge.process.supervisor`) every record of a worker carries
`worker` (1..N), and the supervisor's records `worker = 0`.
"""

from __future__ import annotations

import atexit
import json
import logging
import re
import sys
from collections.abc import Callable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from loguru import logger

from edge.observe.logbound import (
    LINE_CHARS,
    TRACEBACK_CHARS,
    VALUE_CHARS,
    bound_fields,
    bound_message,
    clip,
    clip_tail,
)
from edge.observe.logwriter import LineWriter, fd_writer

if TYPE_CHECKING:
    from loguru import Message, Record

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)

# The writer's queue (`[log] queue_bytes`): lines that do not fit are dropped.
QUEUE_BYTES = 1024 * 1024
# At a normal exit, the lines still queued are written: a stuck reader gets this long.
FLUSH_AT_EXIT_S = 5.0


class InterceptHandler(logging.Handler):
    """Route stdlib logging records into loguru."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.opt(depth=6, exception=record.exc_info).log(level, "{}", record.getMessage())


def _patch(record: Record) -> None:
    """The request id of the task that logs, then the bounds."""
    request_id = REQUEST_ID.get()
    if request_id is not None:
        record["extra"].setdefault("request_id", request_id)
    _bound(record)


def _bound(record: Record) -> None:
    """Every record's message and fields bounded (`edge.observe.logbound`), whoever logged it."""
    record["message"] = bound_message(record["message"])
    if record["extra"]:
        bound_fields(record["extra"])


def _worker_patcher(worker: int) -> Callable[[Record], None]:
    def patch(record: Record) -> None:
        record["extra"].setdefault("worker", worker)
        _patch(record)

    return patch


def _traceback(message: Message, record: Record) -> str:
    """The record's traceback (the sink's format is empty: the message is just the
    formatted traceback), each line and the whole bounded: its end is kept."""
    assert record["exception"] is not None
    text = str(message).strip() or str(record["exception"].value)
    if len(text) <= TRACEBACK_CHARS:
        return text
    text = "\n".join(clip(line, VALUE_CHARS) for line in text.split("\n"))
    return clip_tail(text, TRACEBACK_CHARS)


class _JsonSink:
    """One JSON object per line: ts, level, msg, logger, the fields, the traceback."""

    def __init__(self, writer: LineWriter) -> None:
        self.writer = writer

    def __call__(self, message: Message) -> None:
        record: Record = message.record
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record["time"].timestamp(), tz=UTC).isoformat(),
            "level": record["level"].name,
            "msg": record["message"],
            "logger": record["name"],
        }
        if record["extra"]:
            line.update(record["extra"])
        bound = LINE_CHARS
        if record["exception"] is not None:
            line["exception"] = _traceback(message, record)
            bound += TRACEBACK_CHARS
        text = json.dumps(line, default=str)
        if len(text) > bound:
            text = json.dumps(_cut(line, len(text)), default=str)
        self.writer.put(text + "\n")


def _cut(line: dict[str, Any], length: int) -> dict[str, Any]:
    """The last guard: a line longer than its bound once escaped (controls escape to six
    characters each) keeps its few small fields and a short message."""
    kept: dict[str, Any] = {
        k: line[k] for k in ("ts", "level", "logger", "request_id", "worker") if k in line
    }
    kept["msg"] = clip(line["msg"], LINE_CHARS // 8)
    kept["line_chars"] = length
    if "exception" in line:
        kept["exception"] = clip_tail(line["exception"], TRACEBACK_CHARS // 8)
    return kept


def _escape_one(code: int) -> str:
    return {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}.get(code) or (
        f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    )


# C0 controls, DEL and C1 controls (ESC, CR, LF, NEL among them), the Unicode
# line and paragraph separators, and the bidirectional overrides and isolates
# that make a terminal show text in another order than it was written.
_UNSAFE = (
    *range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029,
    *range(0x202A, 0x202F), *range(0x2066, 0x206A),
)  # fmt: skip
_ESCAPES = {code: _escape_one(code) for code in _UNSAFE}
_HAS_UNSAFE = re.compile("[" + "".join(re.escape(chr(code)) for code in _UNSAFE) + "]")


def escape_controls(text: str) -> str:
    """`text` with every unsafe character written as a visible escape; linear.

    Most lines hold none: one regex scan finds that, and they are returned as is.
    """
    if _HAS_UNSAFE.search(text) is None:
        return text
    return text.translate(_ESCAPES)


_RESET = "\x1b[0m"
_LEVEL_COLORS = {
    "TRACE": "\x1b[1;36m",
    "DEBUG": "\x1b[1;34m",
    "INFO": "\x1b[1m",
    "SUCCESS": "\x1b[1;32m",
    "WARNING": "\x1b[1;33m",
    "ERROR": "\x1b[1;31m",
    "CRITICAL": "\x1b[1;41m",
}


class _TextSink:
    """One line per record: time, level, logger, message, extra fields; escaped.

    A sink of our own rather than a loguru format string: the message and the
    extra fields must be escaped after formatting, and the colors (when
    stderr is a terminal) must come from us, never from logged text.
    """

    def __init__(self, writer: LineWriter, color: bool) -> None:
        self.writer = writer
        self.color = color

    def __call__(self, message: Message) -> None:
        record: Record = message.record
        stamp = record["time"].strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        level = record["level"].name
        name = escape_controls(str(record["name"]))
        text = escape_controls(record["message"])
        extra = escape_controls(repr(record["extra"])) if record["extra"] else ""
        if self.color:
            color = _LEVEL_COLORS.get(level, "")
            line = (
                f"\x1b[32m{stamp}{_RESET} {color}{level: <7}{_RESET} \x1b[36m{name}{_RESET} {text}"
                + (f" \x1b[2m{extra}{_RESET}" if extra else "")
            )
        else:
            line = f"{stamp} {level: <7} {name} {text}" + (f" {extra}" if extra else "")
        line = clip(line, LINE_CHARS)
        if record["exception"] is not None:
            # Its line breaks stay; every other control is escaped.
            traceback = _traceback(message, record)
            escaped = "\n".join(escape_controls(t) for t in traceback.split("\n"))
            line += "\n" + clip_tail(escaped, TRACEBACK_CHARS)
        self.writer.put(line + "\n")


_writer: LineWriter | None = None
# The one sink (`setup_logging`) and its handler id: `set_level` adds it again.
_sink: Callable[[Message], None] | None = None
_sink_id: int | None = None


def setup_logging(
    level: str = "INFO",
    fmt: str = "text",
    *,
    worker: int | None = None,
    queue_bytes: int = QUEUE_BYTES,
) -> None:
    """Sinks for `level` and `fmt`; `worker`: the process's worker id (None: one process)."""
    global _writer, _sink, _sink_id
    logger.remove()
    if _writer is not None:
        _writer.stop(FLUSH_AT_EXIT_S)
    else:
        atexit.register(flush_logs)
    logger.configure(patcher=_patch if worker is None else _worker_patcher(worker))
    _writer = LineWriter(_stderr_writer(), max_bytes=queue_bytes, on_caught_up=_say_dropped)
    _sink = _JsonSink(_writer) if fmt == "json" else _TextSink(_writer, color=sys.stderr.isatty())
    _sink_id = _add_sink(_sink, level)
    logging.basicConfig(handlers=[InterceptHandler()], level=0, force=True)
    logging.captureWarnings(True)
    # Frame-level debug chatter of h2/hpack/grpclib, and httpcore's trace of each
    # request's steps (iop-node's upstream calls), is never wanted: below WARNING it
    # costs a record per step only for the sink to drop it.
    for noisy in ("hpack", "h2", "grpclib", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _add_sink(sink: Callable[[Message], None], level: str) -> int:
    return logger.add(
        sink,
        level=level,
        format="",  # loguru appends the formatted traceback, if any
        backtrace=False,
        diagnose=False,
    )


def set_level(level: str) -> None:
    """Log from `level` on (a reload's `[log] level`): the sink is added again with it.
    Nothing when logging was never set up (an edge inside a test)."""
    global _sink_id
    if _sink is None or _sink_id is None:
        return
    logger.remove(_sink_id)
    _sink_id = _add_sink(_sink, level)


def _stderr_writer() -> Callable[[bytes], None]:
    """Writes to stderr's descriptor: no Python-level lock the writer could hold while
    blocked (the interpreter's exit flushes sys.stderr under its lock)."""
    stream = sys.stderr
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)

        def write(data: bytes) -> None:
            stream.write(data.decode())
            stream.flush()

        return write
    stream.flush()
    return fd_writer(fd)


def _say_dropped(lines: int) -> None:
    logger.warning("{} log lines dropped: the reader of the log was too slow", lines)


def count_dropped_lines(inc: Callable[[int], object]) -> None:
    """Count every log line dropped from now on with `inc(n)` (a metric's `inc`), and the
    ones dropped so far. Called on the thread that dropped them: it must not block."""
    writer = _writer
    if writer is None:  # logging was never set up: lines are written as logged
        return
    writer.on_drop = inc
    if writer.dropped:
        inc(writer.dropped)


def flush_logs(timeout_s: float = FLUSH_AT_EXIT_S) -> bool:
    """Write the lines still queued, waiting at most `timeout_s`; whether all were."""
    writer = _writer
    return True if writer is None else writer.flush(timeout_s)
