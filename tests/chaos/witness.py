"""What the three witnesses of a chaos run recorded, joined request by request.

The witnesses share no code: the clients' own view of each response
(`StreamResult`), the edge's JSON log (one "chat completion" line per
request that ran, with its request id, run id, node and status; a "did not
start" line with the run id when the node did not accept a run; the access
line of a request rejected before any run) and metrics, and the nodes' runs
logs. Requests are joined to runs by the X-Request-Id the client sent.
This module decides nothing is right or wrong: `checks` does.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from tests.chaos.client import StreamResult
from tests.chaos.plan import KEEPALIVE_S
from tests.chaos.procs import Stats

# The node writes a cancelled run's line after a 1 s grace for its CancelRun.
GRACE_S = 1.5
# After a node is back, the edge's pool may still hold it unhealthy until its
# next refresh (5 s): requests rejected with 503 then are the kill's doing.
POOL_REFRESH_S = 6.5
# A response head read this long after a kill may have left the edge before it.
HEAD_SLACK_S = 0.05


@dataclass
class Observed:
    """Everything a chaos run recorded, for the checks."""

    results: list[StreamResult]
    edge_records: list[dict[str, Any]]
    runs_lines: list[tuple[str, dict[str, Any]]]  # (node name, record) from every runs log
    downtimes: dict[str, list[tuple[float, float]]]
    metrics: dict[str, float]
    base: Stats
    end: Stats
    in_flight_end: int
    edge_exit: int | None
    load_bound_hit: bool
    rss_bound_mib: float
    not_started: int = 0
    # node -> wall-clock times each incarnation was seen listening (the runs log's clock).
    listening: dict[str, list[float]] = field(default_factory=dict)
    # Mid-answer kills on: the edge moves an answer a kill cut to another node, up to
    # `migrations` times (its `[routing] migrations`), and such a stream must complete whole.
    migration: bool = True
    migrations: int = 1


@dataclass(frozen=True, slots=True)
class Break:
    """A run that broke after output, as the edge logged it: the node it broke on, the
    node a continuation was started on (None: none was), why it broke, and the outcome
    (`migrated`, or why not: exhausted, expired, too_long, stalled, no_node, failed: the
    continuation did not start on `to_node`)."""

    from_node: str
    to_node: str | None
    reason: str
    outcome: str

    @property
    def migrated(self) -> bool:
        return self.outcome == "migrated"


def _break(rec: dict[str, Any], msg: str) -> Break | None:
    """The edge's line for a run that broke after output (`edge.fleet.migration`)."""
    if not (msg.startswith("run ") and " broke on node " in msg and "from_node" in rec):
        return None
    migrated = " it continues on node " in msg
    outcome = "migrated" if migrated else str(rec.get("outcome") or "failed")
    to_node = str(rec["to_node"]) if "to_node" in rec else None
    return Break(str(rec["from_node"]), to_node, str(rec.get("reason")), outcome)


@dataclass
class Joined:
    """One request as all three witnesses saw it."""

    result: StreamResult
    completions: list[dict[str, Any]] = field(default_factory=list)
    rejected_status: list[int] = field(default_factory=list)
    run_id: str | None = None
    node: str | None = None  # the node of the attempt that answered
    # The runs-log lines of the answering attempt (on `node`; every node's when none).
    lines: list[dict[str, Any]] = field(default_factory=list)
    # Every runs-log line of the run id, on any node: one per attempt that left a line.
    attempts: list[dict[str, Any]] = field(default_factory=list)
    # The edge's retry lines for this request: (node given up, reason).
    retries: list[tuple[str, str]] = field(default_factory=list)
    # The edge's lines for each run of this request that broke after output.
    breaks: list[Break] = field(default_factory=list)
    # Nodes a continuation's start failed on (nothing ran there), before the next took it.
    restarts: list[str] = field(default_factory=list)
    cancels: int = 0
    affected: bool = False
    # The error type when the node did not accept the run (the edge answered 502/503).
    start_error: str = ""
    # The edge logged that its CancelRun for this run failed on a connection error.
    cancel_lost: bool = False
    # A stream a kill met after its first byte: "whole" (it must complete whole), or
    # what excuses it (`checks._excuse`); "" for the others.
    excuse: str = ""

    @property
    def tag(self) -> str:
        r = self.result
        return f"{r.request_id}/{r.plan.kind}/run {self.run_id or '-'}"


