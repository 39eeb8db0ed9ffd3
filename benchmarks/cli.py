"""`make bench` / `python -m benchmarks`: run what the flags select, print it, write JSON.

The flags are in `benchmarks.flags`; the main run's summary and tables in
`benchmarks.summary`. Here: the machine's description, the temporary directory, and one
command per mode (the main run, `--ab`, `--peers-only`, `--overload-only`,
`--workers-only`, `--tracing-only`, `--control-plane-only`, `--discovery-only`, `--fleet`,
`--tenants`, `--calls`), each
writing its JSON and printing its tables.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.cleanup import remove_dir, temp_dir
from benchmarks.flags import build_parser, settings_from
from benchmarks.harness import Settings
from benchmarks.jobs.base import raise_nofile
from benchmarks.loadgen import Pool
from benchmarks.overload import QUICK as OVERLOAD_QUICK
from benchmarks.overload import OverloadSettings, measure_overload, render_overload
from benchmarks.report import goal_rows, sig, table
from benchmarks.stack import EdgeSource
from benchmarks.summary import render, summarize
from benchmarks.workloads import run

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "latest.json"
PACKAGES = (
    "trio",
    "trio-asyncio",
    "hypercorn",
    "quart",
    "quart-trio",
    "h11",
    "grpclib",
    "h2",
    "betterproto2",
    "msgspec",
    "psutil",
)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": None,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "versions": {},
        "git": None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    for name in PACKAGES:
        try:
            info["versions"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info["versions"][name] = None
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "edge"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
        info["git"] = f"{head}{' + uncommitted changes in edge/' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def peers(args: argparse.Namespace, settings: Settings, tmp: Path) -> dict[str, Any]:
    """The peer tool's run (LiteLLM, SMG and the edge on its mock), or {"error": ...}."""
    from benchmarks.peer import DEFAULT_TOOL, run_peer, smg_binary

    smg = None
    if not args.no_smg:
        try:
            smg = args.smg or smg_binary()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            return {"error": f"SMG could not be installed: {exc!r}"}
    print("running the peer tool (installs litellm on first use)...", file=sys.stderr)
    return run_peer(args.peer_tool or DEFAULT_TOOL, settings, args.quick, tmp, smg)


@contextmanager
def _workdir(prefix: str, keep: bool) -> Iterator[Path]:
    """A temporary directory for one bench command: removed after, unless `keep`."""
    tmp = temp_dir(prefix, keep)
    try:
        yield tmp
    finally:
        if keep:
            print(f"logs kept in {tmp}", file=sys.stderr)
        else:
            remove_dir(tmp)


def _write(out: Path, result: dict[str, Any], started: float) -> None:
    """The run's elapsed time into `result`, then `result` as JSON into `out`."""
    result["elapsed_s"] = sig(time.monotonic() - started)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")


def main_peers(args: argparse.Namespace, settings: Settings) -> int:
    """`--peers-only`: the peer tool's run alone; prints the same-upstream table."""
    from benchmarks.peer import same_mock_headers, same_mock_rows

    out = args.out or DEFAULT_OUT.parent / "peers.json"
    started = time.monotonic()
    with _workdir("iop-bench-peers-", args.keep) as tmp:
        result: dict[str, Any] = {"peers": peers(args, settings, tmp), "machine": machine()}
    _write(out, result, started)
    peer = result["peers"]
    if "error" in peer:
        print(f"peer comparison failed: {peer['error']}")
        return 1
    print(
        f"Same upstream, same client (peer tool, {result['elapsed_s']:.0f} s): "
        f"LiteLLM {peer.get('litellm_spec')}, SMG {(peer.get('versions') or {}).get('smg')}; "
        f"iop-node CPU {peer.get('iop_node_cpu_s')} s is not in the edge's figures"
    )
    print(table(same_mock_headers(peer), same_mock_rows(peer)))
    print(f"\nwritten: {out}")
    return 0


def main_ab(args: argparse.Namespace, settings: Settings) -> int:
    """`--ab REV`: this tree against REV, alternating; prints the table, writes ab.json."""
    from benchmarks.ab import render_ab, run_ab

    out = args.out or DEFAULT_OUT.parent / "ab.json"
    started = time.monotonic()
    with _workdir("iop-bench-ab-", args.keep) as tmp:
        result = run_ab(args.ab, settings, max(1, args.ab_pairs), tmp)
    result["machine"] = machine()
    _write(out, result, started)
    print(render_ab(result))
    print(f"\nwritten: {out}")
    return 0


