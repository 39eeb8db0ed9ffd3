"""The overload curve: non-streaming requests offered open loop at 0.5x, 1x, 2x, 4x capacity.

The edge gets one simulated node with `[[nodes]] max_runs` slots and an `[admission]`
queue (`max_queue`, `queue_timeout_s`); every request is a `sim-script` run that sleeps
`service_ms` on the node, so the fleet's capacity is about max_runs / service time, well
below what the edge itself can parse and answer (so the edge's CPU is not what is
measured). First the capacity is measured in the same run: a closed loop of `max_runs`
clients, each sending its next request when the last one was answered. Then each level
is offered open loop: request i is due at start + i / rate, whatever happened to the
requests before it (an overloaded server cannot slow the offer down), and its latency
counts from its due time.

Per level: goodput (successful answers completed inside the level's window, per
second), the p99 latency of admitted requests (200), the share shed (503), the p99 time
to a shed answer, and whether sheds were typed `overloaded` with `Retry-After`. Goals:
goodput at 4x >= 90% of capacity; admitted p99 within the queue's bound
(min(queue_timeout_s, max_queue / capacity) plus the 0.5x level's p99); shed p99 < 10 ms.

The load generator must not be what limits the offer: each level reports the rate
actually sent (requests started / span of their start times), the p99 lag of a start
behind its due time, and the client's CPU share of one core.

An edge without these config keys (before admission control) is run without them: it
sheds nothing, and the curve says so (`admission: no`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.httpclient import build_post
from benchmarks.loadgen import Pool
from benchmarks.report import fmt, pct, sig
from benchmarks.stack import EdgeSource, Stack

mono = time.monotonic

LEVELS = (0.5, 1.0, 2.0, 4.0)
START_DELAY_S = 0.3
GOODPUT_GOAL = 0.9
SHED_P99_GOAL_MS = 10.0
# How much over its bound the admitted p99 may be and still count as bounded (noise).
BOUND_SLACK = 1.2


@dataclass(frozen=True)
class OverloadSettings:
    max_runs: int = 8
    service_ms: int = 100
    # The queue holds this many seconds of capacity; its timeout is longer, so a queued
    # request is answered, and only a full queue sheds (at once).
    queue_s: float = 0.5
    queue_timeout_s: float = 2.0
    capacity_s: float = 3.0
    level_s: float = 6.0

    def max_queue(self, capacity: float) -> int:
        return max(1, round(capacity * self.queue_s))


QUICK = OverloadSettings(max_runs=4, capacity_s=2.0, level_s=3.0)


def service_script(ms: int) -> str:
    events = [
        {"sleep_ms": ms},
        {"type": "delta", "delta": "hello"},
        {"type": "complete", "usage": {"output_tokens": 1}, "metadata": {"finish_reason": "stop"}},
    ]
    return json.dumps({"events": events}, separators=(",", ":"))


def _level(part: dict[str, Any], seconds: float) -> dict[str, Any]:
    recs = part["records"]
    ok = [r for r in recs if r[3] == "ok"]
    shed = [r for r in recs if r[3] == "shed"]
    other = [r for r in recs if r[3] not in ("ok", "shed")]
    in_window = sum(1 for r in ok if r[1] <= seconds)
    n = len(recs) + part["unfinished"]
    lags = part["lags_ms"]
    return {
        "sent": n,
        "sent_rps": len(lags) / part["sent_span_s"] if lags and part["sent_span_s"] > 0 else None,
        "start_lag_p99_ms": pct(lags, 99),
        "client_cpu_share": part["cpu_s"] / part["wall_s"] if part["wall_s"] > 0 else None,
        "ok": len(ok),
        "goodput_rps": in_window / seconds,
        "admitted_p50_ms": pct([r[2] for r in ok], 50),
        "admitted_p99_ms": pct([r[2] for r in ok], 99),
        "admitted_max_ms": max((r[2] for r in ok), default=None),
        "shed": len(shed),
        "shed_share": len(shed) / n if n else None,
        "shed_typed": sum(1 for r in shed if r[4]),
        "shed_p50_ms": pct([r[2] for r in shed], 50),
        "shed_p99_ms": pct([r[2] for r in shed], 99),
        "other": len(other) + part["unfinished"],
        "other_kinds": sorted({r[3] for r in other}),
        "first_error": part["first_error"],
    }


def _run_job(pool: Pool, stack: Stack, request: bytes, **kwargs: Any) -> dict[str, Any]:
    start_at = mono() + START_DELAY_S
    pool.submit(
        0, "overload", host="127.0.0.1", port=stack.edge_port, request=request,
        start_at=start_at, timeout_s=30.0, **kwargs,
    )  # fmt: skip
    result: dict[str, Any] = pool.result(0, START_DELAY_S + kwargs["seconds"] + 60.0)
    return result


def _settle(stack: Stack, limit_s: float = 10.0) -> None:
    """Until the edge and the node are idle (< 3% of a core over 0.2 s); bounded."""
    assert stack.edge_probe is not None
    assert stack.node_probe is not None
    t0 = mono()
    last = stack.edge_probe.cpu() + stack.node_probe.cpu()
    while mono() - t0 < limit_s:
        time.sleep(0.2)
        now = stack.edge_probe.cpu() + stack.node_probe.cpu()
        if now - last < 0.006:
            return
        last = now


def _open_stack(
    tmp: Path, source: EdgeSource | None, o: OverloadSettings, max_queue: int
) -> tuple[Stack, bool]:
    """The stack with max_runs and [admission]; without them if the edge does not know them."""
    keys = f"max_runs = {o.max_runs}\n"
    tables = f"\n[admission]\nmax_queue = {max_queue}\nqueue_timeout_s = {o.queue_timeout_s}\n"
    stack = Stack(tmp, source, node_keys=keys, extra_config=tables)
    try:
        return stack.__enter__(), True
    except SystemExit as exc:
        if "max_runs" not in str(exc) and "admission" not in str(exc):
            raise
    bare = tmp / "no-admission"
    bare.mkdir()
    return Stack(bare, source).__enter__(), False


def measure_overload(
    pool: Pool, tmp: Path, o: OverloadSettings, source: EdgeSource | None = None, log: Any = print
) -> dict[str, Any]:
    """Capacity, then the open-loop levels, on a stack of its own; the figures per level."""
    text = service_script(o.service_ms)
    body = json.dumps(
        {"model": "sim-script", "messages": [{"role": "user", "content": text}]},
        separators=(",", ":"),
    ).encode()
    # The queue is sized from the nominal capacity (known before the stack starts).
    nominal = o.max_runs * 1000 / o.service_ms
    max_queue = o.max_queue(nominal)
    stack, admission = _open_stack(tmp, source, o, max_queue)
    try:
        request = build_post("127.0.0.1", stack.edge_port, "/v1/chat/completions", body)
        _run_job(pool, stack, request, mode="open", rate=nominal / 4, clients=0, seconds=1.0)
        _settle(stack)
        log(f"overload: capacity, closed loop x{o.max_runs} for {o.capacity_s:g} s")
        part = _run_job(
            pool, stack, request, mode="closed", rate=0.0, clients=o.max_runs,
            seconds=o.capacity_s,
        )  # fmt: skip
        cap = _level(part, o.capacity_s)
        capacity = cap["goodput_rps"]
        out: dict[str, Any] = {
            "admission": admission,
            "max_runs": o.max_runs,
            "service_ms": o.service_ms,
            "max_queue": max_queue if admission else None,
            "queue_timeout_s": o.queue_timeout_s if admission else None,
            "level_s": o.level_s,
            "capacity_rps": sig(capacity),
            "capacity_run": {k: sig(v) for k, v in cap.items()},
            "levels": {},
        }
        for factor in LEVELS:
            _settle(stack)
            rate = capacity * factor
            log(f"overload: {factor:g}x capacity = {rate:.0f} req/s for {o.level_s:g} s")
            e0, n0 = stack.edge_probe.cpu(), stack.node_probe.cpu()  # type: ignore[union-attr]
            part = _run_job(
                pool, stack, request, mode="open", rate=rate, clients=0, seconds=o.level_s
            )
            e1 = stack.edge_probe.cpu()  # type: ignore[union-attr]
            n1 = stack.node_probe.cpu()  # type: ignore[union-attr]
            level = _level(part, o.level_s)
            level["offered_rps"] = rate
            level["edge_cores_busy"] = (e1 - e0) / part["wall_s"]
            level["node_cores_busy"] = (n1 - n0) / part["wall_s"]
            out["levels"][f"{factor:g}x"] = {k: sig(v) for k, v in level.items()}
        out["goals"] = goals(out)
        return out
    finally:
        stack.close()


def admitted_bound_ms(r: dict[str, Any]) -> float | None:
    """What the queue settings allow an admitted request: the wait for a place in a full
    queue (min(queue_timeout_s, max_queue / capacity)) plus the 0.5x level's p99."""
    low = r["levels"].get("0.5x", {}).get("admitted_p99_ms")
    if not r["admission"] or low is None or not r["capacity_rps"]:
        return None
    wait_s = min(r["queue_timeout_s"], r["max_queue"] / r["capacity_rps"])
    return float(wait_s * 1000 * BOUND_SLACK + low)