def join(obs: Observed) -> tuple[list[Joined], dict[str, Any]]:
    """Requests joined with the edge's log and the runs logs; plus run-level tables."""
    completions: dict[str, list[dict[str, Any]]] = defaultdict(list)
    rejected: dict[str, list[int]] = defaultdict(list)
    not_started: dict[str, dict[str, Any]] = {}
    cancel_lost: set[str] = set()  # runs whose CancelRun failed
    retries: dict[str, list[tuple[str, str]]] = defaultdict(list)
    breaks: dict[str, list[Break]] = defaultdict(list)
    restarts: dict[str, list[str]] = defaultdict(list)  # continuations tried elsewhere
    for rec in obs.edge_records:
        msg, rid = str(rec.get("msg", "")), str(rec.get("request_id", ""))
        if brk := _break(rec, msg):
            breaks[rid].append(brk)
        elif msg.startswith("chat completion "):
            completions[rid].append(rec)
        elif msg.startswith("run ") and " before any output" in msg and "retry" in rec:
            retries[rid].append((str(rec.get("node")), str(rec.get("reason"))))
        elif msg.startswith("the continuation of run ") and " did not start on node " in msg:
            # Its start failed with nothing running there; the next node takes it.
            restarts[rid].append(str(rec.get("from_node")))
        elif msg.startswith("run ") and " did not start on node " in msg:
            not_started[rid] = rec
        elif lost := _cancel_lost_runs(msg):
            cancel_lost.update(lost)
        elif msg.startswith("POST /v1/chat/completions ") and isinstance(rec.get("status"), int):
            rejected[rid].append(rec["status"])
    lines: dict[str, list[dict[str, Any]]] = defaultdict(list)
    unknown_cancels: Counter[str] = Counter()
    # (run id, node) -> (life, unix time) of each CancelRun for an id the node did not know
    unknown_at: dict[tuple[str, str], list[tuple[int, float | None]]] = defaultdict(list)
    for node, rec in obs.runs_lines:
        if rec.get("type") == "cancel_rpc":
            unknown_cancels[str(rec.get("run_id"))] += 1
            at = rec.get("at")
            unknown_at[str(rec.get("run_id")), node].append(
                (int(rec.get("_life", 0)), float(at) if at is not None else None)
            )
        elif "run_id" in rec:
            lines[str(rec["run_id"])].append({**rec, "node": node})
    joined: list[Joined] = []
    for result in obs.results:
        j = Joined(result, completions.get(result.request_id, []))
        j.rejected_status = rejected.get(result.request_id, [])
        started = j.completions[0] if j.completions else not_started.get(result.request_id)
        if started is not None:
            j.run_id = str(started.get("run_id"))
            j.node = str(started.get("node"))
            j.start_error = str(started.get("error_type", "")) if not j.completions else ""
        elif result.run_id:
            j.run_id = result.run_id
        j.retries = retries.get(result.request_id, [])
        j.breaks = breaks.get(result.request_id, [])
        j.restarts = restarts.get(result.request_id, [])
        if j.run_id is not None:
            j.attempts = lines.get(j.run_id, [])
            # With failover, one run id may have a line on each node an attempt reached:
            # the answering attempt's is the one on the node the edge logged; a node
            # restarted since an earlier attempt (a new life, which the edge may try
            # again) has one per life, and the answering attempt is in its last (two in
            # one life still count as two).
            mine = [x for x in j.attempts if x["node"] == j.node]
            if mine:
                last = max(int(x.get("_life", 0)) for x in mine)
                mine = [x for x in mine if int(x.get("_life", 0)) == last]
            j.lines = mine if j.node is not None else j.attempts
            j.cancels = sum(int(x.get("cancel_rpcs", 0)) for x in j.lines)
            if j.node is not None:
                j.cancels += _unknown_cancels_of(unknown_at.get((j.run_id, j.node), []), mine)
            else:
                j.cancels += unknown_cancels.get(j.run_id, 0)
        j.cancel_lost = j.run_id in cancel_lost
        j.affected = _affected(j, obs.downtimes)
        joined.append(j)
    tables = {
        "lines": lines,
        "unknown_cancels": unknown_cancels,
        "retries": retries,
        "breaks": breaks,
    }
    return joined, tables


