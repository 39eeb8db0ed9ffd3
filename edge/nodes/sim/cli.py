"""`iop-sim-node`: the simulated node as a standalone process.

    iop-sim-node [--listen HOST:PORT] [--runs-log FILE] [--name NAME]
                 [--max-runs N] [--nodes K] [--no-watch] [--no-continuation]
                 [--kv-tokens N] [--prefill-us-per-token U] [--decode-tokens-per-s R]
                 [--no-kv-reports]
                 [--token-file FILE] [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]
                 [--insecure]

One process serves K simulated nodes (`--nodes`, for benchmarks of many node
connections): node i (1..K) is named NAME-i and listens on PORT+i-1 (each on
a port of its own choosing when PORT is 0), with its own runs log,
FILE's name with `-i` before its suffix. With K = 1 (the default) the node is
NAME on PORT, its runs log FILE. Once every node listens, the process prints
one line per node, in order: `iop-sim-node listening on HOST:PORT` (K = 1) or
`iop-sim-node NAME-i listening on HOST:PORT`. The nodes share the process's
asyncio loop and do nothing while idle.

`--kv-tokens N` turns on each node's KV cache model (`edge.nodes.sim.kvcache`:
N // 64 blocks, at most 4,194,304 tokens), with `--prefill-us-per-token U`
per uncached prompt token before a run's first event; `--decode-tokens-per-s
R` paces deltas (docs/simulated-node.md). `--no-kv-reports`: the cache model runs,
but Watch reports carry no KV block events (as a node whose model server publishes
none; the edge then keeps an approximate index of it). `--no-continuation`: the models say
they do not continue answers (RunRequest.continuation), as a node older than
that field.

`--token-file`, `--tls-cert`, `--tls-key`, `--tls-client-ca` lock every node of the
process (`edge.nodes.guard`; SIGHUP reads the files again); an address other than
loopback without them is refused unless `--insecure`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import sys
from collections.abc import Callable
from pathlib import Path

from edge.config.address import split_address
from edge.nodes.guard import (
    GuardError,
    NodeGuard,
    add_arguments,
    say_refused,
    settings_from,
    start_guard,
)
from edge.nodes.kit import NodeServer, start_server, stop_server, wait_for_stop_signal
from edge.nodes.sim.kvcache import MAX_KV_TOKENS, KVSettings
from edge.nodes.sim.server import SimNode
from edge.observe.tracing import setup_tracing

# Files a node holds besides its connections: its listening socket and its runs log.
FILES_PER_NODE = 2
MAX_PORT = 65535


def _parse_listen(value: str) -> tuple[str, int]:
    try:
        return split_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, not {number}")
        if maximum is not None and number > maximum:
            raise argparse.ArgumentTypeError(f"must be {maximum} or less, not {number}")
        return number

    return parse


def _rate(value: str) -> float:
    """A finite number from 0."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number from 0, not {value}")
    return number


def node_names(name: str, nodes: int) -> list[str]:
    """NAME for one node; NAME-1 .. NAME-K for K."""
    return [name] if nodes == 1 else [f"{name}-{i}" for i in range(1, nodes + 1)]


def node_runs_log(runs_log: Path | None, index: int, nodes: int) -> Path | None:
    """FILE for one node; node i of K writes FILE's name with `-i` before its suffix."""
    if runs_log is None or nodes == 1:
        return runs_log
    return runs_log.with_name(f"{runs_log.stem}-{index}{runs_log.suffix}")


