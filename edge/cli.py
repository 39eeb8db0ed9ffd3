"""`iop-edge`: command line -> config -> logging -> trio.run(daemon).

What its signals do is `edge.process.signals`'s. `--workers N` (`[server] workers`)
above 1 runs a supervisor (`edge.process.supervisor`) that owns the edge's signals
and starts N worker processes: this same command with the hidden `--worker-*`
arguments. A reload (SIGHUP) reads the configuration as the start did
(`load_configuration`: the file, then the flags on top). The process to signal
(the edge, or the supervisor of its workers) logs its pid as it starts.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path

from loguru import logger

from edge.config import (
    Config,
    ConfigError,
    LoadedConfig,
    NodeConfig,
    check_node_address,
    config_digest,
    load_config_file,
    parse_workers,
    split_address,
)
from edge.observe.log import setup_logging
from edge.process.allocator import tune_allocator
from edge.process.signals import (
    HARD_STOP_GRACE_S,
    daemon_signals,
    ignore_signals,
    worker_signals,
)

DEFAULT_CONFIG = Path("config.toml")
# The line that gives the pid to signal, for a reload or a drain without systemd.
_PID_LINE = "iop-edge pid {0} (kill -HUP {0} reloads the configuration; SIGTERM drains and stops)"


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


def _workers(value: str) -> int:
    try:
        return parse_workers(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fds(value: str) -> list[int]:
    return [int(fd) for fd in value.split(",") if fd]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iop-edge",
        description=(
            "OpenAI-compatible APIs in front of inference nodes reached over gRPC:"
            " chat completions (/v1/chat/completions), Responses (/v1/responses),"
            " Anthropic's Messages (/v1/messages) and legacy completions (/v1/completions)."
        ),
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
    parser.add_argument(
        "--workers",
        type=_workers,
        metavar="N|auto",
        help='worker processes serving the listen address ("auto": one per CPU; default 1)',
    )
    # A worker process, as the supervisor starts it (edge.process.supervisor).
    parser.add_argument("--worker-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-fds", type=_fds, default=[], help=argparse.SUPPRESS)
    parser.add_argument("--worker-control", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-heartbeat-s", type=float, default=None, help=argparse.SUPPRESS)
    # A worker's configuration: the supervisor's copy of the file, by its digest.
    parser.add_argument("--worker-config-digest", default=None, help=argparse.SUPPRESS)
    return parser


def load_configuration(
    args: argparse.Namespace, data: bytes | None = None, files: Mapping[str, bytes] | None = None
) -> LoadedConfig:
    """The config file (if any; `data`: its bytes, and `files`: those of the files it
    names, read before by the supervisor), with command-line flags on top. A file named
    with --config must exist; ./config.toml is read when it does."""
    path: Path | None = args.config
    if path is None and (data or DEFAULT_CONFIG.exists()):
        path = DEFAULT_CONFIG
    if path is None:
        loaded = LoadedConfig(Config(), b"", config_digest(b""))
    else:
        loaded = load_config_file(path, data, files)
    return replace(loaded, config=_flags(args, loaded.config))


def _flags(args: argparse.Namespace, config: Config) -> Config:
    """`config` with the command-line flags on top."""
    server = config.server
    if args.listen:
        server = replace(server, listen=args.listen)
    if args.workers is not None:
        server = replace(server, workers=args.workers)
    log = replace(
        config.log,
        level=args.log_level or config.log.level,
        format=args.log_format or config.log.format,
    )
    nodes = config.nodes
    if args.node:
        nodes = tuple(NodeConfig(name=a, address=a) for a in args.node)
    return replace(config, server=server, log=log, nodes=nodes)


def main(argv: list[str] | None = None) -> int:
    allocator = tune_allocator()  # before any thread starts (edge.process.allocator)
    ignore_signals()
    args = build_parser().parse_args(argv)
    try:
        loaded = load_configuration(args, *_worker_config(args))
    except ConfigError as exc:
        print(f"iop-edge: {exc}", file=sys.stderr)
        return 2
    config = loaded.config
    hard_stop_s = config.server.drain_timeout_s + HARD_STOP_GRACE_S
    if args.worker_id is not None:
        return _worker_main(args, loaded, hard_stop_s)
    setup_logging(
        config.log.level, config.log.format, worker=0 if config.server.workers > 1 else None,
        queue_bytes=config.log.queue_bytes,
    )  # fmt: skip
    logger.info("allocator: {}", allocator)
    logger.info(_PID_LINE, os.getpid())
    if config.server.workers > 1:
        return _supervisor_main(argv, args, loaded, hard_stop_s)
    from edge.process.daemon import run_forever

    try:
        run_forever(
            config, partial(daemon_signals, hard_stop_s=hard_stop_s), runs_log=args.runs_log,
            digest=loaded.digest, load=partial(load_configuration, args),
        )  # fmt: skip
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


def _supervisor_main(
    argv: list[str] | None, args: argparse.Namespace, loaded: LoadedConfig, hard_stop_s: float
) -> int:
    from edge.process.supervisor import serve_workers

    worker_argv = sys.argv[1:] if argv is None else argv
    try:
        return serve_workers(
            loaded, worker_argv, hard_stop_s, load=partial(load_configuration, args)
        )
    except OSError as error:
        listen = loaded.config.server.listen
        print(f"iop-edge: cannot listen on {listen}: {error}", file=sys.stderr)
        return 1


def _worker_config(args: argparse.Namespace) -> tuple[bytes | None, dict[str, bytes] | None]:
    """A worker's configuration file and the files it names: the bytes of its
    supervisor's copy ((None, None): not a worker, or a supervisor that gave none)."""
    if args.worker_id is None or args.worker_config_digest is None:
        return None, None
    from edge.process.supervisor import read_copy, shared_dir

    shared = shared_dir()
    if shared is None:
        raise ConfigError("a worker needs its supervisor's shared directory")
    return read_copy(shared, args.worker_config_digest)


def _worker_main(args: argparse.Namespace, loaded: LoadedConfig, hard_stop_s: float) -> int:
    """A worker process: the single-process daemon on the supervisor's sockets."""
    from edge.process import systemd

    config = loaded.config
    setup_logging(
        config.log.level, config.log.format, worker=args.worker_id,
        queue_bytes=config.log.queue_bytes,
    )  # fmt: skip
    if args.worker_control is None or not args.worker_fds:
        print("iop-edge: a worker needs --worker-control and --worker-fds", file=sys.stderr)
        return 2
    # SIGINT is the supervisor's "exit now"; until the daemon's receiver runs, a
    # terminal's Ctrl-C does not reach a worker (its own session) anyway.
    control = systemd.attach_supervisor(args.worker_control, args.worker_heartbeat_s)
    sockets = [socket.socket(fileno=fd) for fd in args.worker_fds]
    from edge.process.daemon import run_forever

    run_forever(
        config,
        partial(worker_signals, control=control, hard_stop_s=hard_stop_s),
        runs_log=args.runs_log,
        listen_sockets=sockets,
        digest=loaded.digest,
        load=partial(load_configuration, args),
    )
    return 0


__all__ = ["build_parser", "main"]