def nodes_tried(j: Joined) -> set[str]:
    """The nodes this request's attempts ran on, as the edge logged them (an answer that
    moved ran on the node it broke on, and on the node it moved to)."""
    moved = {b.from_node for b in j.breaks} | {b.to_node for b in j.breaks if b.to_node}
    moved |= set(j.restarts)
    return {node for node, _ in j.retries} | moved | ({j.node} if j.node is not None else set())


def migrations(j: Joined) -> int:
    """How many times the edge moved this request's answer to another node."""
    return sum(1 for b in j.breaks if b.migrated)


def moves(j: Joined) -> int:
    """How many continuations of this request's answer the edge started on another node
    (one that did not start may still have reached its node)."""
    return sum(1 for b in j.breaks if b.to_node is not None) + len(j.restarts)


def kill_after_first_byte(
    j: Joined, downtimes: dict[str, list[tuple[float, float]]]
) -> float | None:
    """When a node kill met this stream after its first byte (the first such kill), on
    the run's clock; None: none did.

    "After its first byte": the client had read the response head (and, on a
    stream answered 200, any output) before the kill; the same judgement as
    `byte_before_kill`, kill by kill.
    """
    r = j.result
    if not r.plan.stream or r.t_head is None:
        return None
    for down in kills_met(j, downtimes):
        if r.answer_times and r.answer_times[0] <= down + HEAD_SLACK_S:
            return down
        if r.t_head <= down + HEAD_SLACK_S:
            return down
        if r.status == 200 and down >= r.t_sent + KEEPALIVE_S + HEAD_SLACK_S:
            return down
    return None


def kills_met(j: Joined, downtimes: dict[str, list[tuple[float, float]]]) -> list[float]:
    """The kill times of the nodes this request's attempts ran on, while it was in flight."""
    r = j.result
    tried = nodes_tried(j) or set(downtimes)
    return sorted(
        down
        for node in tried
        for down, _ in downtimes.get(node, [])
        if r.t_sent - 0.05 <= down <= r.t_end
    )


def kill_per_attempt(j: Joined, downtimes: dict[str, list[tuple[float, float]]]) -> bool:
    """Every attempt of the request may have met a node kill (as many kills of the nodes
    it tried, while it was in flight, as it had attempts): failover moves a request on
    after a kill, it cannot outrun one per attempt."""
    return len(kills_met(j, downtimes)) >= len(j.retries) + 1


def byte_before_kill(j: Joined, downtimes: dict[str, list[tuple[float, float]]]) -> bool:
    """Whether the client may have had its answer's first byte before a kill of a node its
    request ran on; such an answer may end in an error frame, one with no byte may not (it
    is failed over).

    The client's own clock says late what it read late (a busy client reads its
    sockets late), so a 200 stream counts as begun once the edge must have committed
    it: its first keep-alive is due KEEPALIVE_S after the request; and a 200 stream
    with output or a keep-alive before its error frame was committed before its node
    failed (the edge commits at the first output or keep-alive, and a killed node
    sends nothing more).
    """
    r = j.result
    head = r.t_head
    if head is None:
        return False
    if r.status == 200 and r.plan.stream and (r.content_frames or r.keepalives):
        return True
    for down in kills_met(j, downtimes):
        if head <= down + HEAD_SLACK_S:
            return True
        if r.status == 200 and r.plan.stream and down >= r.t_sent + KEEPALIVE_S + HEAD_SLACK_S:
            return True
    return False


def lost_after_output(j: Joined, downtimes: dict[str, list[tuple[float, float]]]) -> bool:
    """A non-streaming answer that failed (502) when its node died after its run's first
    output (the summary's figure; it should be 0: such an answer is failed over, as its
    client has no byte before the answer is whole, and `failover` checks it)."""
    r = j.result
    return (
        not r.plan.stream
        and r.status == 502
        and any(down >= r.t_sent + HEAD_SLACK_S for down in kills_met(j, downtimes))
    )