def overload_settings(args: argparse.Namespace) -> OverloadSettings:
    return OVERLOAD_QUICK if args.quick else OverloadSettings()


def overload_run(
    args: argparse.Namespace, tmp: Path, source: EdgeSource | None = None
) -> dict[str, Any]:
    """The overload curve on a stack of its own, with one load-generator process."""
    pool = Pool(1)
    where = tmp / f"overload-{source.label if source else 'tree'}".replace(" ", "_")
    where.mkdir(parents=True, exist_ok=True)
    try:
        return measure_overload(
            pool, where, overload_settings(args), source,
            log=lambda text: print(text, file=sys.stderr, flush=True),
        )  # fmt: skip
    finally:
        pool.close()


def main_overload(args: argparse.Namespace) -> int:
    """`--overload-only`: the curve (and REV's, with `--ab REV`); writes overload.json."""
    from benchmarks.ab import checkout, edge_module_path, remove_checkout, tree_label

    out = args.out or DEFAULT_OUT.parent / "overload.json"
    result: dict[str, Any] = {"machine": machine(), "quick": args.quick, "curves": {}}
    started = time.monotonic()
    with _workdir("iop-bench-overload-", args.keep) as tmp:
        result["curves"][tree_label()] = overload_run(args, tmp)
        if args.ab:
            _, where, other = checkout(args.ab, tmp)
            try:
                result["edge_code"] = edge_module_path(other)
                result["curves"][other.label] = overload_run(args, tmp, other)
            finally:
                remove_checkout(where)
    _write(out, result, started)
    for label, curve in result["curves"].items():
        print("\n".join(render_overload(curve, label)) + "\n")
    print(f"written: {out}")
    return 0


def workers_run(args: argparse.Namespace, tmp: Path, clients: int) -> dict[str, Any]:
    """Throughput by worker count, on stacks of its own, with `clients` load generators."""
    from benchmarks.workers import QUICK, WorkerSettings, measure_workers

    pool = Pool(clients)
    try:
        return measure_workers(pool, tmp, QUICK if args.quick else WorkerSettings())
    finally:
        pool.close()


def main_workers(args: argparse.Namespace, settings: Settings) -> int:
    """`--workers-only`: throughput by worker count; writes workers.json."""
    from benchmarks.workers import render_workers

    return _only(args, settings, "workers", workers_run, render_workers)


def _only(
    args: argparse.Namespace,
    settings: Settings,
    name: str,
    run: Callable[[argparse.Namespace, Path, int], dict[str, Any]],
    render: Callable[[dict[str, Any]], list[str]],
) -> int:
    """One workload alone (`--NAME-only`): run it, write NAME.json, print its table."""
    out = args.out or DEFAULT_OUT.parent / f"{name}.json"
    started = time.monotonic()
    with _workdir(f"iop-bench-{name}-", args.keep) as tmp:
        result: dict[str, Any] = {"machine": machine(), "quick": args.quick}
        result[name] = run(args, tmp, settings.clients)
        result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    _write(out, result, started)
    print("\n".join(render(result[name])))
    print(f"\nwritten: {out}")
    return 0


def tracing_run(args: argparse.Namespace, tmp: Path, clients: int) -> dict[str, Any]:
    """The tracing cost, on stacks of its own, with `clients` load generators."""
    from benchmarks.tracing import QUICK, TracingSettings, measure_tracing

    pool = Pool(clients)
    try:
        return measure_tracing(pool, tmp, QUICK if args.quick else TracingSettings())
    finally:
        pool.close()


def nodehop_run(args: argparse.Namespace, tmp: Path, clients: int) -> dict[str, Any]:
    """The node hop's cost, plaintext and locked, with `clients` load generators."""
    from benchmarks.nodehop import QUICK, HopSettings, measure_nodehop

    pool = Pool(clients)
    try:
        return measure_nodehop(pool, tmp, QUICK if args.quick else HopSettings())
    finally:
        pool.close()


def main_nodehop(args: argparse.Namespace, settings: Settings) -> int:
    """`--node-hop-only`: the node hop's cost; writes node_hop.json."""
    from benchmarks.nodehop import render_nodehop

    return _only(args, settings, "node_hop", nodehop_run, render_nodehop)


def main_tracing(args: argparse.Namespace, settings: Settings) -> int:
    """`--tracing-only`: the tracing cost; writes tracing.json."""
    from benchmarks.tracing import render_tracing

    return _only(args, settings, "tracing", tracing_run, render_tracing)


