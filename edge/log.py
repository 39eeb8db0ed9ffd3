"""Logging: loguru for the edge, with the stdlib loggers of hypercorn and grpclib routed in.

`text` is for a terminal; `json` writes one small JSON object per line (for
journald). Sinks are enqueued so a slow pipe never blocks the trio loop.

Log lines quote what clients send (paths, methods, model names, error
messages). The text sink escapes every control character of the message and
the extra fields (`\\n`, `\\x1b`, ...), so no call site can forget to and no
client can forge a line or send escape sequences to an operator's terminal;
JSON escapes them by construction.

`REQUEST_ID` holds the id of the HTTP request the current task serves; every
record logged while it is set carries it as `request_id`. Tasks started from
a request's task (its run) inherit it, since trio copies the context.

With worker processes (`edge.supervisor`) every record of a worker carries
`worker` (1..N), and the supervisor's records `worker = 0`.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from loguru import logger

if TYPE_CHECKING:
    from loguru import Message, Record

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)


class InterceptHandler(logging.Handler):
    """Route stdlib logging records into loguru."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.opt(depth=6, exception=record.exc_info).log(level, "{}", record.getMessage())


def _bind_request_id(record: Record) -> None:
    request_id = REQUEST_ID.get()
    if request_id is not None:
        record["extra"].setdefault("request_id", request_id)


def _worker_patcher(worker: int) -> Callable[[Record], None]:
    def patch(record: Record) -> None:
        record["extra"].setdefault("worker", worker)
        _bind_request_id(record)

    return patch


def _json_sink(message: Message) -> None:
    record: Record = message.record
    line: dict[str, Any] = {
        "ts": datetime.fromtimestamp(record["time"].timestamp(), tz=UTC).isoformat(),
        "level": record["level"].name,
        "msg": record["message"],
        "logger": record["name"],
    }
    if record["extra"]:
        line.update(record["extra"])
    if record["exception"] is not None:
        # The sink's format is empty: the message is just the formatted traceback.
        line["exception"] = str(message).strip() or str(record["exception"].value)
    sys.stderr.write(json.dumps(line, default=str) + "\n")


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

    def __init__(self, color: bool) -> None:
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
        if record["exception"] is not None:
            # The sink's format is empty: the message is just the formatted
            # traceback. Its line breaks stay; every other control is escaped.
            traceback = str(message).strip() or str(record["exception"].value)
            line += "\n" + "\n".join(escape_controls(t) for t in traceback.split("\n"))
        sys.stderr.write(line + "\n")


def setup_logging(level: str = "INFO", fmt: str = "text", *, worker: int | None = None) -> None:
    """Sinks for `level` and `fmt`; `worker`: the process's worker id (None: one process)."""
    logger.remove()
    logger.configure(patcher=_bind_request_id if worker is None else _worker_patcher(worker))
    if fmt == "json":
        logger.add(
            _json_sink,
            level=level,
            format="",  # loguru appends the formatted traceback, if any
            enqueue=True,
            backtrace=False,
            diagnose=False,
        )
    else:
        logger.add(
            _TextSink(color=sys.stderr.isatty()),
            level=level,
            format="",  # loguru appends the formatted traceback, if any
            enqueue=True,
            backtrace=False,
            diagnose=False,
        )
    logging.basicConfig(handlers=[InterceptHandler()], level=0, force=True)
    logging.captureWarnings(True)
    # Frame-level debug chatter of h2/hpack/grpclib is never wanted.
    for noisy in ("hpack", "h2", "grpclib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
