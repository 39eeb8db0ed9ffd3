"""Beside SMG (`--fleet` with SMG installed, or `--peers`): the fleet workloads through
SGLang's gateway (`smg launch --policy cache_aware`) and through this edge, in front of
the same four HTTP workers, in one run.

A worker is an `iop-edge` in front of its own simulated node (one `iop-sim-node
--nodes 4` process with the KV flags of `benchmarks.fleet`): an OpenAI-compatible HTTP
server that models the KV cache as the fleet run's nodes do, and reports cached tokens
in its answers' usage, and answers SMG's `GET /health` probe (the edge serves `/health`
as `/healthz`). SMG reaches the four workers
by URL (`--worker-urls`; it keeps a radix tree of the text it routed to each); this
edge reaches them as `openai+http://` nodes: it relays their runs itself
(`edge.nodes.direct`), the workers' cached tokens read as `cached_input_tokens`, and
an iop-node in its process answers their Describe and Watch. (Before runs skipped it,
one `iop-node` process per worker measured the same TTFT as in-process, within this
machine's noise.) Each gateway gets
fresh nodes and workers for each workload, so every cache starts cold. The figures
are those of `benchmarks.fleet`; the gateway's CPU is the SMG process's, or the
edge's, its in-process iop-nodes included. Neither gateway sees the nodes' KV events here:
SMG's tree and the edge's index are both approximate.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from benchmarks.cleanup import stop
from benchmarks.fleet import (
    PORT_TRIES,
    STARTUP_TIMEOUT_S,
    WORKLOADS,
    FleetSettings,
    Refused,
    edges,
    play,
    sim_fleet,
    workload,
)
from benchmarks.fleetreport import figures
from benchmarks.loadgen import Pool
from benchmarks.prompts import MODEL
from benchmarks.stack import can_set_apart, cores_apart, cpu_s, free_port, spawn

mono = time.monotonic


def smg_version(smg: Path) -> str | None:
    try:
        done = subprocess.run(
            [str(smg), "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().split()[-1] if done.stdout.strip() else None


def _lists_model(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
            return MODEL.encode() in resp.read()
    except urllib.error.HTTPError as exc:
        exc.close()  # its connection, now and not when collected
        return False
    except OSError:
        return False


@contextmanager
def smg_gateway(smg: Path, where: Path, workers: list[str]) -> Iterator[tuple[int, int]]:
    """SMG (cache_aware) in front of `workers`, once it lists the model; yields (port, pid).

    Its periodic health probe is off (the workers do not fail here; a probe is only
    traffic beside the workload's). Stopped with SIGKILL (its process group too): its
    drain on SIGTERM waits seconds for nothing here.
    """

    def start() -> tuple[subprocess.Popen[bytes], int]:
        port, metrics = free_port(), free_port()
        cmd = [
            str(smg), "launch", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *workers, "--policy", "cache_aware",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
            "--disable-health-check", "--log-level", "warn",
        ]  # fmt: skip
        return spawn(cmd, where / "smg.log"), port

    proc, port = start()
    try:
        deadline, tries = mono() + STARTUP_TIMEOUT_S, 1
        while not _lists_model(f"http://127.0.0.1:{port}"):
            if proc.poll() is not None or mono() > deadline:
                log = (where / "smg.log").read_text(errors="replace")
                # A port taken between free_port and SMG's bind: other ports (as `edges`).
                if proc.poll() is not None and "in use" in log and tries < PORT_TRIES:
                    tries += 1
                    proc, port = start()
                    continue
                raise SystemExit(f"SMG did not start: {log[-600:]}")
            time.sleep(0.2)
        yield port, proc.pid
    finally:
        stop(proc, signal.SIGKILL)


def _cell(
    pool: Pool,
    where: Path,
    s: FleetSettings,
    gateway: str,
    smg: Path,
    policy: str,
    name: str,
    *,
    apart: bool = False,
) -> dict[str, Any]:
    """One workload through one gateway, on fresh nodes and workers. `apart`: the gateway
    on a CPU of its own and everything else (nodes, workers, load generator, this
    process) on the others while the workload plays (`benchmarks.stack.cores_apart`)."""
    where.mkdir(parents=True, exist_ok=True)
    w = workload(name, s)
    with (
        sim_fleet(where, s) as fleet,
        edges(where, [[a] for a in fleet.addresses], "least_loaded") as workers,
    ):
        urls = [f"http://127.0.0.1:{p}" for p in workers.ports]
        assert fleet.proc is not None
        rest = [os.getpid(), fleet.proc.pid, *pool.pids, *(p.pid for p in workers.procs)]
        if gateway == "SMG":
            with (
                smg_gateway(smg, where, urls) as (port, pid),
                cores_apart([pid], rest) if apart else nullcontext(False),
            ):
                c0 = cpu_s(pid)
                raw = play(pool, [("127.0.0.1", port)], w, s)
                c1 = cpu_s(pid)
        else:
            nodes = [f"{url.replace('http://', 'openai+http://')}/v1" for url in urls]
            with edges(where / "gateway", [nodes], policy) as gw:
                gateway_pids = [p.pid for p in gw.procs]
                with cores_apart(gateway_pids, rest) if apart else nullcontext(False):
                    c0 = gw.cpu()
                    raw = play(pool, gw.targets, w, s)
                    c1 = gw.cpu()
        ok = sum(1 for r in raw["records"] if "error" not in r)
        runs = fleet.runs_per_node(ok)
    return figures(raw, runs, c1 - c0)


def measure_beside_smg(
    pool: Pool,
    tmp: Path,
    s: FleetSettings,
    smg: Path,
    policy: str,
    log: Callable[[str], None] | None = None,
    names: tuple[str, ...] = WORKLOADS,
) -> dict[str, Any]:
    """Every workload of `names` through SMG, then through this edge (`policy`), in turn: on the
    machine's CPUs shared by every process (`cells`), then, on a machine with two or
    more, with the gateway on a CPU of its own (`cells_apart`)."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    out: dict[str, Any] = {
        "settings": {"nodes": s.nodes, "kv_tokens": s.kv_tokens},
        "smg_version": smg_version(smg), "edge_policy": policy, "cells": {},
    }  # fmt: skip
    modes = [("cells", False)]
    if can_set_apart():
        out["cells_apart"] = {}
        modes.append(("cells_apart", True))
    for name in (n for n in WORKLOADS if n in names):
        for key, apart in modes:
            for gateway in ("SMG", "iop-edge"):
                where = tmp / key / name / gateway
                (where / "gateway").mkdir(parents=True, exist_ok=True)
                try:
                    cell = _cell(pool, where, s, gateway, smg, policy, name, apart=apart)
                except (Refused, SystemExit) as exc:
                    say(f"fleet beside SMG: {name}, {gateway} failed: {exc}")
                    return {**out, "error": f"{gateway} on {name}: {exc}"}
                out[key].setdefault(name, {})[gateway] = cell
                hit = cell["hit_ratio"]
                say(
                    f"fleet beside SMG{' (gateway apart)' if apart else ''}: {name}, "
                    f"{gateway}: hit {'-' if hit is None else hit}, "
                    f"TTFT p50 {cell['ttft_p50_ms']} ms, {cell['errors']} errors"
                )
    return out
