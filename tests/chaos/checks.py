"""The chaos run's invariants, checked against what every party recorded.

Each check takes the requests joined with the edge's log and the nodes' runs
logs (`witness`) and returns `Violation`s naming the request and run ids;
none is ever skipped. A run on a node that was killed while the run was in
flight (or in the node's 1 s CancelRun grace) may be missing from the runs
log: it is excused from "every run ended", and from its plan's expected
outcome only if its client had received a byte (the response head) before
the kill: a request with no byte yet is failed over to another node and must
end as its plan says ("failover").

One run id may run on several nodes (failover keeps the request's run id
for every attempt, and so does a migration), never on two at once: each
node's runs-log line has the run's start and end (wall clock, one machine),
and no two may overlap.

Mid-answer kills ("migrated"): a stream a node kill met after its first byte
is moved by the edge to another node that continues it, and must end with
exactly the answer of an uncut run (the simulated node is deterministic: the
plan knows it); only a plan that ends otherwise, no other node up, a kill
of each node it ran on, the request's total deadline, or a client that had
stopped reading before the kill excuse it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tests.chaos.client import StreamResult
from tests.chaos.plan import CUT_KINDS, TOTAL_S
from tests.chaos.witness import (
    POOL_REFRESH_S,
    Joined,
    Observed,
    byte_before_kill,
    client_view,
    join,
    kill_after_first_byte,
    kill_per_attempt,
    kills_met,
    lost_after_output,
    migrations,
    moves,
    nodes_tried,
    terminals,
)

ENDED = frozenset({"complete", "error", "cancelled", "aborted"})
FD_SLACK = 6
THREAD_SLACK = 2
# Of the streams a kill met after their first byte (and nothing excused), the share
# that must complete whole.
WHOLE_GOAL = 0.99
# A stream ended by its total deadline: its error frame came this close to it.
DEADLINE_SLACK_S = 0.1

INVARIANTS = {
    "runs_ended": "every run the node started has ended (complete/error/cancelled/aborted)",
    "cancel_rpc": "each client cancel -> exactly one CancelRun; none for a completed run",
    "terminal": "every stream read to the end has exactly one terminal",
    "metrics": "request metrics add up to the requests sent, each counted once",
    "resources": "the edge's fds/threads/sockets return to baseline; RSS within bound",
    "plans": "every request not hit by a node kill ended the way its plan says",
    "failover": "every request a node kill met before its first byte ended as planned",
    "migrated": "every stream a kill met after its first byte completed whole (>= 99%)",
    "one_live": "no run id live on two nodes at once (runs-log start/end times)",
    "edge_log": "the edge logged no ERROR line",
    "bounded": "the load finished within --duration",
}


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    detail: str
    ids: tuple[str, ...] = ()


def check_terminal(joined: list[Joined]) -> list[Violation]:
    """Exactly one terminal per stream read to the end; nothing after it; no broken ends."""
    out: list[Violation] = []
    for j in joined:
        r = j.result
        if r.ended in ("hung", "broken", "connect_error"):
            why = {
                "hung": "no end within the client's limit",
                "broken": "connection broke",
                "connect_error": "could not connect",
            }[r.ended]
            out.append(Violation("terminal", f"{why}: {'; '.join(r.problems)}", (j.tag,)))
            continue
        if r.problems:
            out.append(Violation("terminal", "; ".join(r.problems[:3]), (j.tag,)))
        if len(r.ids) > 1:
            out.append(Violation("terminal", f"chunks carry {len(r.ids)} ids", (j.tag,)))
        sse = r.status == 200 and r.plan.stream
        if sse:
            finishes, dones, errors, _ = terminals(r.payloads)
            if finishes + errors > 1 or dones > 1:
                out.append(
                    Violation(
                        "terminal",
                        f"{finishes} finish, {dones} [DONE], {errors} error frames",
                        (j.tag,),
                    )
                )
            if r.ended == "eof":
                last = r.payloads[-1] if r.payloads else ""
                ok_finish = finishes == 1 and dones == 1 and not errors and last == "[DONE]"
                ok_error = errors == 1 and not finishes and not dones and '"error"' in last
                if not (ok_finish or ok_error):
                    out.append(
                        Violation(
                            "terminal",
                            f"stream read to the end has no single "
                            f"terminal: {finishes} finish, {dones} [DONE], {errors} error, "
                            f"last {last[:60]!r}",
                            (j.tag,),
                        )
                    )
        elif r.ended == "eof":
            body = r.body if isinstance(r.body, dict) else {}
            if r.status == 200:
                choices = body.get("choices") or [{}]
                if body.get("object") != "chat.completion" or not choices[0].get("finish_reason"):
                    out.append(
                        Violation("terminal", f"200 body is not a completion: {body}", (j.tag,))
                    )
            elif not isinstance(body.get("error"), dict):
                out.append(
                    Violation("terminal", f"{r.status} body is not an error: {body}", (j.tag,))
                )
        lost = r.ended == "eof" and j.run_id and not j.lines and j.affected
        lost = lost and not any(b.migrated and b.from_node == j.node for b in j.breaks)
        if lost and sse and not client_view(r).startswith("error:"):
            # A run lost with its killed node: a reader to the end got the fail-stream frame.
            out.append(
                Violation(
                    "terminal",
                    f"run lost with a killed node ended in {client_view(r)}, not an error frame",
                    (j.tag,),
                )
            )
    return out


def _never_reached_node(j: Joined) -> bool:
    """The run never got to its node, so the node rightly has no line for it.

    Either the node was unreachable (the edge answered 503 and sends no
    CancelRun), or the client left before the node accepted the run: the edge
    cannot know whether its Run RPC got there, so it sends CancelRun anyway,
    which the node logs as an unknown id. A node that did start the run would
    have written its line (it was not killed), so none means none.
    """
    if j.lines:
        return False
    if j.start_error == "node_unavailable":
        return j.cancels == 0
    return (
        j.cancels == 1
        and j.result.status is None
        and [c.get("status") for c in j.completions] == ["cancelled"]
    )


def check_runs_ended(joined: list[Joined]) -> tuple[list[Violation], int, int]:
    """Every run the edge started has one runs-log line with a final outcome.

    Returns the violations, the runs lost with a killed node, and the runs
    that never reached their node.
    """
    out: list[Violation] = []
    excused = never = 0
    for j in joined:
        if j.run_id is None:
            continue
        if not j.lines:
            if j.affected:
                excused += 1
            elif _never_reached_node(j):
                never += 1
            else:
                out.append(Violation("runs_ended", "no runs-log line", (j.tag,)))
            continue
        if len(j.lines) > 1:
            out.append(Violation("runs_ended", f"{len(j.lines)} runs-log lines", (j.tag,)))
        for line in j.attempts:
            if line.get("outcome") not in ENDED:
                out.append(
                    Violation(
                        "runs_ended", f"outcome {line.get('outcome')!r} on {line['node']}", (j.tag,)
                    )
                )
        nodes = {line["node"] for line in j.attempts}
        if len(nodes) > 1 + len(j.retries) + moves(j):
            out.append(
                Violation(
                    "runs_ended",
                    f"ran on {len(nodes)} nodes ({', '.join(sorted(nodes))}) with "
                    f"{len(j.retries)} retries and {moves(j)} continuations logged",
                    (j.tag,),
                )
            )
    return out, excused, never


def check_one_live(joined: list[Joined]) -> tuple[list[Violation], dict[str, int]]:
    """A run id with lines on several nodes: their [started_at, ended_at] never overlap.

    Returns the violations and figures: runs seen on several nodes, and lines
    without start times (a node too old to write them: checked by count only).
    """
    out: list[Violation] = []
    several = untimed = 0
    seen: set[str] = set()
    for j in joined:
        if j.run_id is None or j.run_id in seen or len(j.attempts) < 2:
            continue
        seen.add(j.run_id)
        several += 1
        timed = [x for x in j.attempts if x.get("started_at") and x.get("ended_at")]
        untimed += len(j.attempts) - len(timed)
        spans = sorted((float(x["started_at"]), float(x["ended_at"]), x["node"]) for x in timed)
        latest: tuple[float, str] | None = None  # the latest end so far, and its node
        for start, end, node in spans:
            if latest is not None and start < latest[0]:
                out.append(
                    Violation(
                        "one_live",
                        f"live on {latest[1]} and {node} at once "
                        f"({(latest[0] - start) * 1000:.0f} ms)",
                        (j.tag,),
                    )
                )
            if latest is None or end > latest[0]:
                latest = (end, node)
    return out, {"several_nodes": several, "untimed": untimed}


def check_failover(joined: list[Joined], obs: Observed) -> list[Violation]:
    """A request a node kill met before its client had any byte ends as its plan says:
    the edge tried it on another node (a request that had a byte may end in an error frame;
    `terminal` checks it has one)."""
    out: list[Violation] = []
    for j in joined:
        r, want = j.result, j.result.plan.expect
        if not j.affected or r.ended == "load_bound" or byte_before_kill(j, obs.downtimes):
            continue
        if kill_per_attempt(j, obs.downtimes):
            continue  # counted in the summary (figure "kill_per_attempt")
        view = client_view(r)
        if view != want.terminal:
            kills = ", ".join(f"{t:.2f}s" for t in kills_met(j, obs.downtimes)) or "none in flight"
            head = f"{r.t_head:.2f}s" if r.t_head is not None else "never"
            out.append(
                Violation(
                    "failover",
                    f"ended {view}, plan says {want.terminal} (sent {r.t_sent:.2f}s, head "
                    f"{head}, kills {kills}, nodes {','.join(sorted(nodes_tried(j))) or '-'}, "
                    f"{len(j.retries)} retries)",
                    (j.tag,),
                )
            )
    return out


def restart_figures(obs: Observed) -> list[tuple[str, float | None]]:
    """Per restart: seconds from the node listening again to the start of its first run
    there (None: no run started on it, or its runs log has no start times)."""
    firsts: dict[tuple[str, int], float] = {}
    for node, rec in obs.runs_lines:
        life, started = rec.get("_life"), rec.get("started_at")
        if isinstance(life, int) and life > 0 and isinstance(started, int | float):
            key = (node, life)
            firsts[key] = min(firsts.get(key, float(started)), float(started))
    out: list[tuple[str, float | None]] = []
    for node, times in sorted(obs.listening.items()):
        for life, listened in enumerate(times):
            if life == 0:
                continue
            first = firsts.get((node, life))
            out.append((node, None if first is None else first - listened))
    return out


def _edge_status(j: Joined) -> str | None:
    return str(j.completions[0].get("status")) if j.completions else None


def check_cancel_rpc(joined: list[Joined], tables: dict[str, Any]) -> list[Violation]:
    """CancelRuns per run, counted at the node (on the run's line, or as an unknown id).

    A run the node did not finish (cancelled, aborted) gets exactly one. A run
    it finished (complete, error) gets none, except when the edge ended the
    stream first (its status is timeout or cancelled: a deadline or a client
    that left raced the node's terminal); then the one CancelRun is the race,
    counted in the summary, not a fault.
    """
    out: list[Violation] = []
    known = {j.run_id for j in joined if j.run_id}
    raced = 0
    for j in joined:
        if not j.lines:
            continue
        outcome = j.lines[0].get("outcome")
        if outcome in ("cancelled", "aborted"):
            ok, want = j.cancels == 1, "1"
        else:
            edge_first = _edge_status(j) in ("timeout", "cancelled")
            ok, want = j.cancels == 0 or (edge_first and j.cancels == 1), "0"
            raced += edge_first and j.cancels == 1
        if not ok and not (j.affected and j.cancels <= 1):
            out.append(
                Violation(
                    "cancel_rpc",
                    f"outcome {outcome}, edge status {_edge_status(j)}: {j.cancels} CancelRun "
                    f"(want {want})",
                    (j.tag,),
                )
            )
        client_cancel = j.result.plan.kind in CUT_KINDS and j.result.ended in ("cut", "load_bound")
        if client_cancel and not j.affected and (outcome != "cancelled" or j.cancels != 1):
            out.append(
                Violation(
                    "cancel_rpc",
                    f"client cancel: outcome {outcome}, {j.cancels} CancelRun",
                    (j.tag,),
                )
            )
    tables["raced"] = raced
    stray = sorted(rid for rid in tables["unknown_cancels"] if rid not in known)
    if stray:
        out.append(Violation("cancel_rpc", "CancelRun for runs no request started", tuple(stray)))
    return out


_EDGE_STATUS = {"error:timeout": "timeout", "http:200": "success", "http:504": "timeout"}


def _edge_status_for(view: str) -> str | None:
    if view.startswith("finish:"):
        return "success"
    if view in _EDGE_STATUS:
        return _EDGE_STATUS[view]
    if view.startswith(("error:", "http:")):
        return "error"
    return None


def _reset_by_plan(j: Joined) -> bool:
    """The client reset its connection before any byte of the answer (as planned)."""
    cut = j.result.plan.cut
    return cut is not None and cut.reset and j.result.ended == "cut" and j.result.status is None


def check_metrics(obs: Observed, joined: list[Joined], tables: dict[str, Any]) -> list[Violation]:
    """The request metrics add up to the requests sent, each once, under the right status."""
    out: list[Violation] = []
    m = obs.metrics
    sent = sum(1 for r in obs.results if r.ended != "connect_error")
    counted = sum(v for k, v in m.items() if k.startswith("iop_edge_requests_total{"))
    # A client that resets its connection (RST) before the edge read its request
    # leaves nothing to count: the kernel drops the unread bytes. The edge counts
    # such connections instead; only planned resets may be among them.
    unread = m.get("iop_edge_connections_without_request_total", 0.0)
    missing = [j for j in joined if not j.completions and not j.rejected_status]
    unexplained = [j.tag for j in missing if not _reset_by_plan(j)]
    if counted > sent or counted + min(unread, len(missing)) != sent or unexplained:
        out.append(
            Violation(
                "metrics",
                f"iop_edge_requests_total sums to {counted:g}, "
                f"{sent} requests were sent, {unread:g} connections carried no request; "
                "not in the edge's log:",
                tuple((unexplained or [j.tag for j in missing])[:20]),
            )
        )
    if m.get("iop_edge_active_streams", -1) != 0:
        out.append(
            Violation("metrics", f"iop_edge_active_streams = {m.get('iop_edge_active_streams')}")
        )
    twice = [j.tag for j in joined if len(j.completions) > 1]
    if twice:
        out.append(Violation("metrics", "requests recorded more than once", tuple(twice)))
    known = {j.run_id for j in joined if j.run_id}
    orphans = sorted(rid for rid in tables["lines"] if rid not in known)
    if orphans:
        out.append(
            Violation(
                "metrics", "runs the nodes ran that no request accounts for", tuple(orphans[:20])
            )
        )
    for j in joined:
        r = j.result
        want = _edge_status_for(client_view(r)) if r.ended == "eof" else None
        if want is None:
            continue
        got = str(j.completions[0].get("status")) if j.completions else None
        if got is None and r.status in j.rejected_status and want == "error":
            continue  # rejected before any run: counted as an error
        if got != want:
            out.append(
                Violation("metrics", f"client saw {client_view(r)}, edge recorded {got}", (j.tag,))
            )
    retried = sum(v for k, v in m.items() if k.startswith("iop_edge_retries_total{"))
    logged = sum(len(v) for v in tables["retries"].values())
    if retried != logged:
        out.append(
            Violation(
                "metrics", f"iop_edge_retries_total = {retried:g}, the edge logged {logged} retries"
            )
        )
    moved = sum(v for k, v in m.items() if k.startswith("iop_edge_migrations_total{"))
    migrated = sum(
        v
        for k, v in m.items()
        if k.startswith("iop_edge_migrations_total{") and 'outcome="migrated"' in k
    )
    breaks = [b for bs in tables["breaks"].values() for b in bs]
    logged_migrated = sum(1 for b in breaks if b.migrated)
    if moved != len(breaks) or migrated != logged_migrated:
        out.append(
            Violation(
                "metrics",
                f"iop_edge_migrations_total = {moved:g} ({migrated:g} migrated), the edge "
                f"logged {len(breaks)} breaks after output ({logged_migrated} migrated)",
            )
        )
    cancels_sent = sum(v for k, v in m.items() if k.startswith("iop_edge_node_cancels_total{"))
    cancels_got = sum(int(x.get("cancel_rpcs", 0)) for ls in tables["lines"].values() for x in ls)
    cancels_got += sum(tables["unknown_cancels"].values())
    kills = sum(len(v) for v in obs.downtimes.values())
    if cancels_got > cancels_sent or (not kills and cancels_got != cancels_sent):
        out.append(
            Violation(
                "metrics",
                f"iop_edge_node_cancels_total = {cancels_sent:g}, nodes received {cancels_got}",
            )
        )
    return out


def check_resources(obs: Observed) -> list[Violation]:
    """The edge's fds, threads and sockets are back near the baseline; RSS within bound."""
    out: list[Violation] = []
    b, e = obs.base, obs.end
    if e.fds > b.fds + FD_SLACK:
        out.append(Violation("resources", f"open fds {b.fds} -> {e.fds} (slack {FD_SLACK})"))
    if e.threads > b.threads + THREAD_SLACK:
        out.append(Violation("resources", f"threads {b.threads} -> {e.threads}"))
    if e.http_conns or e.close_wait:
        by_port = {r.local_port: r for r in obs.results}
        held = tuple(
            f"{r.request_id}/{r.plan.kind}/{r.ended}:{r.cut_reason}"
            for port in e.open_peers
            if (r := by_port.get(port)) is not None
        )
        out.append(
            Violation(
                "resources",
                f"{e.http_conns} client connections ({e.close_wait} in CLOSE_WAIT) still open "
                "after the load",
                held,
            )
        )
    growth = (e.rss - b.rss) / 2**20
    if growth > obs.rss_bound_mib:
        out.append(
            Violation("resources", f"RSS grew {growth:.1f} MiB (bound {obs.rss_bound_mib:g} MiB)")
        )
    if obs.in_flight_end:
        out.append(Violation("resources", f"{obs.in_flight_end} runs still in flight"))
    if obs.edge_exit != 0:
        out.append(Violation("resources", f"the edge exited {obs.edge_exit} on SIGTERM"))
    return out


def check_plans(joined: list[Joined]) -> list[Violation]:
    """Every request no node kill touched ended as its plan says, on all three witnesses."""
    out: list[Violation] = []
    for j in joined:
        r, want = j.result, j.result.plan.expect
        if j.affected or r.ended == "load_bound":
            continue
        view = client_view(r)
        if view != want.terminal:
            out.append(Violation("plans", f"ended {view}, plan says {want.terminal}", (j.tag,)))
        outcome = j.lines[0].get("outcome") if j.lines else None
        node_ok = outcome == want.node_outcome.rstrip("?") or (
            want.node_outcome.endswith("?") and (j.run_id is None or _never_reached_node(j))
        )
        if not node_ok:
            out.append(
                Violation(
                    "plans", f"node outcome {outcome}, plan says {want.node_outcome}", (j.tag,)
                )
            )
        status = _edge_status(j)
        if status is not None and status != want.edge_status:
            out.append(
                Violation("plans", f"edge status {status}, plan says {want.edge_status}", (j.tag,))
            )
        if "<tool_call" in r.content:
            out.append(Violation("plans", "tool-call markup reached the client", (j.tag,)))
        problem = answer_problem(r) if view == want.terminal else None
        if problem:
            out.append(Violation("plans", problem, (j.tag,)))
    return out


def _first_difference(got: str, want: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    at = min(len(got), len(want)) if at is None else at
    return (
        f"{len(got)} characters, want {len(want)}; from character {at}: "
        f"{got[at : at + 30]!r} != {want[at : at + 30]!r}"
    )


def _args(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def answer_problem(r: StreamResult) -> str | None:
    """How the answer a client read differs from an uncut run's (plan `answer`): its
    text, reasoning, tool calls, finish reason, usage. None: it does not (or the plan
    has no whole answer, or the client did not read one: it left first)."""
    want = r.plan.answer
    if want is None or r.ended not in ("eof", "cut") or r.status != 200:
        return None
    if r.plan.stream:
        if r.finish_reason is None:
            return None  # no finish chunk read: not an answer to compare
        text, reasoning, finish, usage = r.content, r.reasoning, r.finish_reason, r.usage
        calls = [(name, _args(args)) for _, (name, args) in sorted(r.tool_calls.items())]
        usage_read = r.ended == "eof"  # a client that left on the finish chunk reads no usage
    else:
        body = r.body if isinstance(r.body, dict) else {}
        choice = (body.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        text = message.get("content") or ""
        reasoning = message.get("reasoning_content") or ""
        finish, usage, usage_read = choice.get("finish_reason"), body.get("usage"), True
        calls = [
            (
                str((c.get("function") or {}).get("name")),
                _args((c.get("function") or {}).get("arguments", "")),
            )
            for c in message.get("tool_calls") or ()
        ]
    if text != want.text:
        return f"text differs from an uncut run's: {_first_difference(text, want.text)}"
    if reasoning != want.reasoning:
        return f"reasoning differs: {_first_difference(reasoning, want.reasoning)}"
    if calls != [(name, args) for name, args in want.tool_calls]:
        return f"tool calls {calls!r}, an uncut run's {list(want.tool_calls)!r}"
    if finish != want.finish:
        return f"finish reason {finish}, an uncut run's {want.finish}"
    if usage_read and want.usage and not isinstance(usage, dict):
        return "no usage"
    return None


def _excuse(j: Joined, obs: Observed, down: float) -> str:
    """Why a stream a kill met after its first byte need not complete whole ("": it must).

    Decided from the plan, the kill schedule and the node states, not from what
    the edge did: `plan` (its plan ends it otherwise: a client cut, a timeout,
    a scripted error), `kill_per_leg` (the node its answer moved to was killed
    too, while it ran there, more often than the edge's `[routing] migrations` lets an
    answer move), `no_node` (no
    node it had not tried was up at the kill: every other node down, or back
    too recently for the edge to know), `deadline` (its total deadline ended
    it), `stalled` (its client had stopped reading before the kill: the edge keeps
    at most 256 Ki characters of such an answer to move it, docs/fleet.md).
    """
    r = j.result
    if not r.plan.expect.terminal.startswith("finish:"):
        return "plan"
    if r.t_stall is not None and r.t_stall <= down:
        return "stalled"
    killed = {n for n, spans in obs.downtimes.items() for d, _ in spans if d == down}
    # Later kills of the nodes its answer may have moved to (not the one killed now).
    later = [
        d
        for n in nodes_tried(j) - killed
        for d, _ in obs.downtimes.get(n, [])
        if down < d <= r.t_end
    ]
    if 1 + len(later) > obs.migrations:
        return "kill_per_leg"
    tried_before = {node for node, _ in j.retries} | killed
    up = [
        n
        for n, spans in obs.downtimes.items()
        if n not in tried_before
        and not any(d - 0.05 <= down <= u + POOL_REFRESH_S for d, u in spans)
    ]
    if not up:
        return "no_node"
    late = r.t_end >= r.t_sent + TOTAL_S - DEADLINE_SLACK_S
    if client_view(r) == "error:timeout" and late:
        return "deadline"
    if any(b.outcome == "expired" for b in j.breaks):
        return "deadline"
    return ""


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile `q` of `values` (not empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def histogram_quantile(metrics: dict[str, float], name: str, q: float) -> float | None:
    """The upper bound of the bucket holding quantile `q` of histogram `name` (None:
    no observation): Prometheus's buckets say no more."""
    buckets = sorted(
        (float(k.split('le="', 1)[1].split('"', 1)[0]), v)
        for k, v in metrics.items()
        if k.startswith(f"{name}_bucket{{") and 'le="' in k
    )
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return None
    return next(le for le, count in buckets if count >= q * total)


def check_migrated(obs: Observed, joined: list[Joined]) -> tuple[list[Violation], dict[str, Any]]:
    """A stream a node kill met after its first byte ends with the answer of an uncut run.

    Every such stream is held to this: one that finished has exactly the
    uncut answer (never a wrong one), and one with an excuse (`_excuse`) ends
    as its plan says or with one error frame. With mid-answer kills on, the
    others (their plan ends in a finish, a node to move to was up, their
    deadline not reached) must complete whole: at least WHOLE_GOAL of them,
    each one that did not is listed. With them off (`--no-migration`) such a
    stream may end in an error frame, as before migration.
    """
    out: list[Violation] = []
    met: list[Joined] = []
    excused: dict[str, int] = {}
    expected: list[Joined] = []
    not_whole: list[tuple[Joined, str]] = []
    gaps: list[float] = []
    for j in joined:
        r = j.result
        down = kill_after_first_byte(j, obs.downtimes)
        if down is None or r.ended == "load_bound":
            continue
        met.append(j)
        view, want = client_view(r), r.plan.expect.terminal
        problem = answer_problem(r) if view == want else None
        if problem:
            out.append(Violation("migrated", problem, (j.tag,)))
        if migrations(j) and view == want and r.answer_times:
            later = [t for t in r.answer_times if t > down]
            if later:
                gaps.append(later[0] - down)
        why = _excuse(j, obs, down)
        j.excuse = why or "whole"
        if why:
            excused[why] = excused.get(why, 0) + 1
            if obs.migration and view != want and not view.startswith("error:"):
                out.append(
                    Violation(
                        "migrated",
                        f"ended {view}: plan says {want} (or an error frame: {why})",
                        (j.tag,),
                    )
                )
            continue
        expected.append(j)
        if view != want or problem:
            not_whole.append((j, problem or f"ended {view}, plan says {want}"))
    whole = len(expected) - len(not_whole)
    if obs.migration and expected and whole < WHOLE_GOAL * len(expected):
        out.append(
            Violation(
                "migrated",
                f"{whole} of {len(expected)} streams met after their first byte completed "
                f"whole ({whole / len(expected):.1%}; goal {WHOLE_GOAL:.0%})",
            )
        )
        for j, why in not_whole:
            r = j.result
            brk = ", ".join(f"{b.from_node}->{b.to_node or '-'} {b.outcome}" for b in j.breaks)
            out.append(
                Violation(
                    "migrated",
                    f"not whole ({why}); sent {r.t_sent:.2f}s, killed "
                    f"{kill_after_first_byte(j, obs.downtimes):.2f}s, breaks the edge logged: "
                    f"{brk or 'none'}",
                    (j.tag,),
                )
            )
    figures = {
        "met": len(met),
        "excused": excused,
        "expected": len(expected),
        "whole": whole,
        "not_whole": [(j.tag, why) for j, why in not_whole],
        "met_migrated": sum(1 for j in met if migrations(j)),
        "client_gaps": gaps,
    }
    return out, figures


def check_edge_log(obs: Observed) -> list[Violation]:
    """The edge logged no ERROR (a bug in the edge, not a node failure, logs one)."""
    errors = [r for r in obs.edge_records if r.get("level") in ("ERROR", "CRITICAL")]
    return [
        Violation("edge_log", f"{r.get('msg')} {r.get('exception', '')}".strip())
        for r in errors[:10]
    ]


def check_all(obs: Observed) -> tuple[list[Violation], dict[str, Any]]:
    """Every invariant; returns the violations and figures for the summary."""
    joined, tables = join(obs)
    migrated_v, migrated = check_migrated(obs, joined)
    runs_v, excused, never = check_runs_ended(joined)
    live_v, live = check_one_live(joined)
    violations = [
        *runs_v,
        *live_v,
        *check_failover(joined, obs),
        *migrated_v,
        *check_cancel_rpc(joined, tables),
        *check_terminal(joined),
        *check_metrics(obs, joined, tables),
        *check_resources(obs),
        *check_plans(joined),
        *check_edge_log(obs),
    ]
    if obs.load_bound_hit:
        cut = tuple(f"{r.request_id}/{r.plan.kind}" for r in obs.results if r.ended == "load_bound")
        violations.append(
            Violation(
                "bounded",
                f"the duration bound cut the load: {len(cut)} streams cut short, "
                f"{obs.not_started} never started",
                cut,
            )
        )
    figures = {
        "joined": joined,
        "excused": excused,
        "never_reached": never,
        "run_lines": sum(len(v) for v in tables["lines"].values()),
        "unknown_cancels": sum(tables["unknown_cancels"].values()),
        "affected": sum(1 for j in joined if j.affected),
        "raced": tables.get("raced", 0),
        "retries": sum(len(v) for v in tables["retries"].values()),
        "retried_requests": sum(1 for j in joined if j.retries),
        "several_nodes": live["several_nodes"],
        "untimed": live["untimed"],
        "failed_over": sum(
            1 for j in joined if j.affected and not byte_before_kill(j, obs.downtimes)
        ),
        "lost_after_output": sum(1 for j in joined if lost_after_output(j, obs.downtimes)),
        "kill_per_attempt": sum(
            1
            for j in joined
            if j.affected
            and not byte_before_kill(j, obs.downtimes)
            and kill_per_attempt(j, obs.downtimes)
            and client_view(j.result) != j.result.plan.expect.terminal
        ),
        "restarts": restart_figures(obs),
        "migrated": migrated,
        "migrations": sum(migrations(j) for j in joined),
        "migrated_requests": sum(1 for j in joined if migrations(j)),
        "breaks": sum(len(j.breaks) for j in joined),
    }
    return violations, figures
