"""Fair share when the fleet is full (`--tenants`): tenants, weights and tiers beside a flood.

One simulated node plays at most `capacity` runs at once (`iop-sim-node --max-runs`,
and the edge's `[[nodes]] max_runs` the same: the fleet's fixed capacity). Every
request is a streamed `sim-script` run that sends its first token at once and then
holds its slot `hold_ms` on average (each client's requests take 0.5x to 1.5x of it in
turn, so that runs do not end in waves), so a request's time to first token is its
wait for a slot (plus the edge's and the client's few milliseconds). Each tenant is a
`[[keys]]` entry whose clients run closed loops (a client sends its next request when
the last one was answered; after a shed it waits 50 ms): "N in flight" is N clients.

Each scenario runs under `[admission] policy = "fair"` and `"fifo"` (the one queue in
arrival order), side by side, against the goals of the issue:

- alone: the victim's TTFT with nothing else running (the reference);
- flood: the victim (1 in flight) beside a flood of 8x the capacity in flight: victim
  TTFT p50 <= 1.5 x (its TTFT alone + one slot's hold), no victim error;
- equal: 4 tenants of equal weight, each 2x the capacity in flight: Jain's fairness
  index of their goodput >= 0.95;
- weights: weights 3 and 1, each 2x the capacity in flight: goodput ratio within 10%
  of 3:1;
- priority: a priority client (1 in flight) beside a default flood of 4x the capacity:
  priority TTFT p99 <= 2x its TTFT alone, no priority shed (the slots are not
  preempted: a priority request waits for the next slot to free, which the second,
  looser line bounds by one hold); then again with `[admission] priority_slots = 1`
  (one slot kept for priority: it starts at once, and the flood runs on one slot
  fewer, which its goodput shows);
- flex: with a queue of `small_queue`, a default flood that fits in it beside a flex
  flood that does not: flex is shed (429), default never (fair); FIFO sheds both.

With `workers` > 1, the flood and weights scenarios run again (fair only) on that many
worker processes, the capacity split between them (each worker's `max_runs`): each
worker is fair over what it admits, and the figures show what that costs. Last, the
fair queue's own cost per slot with 10 and with 10,000 tenants waiting (in-process).
Writes results/tenants.json.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from benchmarks.httpclient import ResponseReader, TrioConnection, build_post
from benchmarks.report import fmt, pct, sig, table
from benchmarks.stack import Stack
from edge.fleet.queues import FairQueue, Waiter
from edge.fleet.tenants import Tenant

perf = time.perf_counter
POLICIES = ("fair", "fifo")
# The holds a client's requests take in turn, around `hold_ms` (see `_holds`).
HOLD_STEPS = 8
# A client's pause after a shed answer (a flood would otherwise spin on them).
SHED_PAUSE_S = 0.05
KEYS = {
    "victim": "", "flood": "", "t1": "", "t2": "", "t3": "", "t4": "",
    "heavy": "weight = 3\n", "light": "weight = 1\n",
    "gold": 'service_tiers = ["priority", "default", "flex"]\n',
    "bulk": "",
}  # fmt: skip


@dataclass(frozen=True)
class TenantSettings:
    capacity: int = 8
    hold_ms: int = 400
    seconds: float = 15.0  # each scenario but equal
    jain_seconds: float = 30.0  # the equal tenants' scenario
    warm_s: float = 2.0  # left out of each scenario's figures (the queues fill)
    alone_s: float = 5.0
    small_queue: int = 24  # the flex scenario's max_queue
    workers: int = 2  # the workers run (0: none)


QUICK = TenantSettings(seconds=6.0, jain_seconds=8.0, warm_s=1.0, alone_s=2.0)


@dataclass
class Group:
    """One tenant's clients in a scenario, and what they got."""

    key: str
    clients: int
    tier: str | None = None
    records: list[tuple[float, float | None, float, int]] = field(default_factory=list)
    broken: int = 0  # connections lost, answers with an error frame