def goals(r: dict[str, Any]) -> list[dict[str, Any]]:
    top = r["levels"].get("4x", {})
    cap = r["capacity_rps"] or 0.0
    good = top.get("goodput_rps")
    bound = admitted_bound_ms(r)
    worst = max((lv.get("admitted_p99_ms") or 0.0 for lv in r["levels"].values()), default=None)
    shed_p99 = max((lv.get("shed_p99_ms") or 0.0 for lv in r["levels"].values()), default=None)
    shed_any = any(lv.get("shed") for lv in r["levels"].values())
    return [
        {
            "goal": f"goodput at 4x >= {GOODPUT_GOAL:.0%} of capacity",
            "value": f"{fmt(good)} of {fmt(cap)} req/s" if good is not None else "-",
            "ok": good is not None and good >= GOODPUT_GOAL * cap,
        },
        {
            "goal": "admitted p99 bounded by the queue settings",
            "value": f"worst {fmt(worst, ' ms')}, bound {fmt(bound, ' ms')}"
            if bound is not None
            else f"worst {fmt(worst, ' ms')}, no queue settings (no admission)",
            "ok": bound is not None and worst is not None and worst <= bound,
        },
        {
            "goal": f"shed answer p99 < {SHED_P99_GOAL_MS:g} ms",
            "value": fmt(shed_p99, " ms") if shed_any else "no shedding",
            "ok": shed_any and shed_p99 is not None and shed_p99 < SHED_P99_GOAL_MS,
        },
    ]