def _cancel_lost_runs(msg: str) -> list[str]:
    """The runs named by an edge warning that their CancelRuns failed.

    Two formats: "CancelRun for run R on node N failed: E", and the rate-limited
    "CancelRun to node N failed for K run(s) (R1 R2 ... [and M more]), last: E"
    (a burst, naming its first runs). Whatever the failure, a run excused by it
    must also have met a node kill (`_affected`): a node that stayed up and got
    the CancelRun late still counts it on the run's line.
    """
    if msg.startswith("CancelRun for run ") and " failed: " in msg:
        return [msg.split()[3]]
    if msg.startswith("CancelRun to node ") and " run(s) (" in msg:
        named = msg.split(" run(s) (", 1)[1].split(")", 1)[0]
        return named.split(" and ", 1)[0].split()
    return []


def _unknown_cancels_of(
    unknown: list[tuple[int, float | None]], lines: list[dict[str, Any]]
) -> int:
    """The CancelRuns for an unknown id on the answering node that are the answering
    attempt's: in its life or later (a CancelRun that reached the node after it
    restarted), and not before that attempt started there (an earlier attempt's, on
    the node's earlier life, whose CancelRun reached the restarted node first)."""
    if not lines:
        return len(unknown)
    life = int(lines[0].get("_life", 0))
    started = lines[0].get("started_at")
    return sum(
        1 for at_life, at in unknown
        if at_life > life
        or (at_life == life and (at is None or started is None or at >= float(started)))
    )  # fmt: skip


def _affected(j: Joined, downtimes: dict[str, list[tuple[float, float]]]) -> bool:
    """A node kill got in the way of this request.

    Its node (any node, when the edge never named one) was killed while the
    request was in flight, or was down or reconnecting when it was sent; or
    its runs-log line is missing and the node died within the grace in which
    a cancelled run's line waits for its CancelRun; or the edge logged that
    the run's CancelRun failed and the node died after the request was sent
    (the kill, not the edge, lost it). A request answered 503
    without a node may also have met the pool still holding a restarted node
    unhealthy until its next refresh.
    """
    r = j.result
    if j.node is not None:
        spans = [span for node in nodes_tried(j) for span in downtimes.get(node, [])]
    else:
        spans = [span for node_spans in downtimes.values() for span in node_spans]
    for down, up in spans:
        if r.t_sent - 0.05 <= down <= r.t_end or down <= r.t_sent <= up + 0.5:
            return True
        if j.cancel_lost and r.t_sent <= down <= r.t_end + 5.0:
            return True  # its CancelRun was still on the way (or queued) when the node died
        if j.node is not None and not j.lines and r.t_sent <= down <= r.t_end + GRACE_S:
            return True
        if j.node is None and r.status == 503 and down <= r.t_sent <= up + POOL_REFRESH_S:
            return True
    return False


def terminals(payloads: list[str]) -> tuple[int, int, int, list[str]]:
    """(finish chunks, [DONE]s, error frames, error types) among SSE payloads."""
    finishes = dones = errors = 0
    types: list[str] = []
    for p in payloads:
        if p == "[DONE]":
            dones += 1
            continue
        try:
            obj = json.loads(p)
        except ValueError:
            continue  # reported as a problem by the client
        if not isinstance(obj, dict):
            continue
        if "error" in obj:
            errors += 1
            types.append(str((obj["error"] or {}).get("type")))
        elif any(c.get("finish_reason") for c in obj.get("choices") or ()):
            finishes += 1
    return finishes, dones, errors, types


def client_view(r: StreamResult) -> str:
    """What the client got, in `Expect.terminal` terms (`cut` when it left first)."""
    if r.ended != "eof":
        return r.ended
    if r.status == 200 and r.plan.stream and r.payloads:
        finishes, _, errors, types = terminals(r.payloads)
        if errors:
            return f"error:{types[-1]}"
        if finishes:
            for p in reversed(r.payloads):
                if '"finish_reason":"' in p:
                    for c in json.loads(p).get("choices") or ():
                        if c.get("finish_reason"):
                            return f"finish:{c['finish_reason']}"
        return "none"
    return f"http:{r.status}"
