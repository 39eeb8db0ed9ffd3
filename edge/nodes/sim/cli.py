"""`iop-sim-node`: the simulated node as a standalone process."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from edge.config.address import split_address
from edge.nodes.kit import start_server, stop_server, wait_for_stop_signal
from edge.nodes.sim.server import SimNode
from edge.observe.tracing import setup_tracing


def _parse_listen(value: str) -> tuple[str, int]:
    try:
        return split_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


async def _serve(host: str, port: int, runs_log: Path | None, name: str, watch: bool) -> None:
    # Tracing: the OTEL_* environment variables (edge.observe.tracing), off by default.
    tracing = setup_tracing(service="iop-sim-node")
    node = SimNode(name=name, runs_log=runs_log, tracing=tracing, watch=watch)
    server, bound = await start_server(node, host, port)
    print(f"iop-sim-node listening on {host}:{bound}", flush=True)
    await wait_for_stop_signal()
    await stop_server(node, server)
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="iop-sim-node", description=__doc__)
    parser.add_argument("--listen", type=_parse_listen, default=("127.0.0.1", 50051))
    parser.add_argument("--runs-log", type=Path, default=None, help="append one JSON line per run")
    parser.add_argument("--name", default="iop-sim-node")
    parser.add_argument(
        "--no-watch", action="store_true",
        help="answer Watch UNIMPLEMENTED, as a node older than that RPC",
    )  # fmt: skip
    args = parser.parse_args(argv)
    host, port = args.listen
    asyncio.run(_serve(host, port, args.runs_log, args.name, not args.no_watch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