def _body(hold_ms: int, tier: str | None) -> bytes:
    events = [
        {"type": "delta", "delta": "x"},
        {"sleep_ms": hold_ms},
        {"type": "complete", "usage": {"output_tokens": 1}, "metadata": {"finish_reason": "stop"}},
    ]
    body: dict[str, Any] = {
        "model": "sim-script",
        "stream": True,
        "messages": [{"role": "user", "content": json.dumps({"events": events})}],
    }
    if tier is not None:
        body["service_tier"] = tier
    return json.dumps(body, separators=(",", ":")).encode()


async def _client(
    port: int, requests: list[bytes], first: int, group: Group, stop_at: float
) -> None:
    """A closed loop until `stop_at`: one request at a time, on one kept-alive connection,
    each the next of `requests` (from `first`)."""
    conn: TrioConnection | None = None
    turn = first
    try:
        while perf() < stop_at:
            request = requests[turn % len(requests)]
            turn += 1
            if conn is None:
                conn = await TrioConnection.open("127.0.0.1", port)
            reader = ResponseReader()
            start = perf()
            try:
                await conn.request(request, reader)
            except (OSError, ConnectionError, trio.BrokenResourceError):
                group.broken += 1
                await conn.aclose()
                conn = None
                await trio.sleep(SHED_PAUSE_S)
                continue
            group.records.append((start, reader.first_content_at, perf(), reader.status))
            group.broken += reader.errors
            if reader.close or not reader.complete:
                await conn.aclose()
                conn = None
            if reader.status != 200:
                await trio.sleep(SHED_PAUSE_S)
    finally:
        if conn is not None:
            await conn.aclose()


def _holds(hold_ms: int) -> list[int]:
    """The holds the requests of a client take in turn: from half to one and a half times
    `hold_ms`, `hold_ms` on average (runs of one length would end in waves)."""
    return [round(hold_ms * (0.5 + (i + 0.5) / HOLD_STEPS)) for i in range(HOLD_STEPS)]


def _play(port: int, hold_ms: int, groups: list[Group], seconds: float) -> float:
    """Every group's clients for `seconds` (then the answers under way, at most 10 s);
    returns the start (perf clock)."""

    async def main() -> float:
        t0 = perf()
        with trio.move_on_after(seconds + 10):
            async with trio.open_nursery() as nursery:
                for group in groups:
                    requests = [
                        build_post(
                            "127.0.0.1",
                            port,
                            "/v1/chat/completions",
                            _body(hold, group.tier),
                            {"Authorization": f"Bearer sk-{group.key}"},
                        )
                        for hold in _holds(hold_ms)
                    ]
                    for i in range(group.clients):
                        nursery.start_soon(_client, port, requests, i, group, t0 + seconds)
        return t0

    return trio.run(main)


def _figures(group: Group, t0: float, warm_s: float, seconds: float) -> dict[str, Any]:
    """What a group got after the warm-up: goodput, TTFT, sheds by status."""
    since, until = t0 + warm_s, t0 + seconds
    ok = [r for r in group.records if r[3] == 200]
    ttft = [(r[1] - r[0]) * 1000 for r in ok if r[0] >= since and r[1] is not None]
    done = sum(1 for r in ok if since <= r[2] <= until)
    return {
        "requests": len(group.records),
        "goodput_rps": done / (seconds - warm_s),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p95_ms": pct(ttft, 95),
        "ttft_p99_ms": pct(ttft, 99),
        "shed_429": sum(1 for r in group.records if r[3] == 429),
        "shed_503": sum(1 for r in group.records if r[3] == 503),
        "errors": group.broken + sum(1 for r in group.records if r[3] not in (200, 429, 503)),
    }


def _stack(
    tmp: Path,
    s: TenantSettings,
    policy: str,
    *,
    max_queue: int = 1000,
    workers: int = 1,
    priority_slots: int = 0,
) -> Stack:
    keys = "".join(
        f'\n[[keys]]\nname = "{name}"\nkey = "sk-{name}"\n{extra}' for name, extra in KEYS.items()
    )
    admission = (
        f'\n[admission]\npolicy = "{policy}"\nmax_queue = {max_queue}\n'
        f"max_queue_per_key = {max_queue}\nqueue_timeout_s = 60\n"
        f"priority_slots = {priority_slots}\n"
    )
    where = tmp / f"{policy}-q{max_queue}-w{workers}-p{priority_slots}"
    where.mkdir(parents=True, exist_ok=True)
    return Stack(
        where,
        node_keys=f"max_runs = {max(1, s.capacity // workers)}\n",
        extra_config=admission + keys,
        server_keys=f"workers = {workers}" if workers > 1 else "",
        node_args=("--max-runs", str(s.capacity)),
    )


