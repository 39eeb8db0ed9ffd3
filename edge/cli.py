"""`iop-edge`: command line -> config -> logging -> trio.run(daemon), and its signals.

Signals: SIGTERM and SIGINT drain (a second one exits at once). SIGHUP,
SIGUSR1 and SIGUSR2, whose default action would end the process on the spot
(no drain, no CancelRun), are logged and otherwise ignored: the edge has no
reload, and a stray `kill -HUP` or a closed terminal must not cut streams.
SIGPIPE stays ignored as Python sets it at start: a write to a socket the
peer closed fails for that connection only.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import replace
from functools import partial
from pathlib import Path

import trio
from loguru import logger

from edge.config import (
    Config,
    ConfigError,
    LogConfig,
    NodeConfig,
    ServerConfig,
    check_node_address,
    load_config,
    split_address,
)
from edge.log import setup_logging

DEFAULT_CONFIG = Path("config.toml")
# After the drain deadline: time for the notices and the CancelRuns to go out.
HARD_STOP_GRACE_S = 15.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
IGNORED_SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _address(value: str) -> str:
    try:
        split_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _node_address(value: str) -> str:
    """HOST:PORT of a node, or openai+http(s)://HOST:PORT/v1 of a model server."""
    try:
        check_node_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iop-edge", description="OpenAI-compatible chat completions in front of nodes."
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="TOML config file (default ./config.toml; missing = built-in defaults)",
    )
    parser.add_argument("--listen", type=_address, help="HOST:PORT to serve HTTP on")
    parser.add_argument(
        "--node",
        action="append",
        type=_node_address,
        default=None,
        metavar="HOST:PORT",
        help="a node to use, or openai+http://HOST:PORT/v1 (repeatable; replaces [[nodes]])",
    )
    parser.add_argument("--log-level", choices=["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", choices=["text", "json"])
    parser.add_argument("--runs-log", type=Path, help="runs log of embedded simulated nodes")
    return parser


def resolve_config(args: argparse.Namespace) -> Config:
    """The config file (if any), with command-line flags on top."""
    if args.config is not None:  # named: it must exist
        config = load_config(args.config)
    elif DEFAULT_CONFIG.exists():
        config = load_config(DEFAULT_CONFIG)
    else:
        config = Config()
    server = config.server
    if args.listen:
        server = replace(server, listen=args.listen)
    log = LogConfig(
        level=args.log_level or config.log.level, format=args.log_format or config.log.format
    )
    nodes = config.nodes
    if args.node:
        nodes = tuple(NodeConfig(name=a, address=a) for a in args.node)
    return replace(config, server=server, log=log, nodes=nodes)


def _exit_now(code: int) -> None:
    """Leave at once: a client that stopped reading can hold a shielded socket
    write (hypercorn's) forever, so no graceful path is guaranteed to end."""
    logger.complete()
    os._exit(code)


async def _signals(shutdown: trio.Event, hard_stop_s: float) -> None:
    with trio.open_signal_receiver(*STOP_SIGNALS, *IGNORED_SIGNALS) as signals:
        async for signum in signals:
            if signum in IGNORED_SIGNALS:
                logger.info(
                    "{}: ignored (there is no reload; SIGTERM drains and stops)",
                    signal.Signals(signum).name,
                )
                continue
            if shutdown.is_set():
                logger.warning("second signal: exiting now")
                _exit_now(1)
            logger.info("{}: draining", signal.Signals(signum).name)
            shutdown.set()
            # Past the drain and the grace for closing, stop whatever still holds on.
            timer = threading.Timer(hard_stop_s, _hard_stop, args=(hard_stop_s,))
            timer.daemon = True
            timer.start()


def _hard_stop(after_s: float) -> None:
    logger.error("still running {}s after the shutdown signal: exiting", after_s)
    _exit_now(1)


def _ignore_signals() -> None:
    """Until the daemon's receiver takes them over (and after it), these do nothing."""
    for signum in IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    _ignore_signals()
    args = build_parser().parse_args(argv)
    try:
        config = resolve_config(args)
    except ConfigError as exc:
        print(f"iop-edge: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log.level, config.log.format)
    from edge.daemon import run_forever

    try:
        hard_stop_s = config.server.drain_timeout_s + HARD_STOP_GRACE_S
        run_forever(config, partial(_signals, hard_stop_s=hard_stop_s), runs_log=args.runs_log)
    except KeyboardInterrupt:
        return 130
    except BaseExceptionGroup as group:
        refused = group.subgroup(OSError)
        if refused is not None:  # the listen address is taken, or not ours to bind
            error = refused.exceptions[0]
            while isinstance(error, BaseExceptionGroup):
                error = error.exceptions[0]
            print(f"iop-edge: cannot listen on {config.server.listen}: {error}", file=sys.stderr)
            return 1
        if group.subgroup(SystemExit) is None:
            raise
        return 1
    return 0


__all__ = ["ServerConfig", "main"]
