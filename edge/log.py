"""Logging: loguru for the edge, with the stdlib loggers of hypercorn and grpclib routed in.

`text` is for a terminal; `json` writes one small JSON object per line (for
journald). Sinks are enqueued so a slow pipe never blocks the trio loop.

`REQUEST_ID` holds the id of the HTTP request the current task serves; every
record logged while it is set carries it as `request_id`. Tasks started from
a request's task (its run) inherit it, since trio copies the context.
"""

from __future__ import annotations

import json
import logging
import sys
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


def _text_format(record: Record) -> str:
    fmt = (
        "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> <level>{level: <7}</level> "
        "<cyan>{name}</cyan> {message}"
    )
    if record["extra"]:
        fmt += " <dim>{extra}</dim>"
    return fmt + "\n{exception}"


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    logger.remove()
    logger.configure(patcher=_bind_request_id)
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
            sys.stderr,
            level=level,
            format=_text_format,
            enqueue=True,
            backtrace=False,
            diagnose=False,
            colorize=None,
        )
    logging.basicConfig(handlers=[InterceptHandler()], level=0, force=True)
    logging.captureWarnings(True)
    # Frame-level debug chatter of h2/hpack/grpclib is never wanted.
    for noisy in ("hpack", "h2", "grpclib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