def _scenario(
    stack: Stack, s: TenantSettings, groups: list[Group], seconds: float
) -> dict[str, Any]:
    t0 = _play(stack.edge_port, s.hold_ms, groups, seconds)
    time.sleep(s.hold_ms / 1000 + 0.5)  # the last answers end, the queue empties
    return {g.key + (f"/{g.tier}" if g.tier else ""): _figures(g, t0, s.warm_s, seconds)
            for g in groups}  # fmt: skip


def _policy_run(
    tmp: Path, s: TenantSettings, policy: str, log: Callable[[str], None]
) -> dict[str, Any]:
    """Every scenario under `policy`."""
    cap = s.capacity
    out: dict[str, Any] = {}
    with _stack(tmp, s, policy) as stack:
        plan: list[tuple[str, list[Group], float]] = [
            ("alone", [Group("victim", 1)], s.alone_s),
            ("flood", [Group("flood", 8 * cap), Group("victim", 1)], s.seconds),
            ("equal", [Group(f"t{i}", 2 * cap) for i in range(1, 5)], s.jain_seconds),
            ("weights", [Group("heavy", 2 * cap), Group("light", 2 * cap)], s.seconds),
            ("priority", [Group("flood", 4 * cap), Group("gold", 1, "priority")], s.seconds),
        ]
        for name, groups, seconds in plan:
            log(f"tenants: {policy}, {name} ({seconds:g} s)")
            out[name] = _scenario(stack, s, groups, seconds)
    with _stack(tmp, s, policy, priority_slots=1) as stack:
        log(f"tenants: {policy}, priority with 1 slot kept ({s.seconds:g} s)")
        groups = [Group("flood", 4 * cap), Group("gold", 1, "priority")]
        out["reserve"] = _scenario(stack, s, groups, s.seconds)
    with _stack(tmp, s, policy, max_queue=s.small_queue) as stack:
        log(f"tenants: {policy}, flex (max_queue {s.small_queue}, {s.seconds:g} s)")
        groups = [Group("flood", cap + s.small_queue // 2), Group("bulk", s.small_queue, "flex")]
        out["flex"] = _scenario(stack, s, groups, s.seconds)
    return out


def measure_tenants(
    tmp: Path, s: TenantSettings, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Both policies' scenarios, then the workers run; the figures and the goals."""
    result: dict[str, Any] = {"settings": s.__dict__, "policies": {}}
    for policy in POLICIES:
        result["policies"][policy] = _policy_run(tmp, s, policy, log)
    if s.workers > 1:
        cap = s.capacity
        with _stack(tmp, s, "fair", workers=s.workers) as stack:
            runs: dict[str, Any] = {}
            for name, groups in (
                ("flood", [Group("flood", 8 * cap), Group("victim", 1)]),
                ("weights", [Group("heavy", 2 * cap), Group("light", 2 * cap)]),
            ):
                log(f"tenants: fair on {s.workers} workers, {name} ({s.seconds:g} s)")
                runs[name] = _scenario(stack, s, groups, s.seconds)
            result["workers"] = runs
    result["dispatch_us"] = {str(n): dispatch_cost(n) for n in (10, 10_000)}
    result["goals"] = goals(result)
    rounded: dict[str, Any] = _rounded(result)
    return rounded


def dispatch_cost(tenants: int, slots: int = 20_000) -> float:
    """Microseconds per slot handed out by the fair queue (one dispatch that hands one
    request, and its tenant's next joining) with `tenants` tenants waiting, in-process."""
    queue = FairQueue()
    for i in range(tenants):
        queue.push(Waiter("m", False, (), None, None, Tenant(f"t{i}")))
    taken: list[Waiter] = []

    def hand(waiter: Waiter) -> bool | None:
        if taken:
            return None  # one slot a dispatch: none left
        taken.append(waiter)
        return True

    started = perf()
    for _ in range(slots):
        taken.clear()
        queue.dispatch(hand)
        queue.push(Waiter("m", False, (), None, None, taken[0].tenant))
    return (perf() - started) / slots * 1e6


def _rounded(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return sig(value)


def jain(values: list[float]) -> float | None:
    """Jain's fairness index: 1 when all are equal, 1/n when one has everything."""
    if not values or not any(values):
        return None
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def _derived(run: dict[str, Any], hold_ms: int) -> dict[str, Any]:
    """The figures each goal reads, from one policy's scenarios."""
    alone = run["alone"]["victim"]
    flood = run.get("flood", {})
    equal = run.get("equal", {})
    weights = run.get("weights", {})
    prio = run.get("priority", {}).get("gold/priority", {})
    kept = run.get("reserve", {}).get("gold/priority", {})
    flex = run.get("flex", {})
    light = weights.get("light", {}).get("goodput_rps")
    heavy = weights.get("heavy", {}).get("goodput_rps")
    return {
        "alone_p50": alone["ttft_p50_ms"],
        "alone_p99": alone["ttft_p99_ms"],
        "victim_p50": flood.get("victim", {}).get("ttft_p50_ms"),
        "victim_p95": flood.get("victim", {}).get("ttft_p95_ms"),
        "victim_errors": sum(
            flood.get("victim", {}).get(k, 0) for k in ("shed_429", "shed_503", "errors")
        ),
        "flood_goodput": flood.get("flood", {}).get("goodput_rps"),
        "jain": jain([equal[k]["goodput_rps"] for k in sorted(equal)]) if equal else None,
        "equal_goodput": [equal[k]["goodput_rps"] for k in sorted(equal)],
        "ratio": heavy / light if heavy and light else None,
        "prio_p99": prio.get("ttft_p99_ms"),
        "prio_shed": prio.get("shed_429", 0) + prio.get("shed_503", 0),
        "prio_flood_goodput": run.get("priority", {}).get("flood", {}).get("goodput_rps"),
        "kept_p99": kept.get("ttft_p99_ms"),
        "kept_shed": kept.get("shed_429", 0) + kept.get("shed_503", 0),
        "kept_flood_goodput": run.get("reserve", {}).get("flood", {}).get("goodput_rps"),
        "flex_shed": sum(
            v.get("shed_429", 0) + v.get("shed_503", 0)
            for k, v in flex.items()
            if k.endswith("/flex")
        ),
        "default_shed": sum(
            v.get("shed_429", 0) + v.get("shed_503", 0)
            for k, v in flex.items()
            if not k.endswith("/flex")
        ),
        "hold_ms": hold_ms,
    }


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal: its words, the fair and fifo figures, and whether fair meets it."""
    hold = result["settings"]["hold_ms"]
    d = {policy: _derived(run, hold) for policy, run in result["policies"].items()}

    def row(
        goal: str, show: Callable[[dict[str, Any]], str], ok: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any]:
        return {
            "goal": goal,
            **{policy: show(v) for policy, v in d.items()},
            "ok": {policy: bool(ok(v)) for policy, v in d.items()},
        }

    def victim_ok(v: dict[str, Any]) -> bool:
        limit = 1.5 * ((v["alone_p50"] or 0) + hold)
        return v["victim_p50"] is not None and v["victim_p50"] <= limit and not v["victim_errors"]

    return [
        row(
            "victim beside a flood of 8x: TTFT p50 <= 1.5x (alone + one hold), 0 errors",
            lambda v: (
                f"p50 {fmt(v['victim_p50'], ' ms')} (p95 {fmt(v['victim_p95'], ' ms')},"
                f" alone {fmt(v['alone_p50'], ' ms')}), {v['victim_errors']} errors"
            ),
            victim_ok,
        ),
        row(
            "4 equal tenants at 2x each: Jain index of goodput >= 0.95",
            lambda v: f"{fmt(v['jain'])} ({' / '.join(fmt(x) for x in v['equal_goodput'])} req/s)",
            lambda v: v["jain"] is not None and v["jain"] >= 0.95,
        ),
        row(
            "weights 3:1, both saturating: goodput ratio within 10% of 3",
            lambda v: f"{fmt(v['ratio'])}:1",
            lambda v: v["ratio"] is not None and abs(v["ratio"] / 3 - 1) <= 0.10,
        ),
        row(
            "priority beside a default flood of 4x: TTFT p99 <= 2x alone, 0 priority sheds",
            lambda v: (
                f"p99 {fmt(v['prio_p99'], ' ms')} (alone p99 {fmt(v['alone_p99'], ' ms')}),"
                f" {v['prio_shed']} shed; flood {fmt(v['prio_flood_goodput'])} req/s"
            ),
            lambda v: (
                v["prio_p99"] is not None
                and v["prio_p99"] <= 2 * (v["alone_p99"] or 0)
                and not v["prio_shed"]
            ),
        ),
        row(
            "the same with priority_slots = 1: TTFT p99 <= 2x alone, 0 priority sheds",
            lambda v: (
                f"p99 {fmt(v['kept_p99'], ' ms')} (alone p99 {fmt(v['alone_p99'], ' ms')}),"
                f" {v['kept_shed']} shed; flood {fmt(v['kept_flood_goodput'])} req/s"
            ),
            lambda v: (
                v["kept_p99"] is not None
                and v["kept_p99"] <= 2 * (v["alone_p99"] or 0)
                and not v["kept_shed"]
            ),
        ),
        row(
            "priority (no preemption): TTFT p99 <= alone + one hold",
            lambda v: (
                f"p99 {fmt(v['prio_p99'], ' ms')}"
                f" (bound {fmt((v['alone_p99'] or 0) + hold, ' ms')})"
            ),
            lambda v: (
                v["prio_p99"] is not None
                and v["prio_p99"] <= (v["alone_p99"] or 0) + hold
                and not v["prio_shed"]
            ),
        ),
        row(
            "flex shed before default: flex shed, default never",
            lambda v: f"{v['flex_shed']} flex / {v['default_shed']} default shed",
            lambda v: v["flex_shed"] > 0 and v["default_shed"] == 0,
        ),
    ]


def render_tenants(r: dict[str, Any]) -> list[str]:
    """The goals with the fair and FIFO figures side by side, then the workers run."""
    s = r["settings"]
    lines = [
        f"Fair share when the fleet is full: one simulated node of {s['capacity']} slots, each"
        f" run holding its slot {s['hold_ms']} ms; closed-loop clients per key; scenarios of"
        f" {s['seconds']:g} s ({s['jain_seconds']:g} s for the equal tenants), the first"
        f" {s['warm_s']:g} s left out",
        table(
            ["goal", "fair", "fifo", "fair ok", "fifo ok"],
            [
                [
                    g["goal"],
                    g["fair"],
                    g["fifo"],
                    "ok" if g["ok"]["fair"] else "miss",
                    "ok" if g["ok"]["fifo"] else "miss",
                ]
                for g in r["goals"]
            ],
        ),
    ]
    cost = r.get("dispatch_us")
    if cost:
        lines.append(
            f"fair queue dispatch, in-process: {fmt(cost['10'], ' us')} a slot with 10 tenants"
            f" waiting, {fmt(cost['10000'], ' us')} with 10,000"
        )
    workers = r.get("workers")
    if workers:
        flood, weights = workers["flood"], workers["weights"]
        heavy = weights["heavy"]["goodput_rps"]
        light = weights["light"]["goodput_rps"]
        lines.append(
            f"fair on {s['workers']} workers ({s['capacity'] // s['workers']} slots each):"
            f" victim beside the flood TTFT p50 {fmt(flood['victim']['ttft_p50_ms'], ' ms')}"
            f" (p95 {fmt(flood['victim']['ttft_p95_ms'], ' ms')}); weights 3:1 gave"
            f" {fmt(heavy / light if light else None)}:1"
            f" ({fmt(heavy)} / {fmt(light)} req/s)"
        )
    return lines