def _allow_open_files(nodes: int) -> None:
    """Raise the soft limit on open files towards the hard one for many nodes.

    Each node holds a listening socket, a runs log and its connections; a
    default soft limit of 1024 is too few for hundreds of nodes. Best effort:
    a node that cannot listen still says why.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1024 + 4 * FILES_PER_NODE * nodes
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def _serve(
    host: str,
    port: int,
    runs_log: Path | None,
    name: str,
    nodes: int,
    max_runs: int,
    watch: bool,
    kv: KVSettings,
    continuation: bool = True,
    guard: NodeGuard | None = None,
    kv_reports: bool = True,
) -> int:
    # Tracing: the OTEL_* environment variables (edge.observe.tracing), off by default.
    tracing = setup_tracing(service="iop-sim-node")
    served: list[tuple[SimNode, NodeServer, int]] = []
    try:
        for index, node_name in enumerate(node_names(name, nodes), start=1):
            node = SimNode(
                name=node_name,
                runs_log=node_runs_log(runs_log, index, nodes),
                tracing=tracing,
                max_runs=max_runs,
                watch=watch,
                kv=kv,
                continuation=continuation,
                kv_reports=kv_reports,
            )
            node_port = port + index - 1 if port else 0
            try:
                server, bound = await start_server(node, host, node_port, guard=guard)
            except OSError as exc:
                await node.aclose()
                print(
                    f"iop-sim-node: {node_name} cannot listen on {host}:{node_port}: {exc}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            served.append((node, server, bound))
        for node, _, bound in served:
            who = "" if nodes == 1 else f" {node.name}"
            print(f"iop-sim-node{who} listening on {host}:{bound}", flush=True)
        if guard is not None:
            guard.reload_on_sighup("iop-sim-node")
        await wait_for_stop_signal()
        return 0
    finally:
        for node, server, _ in served:
            await stop_server(node, server)
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iop-sim-node", description=__doc__)
    parser.add_argument("--listen", type=_parse_listen, default=("127.0.0.1", 50051))
    parser.add_argument("--runs-log", type=Path, default=None, help="append one JSON line per run")
    parser.add_argument("--name", default="iop-sim-node")
    parser.add_argument(
        "--max-runs",
        type=_count(0),
        default=0,
        metavar="N",
        help="runs played at once; more wait in the node's queue (0: no cap)",
    )
    parser.add_argument(
        "--nodes",
        type=_count(1),
        default=1,
        metavar="K",
        help="serve K nodes, NAME-1..NAME-K, on PORT..PORT+K-1 (default 1)",
    )
    parser.add_argument(
        "--no-watch", action="store_true",
        help="answer Watch UNIMPLEMENTED, as a node older than that RPC",
    )  # fmt: skip
    parser.add_argument(
        "--no-continuation", action="store_true",
        help="the models do not continue answers (Describe says so), as a node older than that",
    )  # fmt: skip
    parser.add_argument(
        "--kv-tokens",
        type=_count(0, MAX_KV_TOKENS),
        default=0,
        metavar="N",
        help="model a KV cache of N tokens, N // 64 blocks, LRU (0: no cache model, the default)",
    )
    parser.add_argument(
        "--prefill-us-per-token",
        type=_rate,
        default=100.0,
        metavar="U",
        help="with --kv-tokens: microseconds per uncached prompt token before a run's first"
        " event (default 100)",
    )
    parser.add_argument(
        "--decode-tokens-per-s",
        type=_rate,
        default=0.0,
        metavar="R",
        help="send deltas at R tokens a second, 4 characters a token (0: as fast as the model"
        " or script says, the default)",
    )
    parser.add_argument(
        "--no-kv-reports", action="store_true",
        help="with --kv-tokens: Watch reports carry no KV block events (the edge's index of"
        " the node is then approximate), as a model server that publishes none",
    )  # fmt: skip
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    host, port = args.listen
    try:
        guard = start_guard(settings_from(args), host, port)
    except GuardError as exc:
        guard = str(exc)
    if isinstance(guard, str):
        return say_refused("iop-sim-node", guard)
    kv = KVSettings(args.kv_tokens, args.prefill_us_per_token, args.decode_tokens_per_s)
    if port and port + args.nodes - 1 > MAX_PORT:
        parser.error(f"--nodes {args.nodes} from port {port} passes port {MAX_PORT}")
    if args.nodes > 1:
        _allow_open_files(args.nodes)
    return asyncio.run(
        _serve(
            host,
            port,
            args.runs_log,
            args.name,
            args.nodes,
            args.max_runs,
            not args.no_watch,
            kv,
            continuation=not args.no_continuation,
            guard=guard,
            kv_reports=not args.no_kv_reports,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
