"""`iop-sim-node`: the simulated node as a standalone process."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from edge.sim.server import SimNode, start_server, stop_server


def _parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


async def _serve(host: str, port: int, runs_log: Path | None, name: str) -> None:
    node = SimNode(name=name, runs_log=runs_log)
    server, bound = await start_server(node, host, port)
    print(f"iop-sim-node listening on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await stop_server(node, server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="iop-sim-node", description=__doc__)
    parser.add_argument("--listen", type=_parse_listen, default=("127.0.0.1", 50051))
    parser.add_argument("--runs-log", type=Path, default=None, help="append one JSON line per run")
    parser.add_argument("--name", default="iop-sim-node")
    args = parser.parse_args(argv)
    host, port = args.listen
    asyncio.run(_serve(host, port, args.runs_log, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