def control_plane_run(args: argparse.Namespace, tmp: Path, clients: int) -> dict[str, Any]:
    """The control-plane cost, on processes of its own (no load generator)."""
    from benchmarks.controlplane import QUICK, ControlPlaneSettings, measure_control_plane

    return measure_control_plane(tmp, QUICK if args.quick else ControlPlaneSettings())


def main_control_plane(args: argparse.Namespace, settings: Settings) -> int:
    """`--control-plane-only`: the control-plane cost; writes control-plane.json."""
    from benchmarks.controlplane import render_control_plane

    return _only(args, settings, "control-plane", control_plane_run, render_control_plane)


def discovery_run(args: argparse.Namespace, tmp: Path, clients: int) -> dict[str, Any]:
    """The cost of nodes found by DNS, on processes of its own (no load generator)."""
    from benchmarks.discovery import QUICK, DiscoverySettings, measure_discovery

    return measure_discovery(tmp, QUICK if args.quick else DiscoverySettings())


def main_discovery(args: argparse.Namespace, settings: Settings) -> int:
    """`--discovery-only`: the cost of nodes found by DNS; writes discovery.json."""
    from benchmarks.discovery import render_discovery

    return _only(args, settings, "discovery", discovery_run, render_discovery)


def fleet_smg(args: argparse.Namespace) -> tuple[Path | None, str | None]:
    """The SMG executable for the fleet run, or None and why not: `--smg BIN`; with
    `--peers` the pinned one, installed on first use; else the pinned one if installed."""
    from benchmarks.peer import SMG_VENV, smg_binary

    if args.no_smg:
        return None, "--no-smg"
    if args.smg:
        return args.smg, None
    if args.peers or args.litellm:
        try:
            return smg_binary(), None
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            return None, f"SMG could not be installed: {exc!r}"
    if (SMG_VENV / "bin" / "smg").exists():
        return smg_binary(), None
    return None, "SMG is not installed (--peers installs it)"


def main_fleet(args: argparse.Namespace) -> int:
    """`--fleet`: routing policies over simulated nodes with a KV cache (`--fleet-only`: on
    some workloads); writes fleet.json."""
    from benchmarks import pressure
    from benchmarks.fleet import ALL_WORKLOADS, QUICK, FleetSettings, measure_fleet, sim_has_kv
    from benchmarks.fleetpeer import measure_beside_smg
    from benchmarks.fleetreport import goal_rows, render_fleet

    names = args.fleet_only or ALL_WORKLOADS
    unknown = sorted(set(names) - set(ALL_WORKLOADS))
    if unknown:
        print(f"benchmarks: --fleet-only: no workload {', '.join(unknown)}", file=sys.stderr)
        return 2

    out = args.out or DEFAULT_OUT.parent / "fleet.json"
    s = QUICK if args.quick else FleetSettings()
    started = time.monotonic()
    result: dict[str, Any] = {"machine": machine(), "quick": args.quick}
    smg, why = fleet_smg(args)
    with _workdir("iop-bench-fleet-", args.keep) as tmp:
        pool = Pool(1)
        try:
            result["fleet"] = fleet = measure_fleet(pool, tmp, s, names=names)
            if smg is None:
                fleet["peers"] = {"error": why}
            elif set(names) - {"pressure"}:
                policy = "least_loaded" if "cache_aware" in fleet["skipped"] else "cache_aware"
                fleet["peers"] = measure_beside_smg(pool, tmp / "smg", s, smg, policy, names=names)
            if "pressure" in names and sim_has_kv():
                p = pressure.QUICK if args.quick else pressure.PressureSettings()
                fleet["pressure"] = pressure.measure_pressure(pool, tmp, p, smg)
        finally:
            pool.close()
        fleet["goals"] = goal_rows(fleet)
        result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    _write(out, result, started)
    print("\n".join(render_fleet(result["fleet"])))
    print(f"\nwritten: {out} ({result['elapsed_s']:.0f} s)")
    return 0


def main_tenants(args: argparse.Namespace) -> int:
    """`--tenants`: fair share when the fleet is full, both policies; writes tenants.json."""
    from benchmarks.tenants import QUICK, TenantSettings, measure_tenants, render_tenants

    out = args.out or DEFAULT_OUT.parent / "tenants.json"
    started = time.monotonic()
    result: dict[str, Any] = {"machine": machine(), "quick": args.quick}
    with _workdir("iop-bench-tenants-", args.keep) as tmp:
        result["tenants"] = measure_tenants(
            tmp, QUICK if args.quick else TenantSettings(),
            log=lambda text: print(text, file=sys.stderr, flush=True),
        )  # fmt: skip
        result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    _write(out, result, started)
    print("\n".join(render_tenants(result["tenants"])))
    print(f"\nwritten: {out} ({result['elapsed_s']:.0f} s)")
    return 0


