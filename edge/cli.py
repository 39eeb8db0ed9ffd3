"""`iop-edge`: command line -> config -> logging -> trio.run(daemon)."""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import replace
from pathlib import Path

import trio
from loguru import logger

from edge.config import (
    Config,
    ConfigError,
    LogConfig,
    NodeConfig,
    ServerConfig,
    load_config,
    split_address,
    upstream_url,
)
from edge.log import setup_logging


def _address(value: str) -> str:
    try:
        split_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _node_address(value: str) -> str:
    """HOST:PORT of a node, or openai+http(s)://HOST:PORT/v1 of a model server."""
    try:
        if upstream_url(value) is None:
            split_address(value)
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
        default=Path("config.toml"),
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
    explicit = "--config" in sys.argv[1:] or any(a.startswith("--config=") for a in sys.argv[1:])
    config = load_config(args.config) if args.config.exists() or explicit else Config()
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


async def _signals(shutdown: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if shutdown.is_set():
                logger.warning("second signal: exiting now")
                raise SystemExit(1)
            logger.info("{}: draining", signal.Signals(signum).name)
            shutdown.set()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = resolve_config(args)
    except ConfigError as exc:
        print(f"iop-edge: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log.level, config.log.format)
    from edge.daemon import run_forever

    try:
        run_forever(config, _signals)
    except KeyboardInterrupt:
        return 130
    except BaseExceptionGroup as group:
        exits = group.subgroup(SystemExit)
        if exits is None:
            raise
        return 1
    return 0


__all__ = ["ServerConfig", "main"]