def render_overload(r: dict[str, Any], label: str = "") -> list[str]:
    """The curve as table lines, then the goals with ok/miss."""
    from benchmarks.report import table

    head = (
        f"Overload curve{f' ({label})' if label else ''}: non-stream, open loop, one node, "
        f"max_runs {r['max_runs']}, {r['service_ms']} ms per run; "
        + (
            f"[admission] max_queue {r['max_queue']}, queue_timeout_s {r['queue_timeout_s']:g}"
            if r["admission"]
            else "admission: no (the edge does not know max_runs/[admission]; no shedding)"
        )
        + f"; capacity (closed loop x{r['max_runs']}) {fmt(r['capacity_rps'])} req/s"
    )
    rows = []
    for key, lv in r["levels"].items():
        shed = lv.get("shed") or 0
        rows.append(
            [
                key,
                f"{fmt(lv.get('offered_rps'))} / {fmt(lv.get('sent_rps'))}",
                fmt(lv.get("start_lag_p99_ms"), " ms"),
                fmt(lv.get("goodput_rps")),
                fmt(lv.get("admitted_p99_ms"), " ms"),
                f"{(lv.get('shed_share') or 0) * 100:.1f}%"
                + (f" ({lv.get('shed_typed')}/{shed} typed)" if shed else ""),
                fmt(lv.get("shed_p99_ms"), " ms") if shed else "-",
                str(lv.get("other") or 0),
                f"{fmt(lv.get('edge_cores_busy'))} / {fmt(lv.get('client_cpu_share'))}",
            ]
        )
    headers = [
        "offered", "req/s offered / sent", "start lag p99", "goodput req/s", "admitted p99",
        "shed (503)", "shed p99", "other", "edge / client cores",
    ]  # fmt: skip
    lines = [head, table(headers, rows)]
    for g in r.get("goals", []):
        lines.append(f"  {'ok  ' if g['ok'] else 'miss'}  {g['goal']}: {g['value']}")
    return lines