def main_calls(args: argparse.Namespace) -> int:
    """`--calls` (`--ab REV`): function calls per request; writes calls.json."""
    from benchmarks.calls import CallSettings, render_calls, run_calls, workloads

    requests = args.calls_requests
    try:
        if len(requests) != 2 or not 0 <= requests[0] < requests[1]:
            raise ValueError("--calls-requests takes SMALL,LARGE, 0 <= SMALL < LARGE")
        s = CallSettings(
            small=requests[0], large=requests[1], warmup=max(0, args.calls_warmup),
            workloads=workloads(args.calls_workloads), top=args.calls_top,
        )  # fmt: skip
    except ValueError as exc:
        print(f"benchmarks: {exc}", file=sys.stderr)
        return 2
    out = args.out or DEFAULT_OUT.parent / "calls.json"
    started = time.monotonic()
    with _workdir("iop-bench-calls-", args.keep) as tmp:
        result = run_calls(
            args.ab, s, tmp, log=lambda text: print(text, file=sys.stderr, flush=True)
        )
    result["machine"] = machine()
    _write(out, result, started)
    print(render_calls(result))
    print(f"\nwritten: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.calls:
        return main_calls(args)
    if args.fleet or args.fleet_only:
        return main_fleet(args)
    if args.tenants:
        return main_tenants(args)
    settings = settings_from(args)
    nofile = raise_nofile()
    need = max(settings.open_streams, default=0) + 512
    if nofile < need:
        print(
            f"benchmarks: RLIMIT_NOFILE is {nofile}; {need} are needed for "
            f"{max(settings.open_streams):,} open streams (raise `ulimit -Hn`)",
            file=sys.stderr,
        )
        return 2
    if args.overload_only:
        return main_overload(args)
    if args.workers_only:
        return main_workers(args, settings)
    if args.tracing_only:
        return main_tracing(args, settings)
    if args.node_hop_only:
        return main_nodehop(args, settings)
    if args.control_plane_only:
        return main_control_plane(args, settings)
    if args.discovery_only:
        return main_discovery(args, settings)
    if args.ab:
        return main_ab(args, settings)
    if args.peers_only:
        return main_peers(args, settings)
    args.out = args.out or DEFAULT_OUT
    info = machine()
    started = time.monotonic()
    result: dict[str, Any] = {
        "tool": "iop-edge benchmarks",
        "quick": args.quick,
        "settings": settings.__dict__,
        "machine": info,
    }
    with _workdir("iop-bench-", args.keep) as tmp:
        raw = run(settings, tmp)
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        result["raw"] = raw
        result["summary"] = summarize(raw, settings)
        result["goals"] = goal_rows(result["summary"])
        if not args.no_overload:
            result["overload"] = overload_run(args, tmp)
        # The long sections: with --all (each alone: its --X-only).
        if args.all and not args.no_workers:
            result["workers"] = workers_run(args, tmp, settings.clients)
        if args.all and not args.no_tracing:
            result["tracing"] = tracing_run(args, tmp, settings.clients)
        if args.all and not args.no_node_hop:
            result["node_hop"] = nodehop_run(args, tmp, settings.clients)
        if args.all and not args.no_control_plane:
            result["control_plane"] = control_plane_run(args, tmp, settings.clients)
        if args.all and not args.no_discovery:
            result["discovery"] = discovery_run(args, tmp, settings.clients)
        if args.peers or args.litellm:
            result["peers"] = peers(args, settings, tmp)
    _write(args.out, result, started)
    print(render(result))
    if "overload" in result:
        print("\n" + "\n".join(render_overload(result["overload"])))
    if "workers" in result:
        from benchmarks.workers import render_workers

        print("\n" + "\n".join(render_workers(result["workers"])))
    if "tracing" in result:
        from benchmarks.tracing import render_tracing

        print("\n" + "\n".join(render_tracing(result["tracing"])))
    if "node_hop" in result:
        from benchmarks.nodehop import render_nodehop

        print("\n" + "\n".join(render_nodehop(result["node_hop"])))
    if "control_plane" in result:
        from benchmarks.controlplane import render_control_plane

        print("\n" + "\n".join(render_control_plane(result["control_plane"])))
    if "discovery" in result:
        from benchmarks.discovery import render_discovery

        print("\n" + "\n".join(render_discovery(result["discovery"])))
    print(f"\nwritten: {args.out}")
    return 0
