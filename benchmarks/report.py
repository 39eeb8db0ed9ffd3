"""Statistics, the printed table, the goals check, and the JSON written beside them.

Per-round figures are folded into {med, min, max, n}; the table shows medians with
the range of the rounds. Every time figure appears beside its same-run baseline: the
node client driven directly (latency, throughput) or the CPU calibration unit (CPU per
chunk), since absolute times drift on a shared machine.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any


def pct(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (nearest rank on the sorted values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def sig(x: Any, digits: int = 4) -> Any:
    """`x` rounded to `digits` significant digits (non-numbers unchanged)."""
    if not isinstance(x, float) or x == 0 or math.isnan(x) or math.isinf(x):
        return x
    return round(x, max(0, digits - 1 - math.floor(math.log10(abs(x)))))


def fold(rounds: Iterable[dict[str, Any] | None]) -> dict[str, Any]:
    """Per-round dicts -> numbers as {med, min, max, n}; nested dicts recurse."""
    present = [r for r in rounds if r is not None]
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in present for k in r):
        values = [r[key] for r in present if r.get(key) is not None]
        if not values:
            out[key] = None
        elif all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[key] = {
                "med": sig(float(statistics.median(values))),
                "min": sig(float(min(values))),
                "max": sig(float(max(values))),
                "n": len(values),
            }
        elif all(isinstance(v, dict) for v in values):
            out[key] = fold(values)
        else:
            out[key] = values[0] if len({repr(v) for v in values}) == 1 else values
    return out


def med(folded: Any) -> float | None:
    """The median of a folded figure (or the figure itself)."""
    if isinstance(folded, dict):
        value = folded.get("med")
        return float(value) if isinstance(value, int | float) else None
    if isinstance(folded, int | float) and not isinstance(folded, bool):
        return float(folded)
    return None


def dig(doc: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def fmt(value: float | None, unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        text = f"{value:,.0f}"
    elif abs(value) >= 100:
        text = f"{value:.0f}"
    else:
        text = f"{sig(float(value), digits)}"
    return f"{text}{unit}"


def median_span(values: list[float]) -> str:
    """The median of a figure's runs, then their range: "12.3 (11.9-13.0)"."""
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def added_pct(base: list[float], other: list[float]) -> float | None:
    """How much more `other`'s median is than `base`'s, in percent (None: base is 0)."""
    low, high = statistics.median(base), statistics.median(other)
    return sig((high - low) / low * 100) if low else None


def fmt_range(folded: Any, unit: str = "") -> str:
    """`med (min-max)` of a folded figure, or just the value."""
    value = med(folded)
    if value is None:
        return "-"
    if isinstance(folded, dict) and folded.get("n", 1) > 1:
        return f"{fmt(value, unit)} ({fmt(folded['min'])}..{fmt(folded['max'])})"
    return fmt(value, unit)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table (readable as plain text too)."""
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    return "\n".join(lines)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def diff(a: float | None, b: float | None) -> float | None:
    """a - b, or None when either figure is missing."""
    return None if a is None or b is None else a - b


def goal_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The issue's goals against the measured medians: goal, measured, met."""
    rows: list[list[str]] = []

    def add(goal: str, value: float | None, unit: str, ok: bool | None) -> None:
        verdict = "-" if ok is None else ("yes" if ok else "NO")
        rows.append([goal, fmt(value, unit), verdict])

    p50 = med(dig(summary, "ttft", "added_p50_ms"))
    p99 = med(dig(summary, "ttft", "added_p99_ms"))
    add("added TTFT p50 <= 0.5 ms", p50, " ms", None if p50 is None else p50 <= 0.5)
    add("added TTFT p99 <= 2 ms", p99, " ms", None if p99 is None else p99 <= 2.0)
    one = dig(summary, "one_stream", "edge")
    rate = med(dig(one, "chunks_per_s"))
    cpu = med(dig(one, "edge_cpu_us_per_chunk"))
    add("one stream >= 50,000 chunks/s", rate, " ch/s", None if rate is None else rate >= 50_000)
    add("edge CPU <= 20 us/chunk (one stream)", cpu, " us", None if cpu is None else cpu <= 20)
    add(
        "  = one edge core >= 50,000 chunks/s (1e6 / CPU per chunk)",
        None if not cpu else 1e6 / cpu,
        " ch/s",
        None if not cpu else 1e6 / cpu >= 50_000,
    )
    for key, conc in dig(summary, "concurrency_keys") or []:
        c = med(dig(summary, "concurrency", key, "edge", "edge_cpu_us_per_chunk"))
        add(f"edge CPU <= 20 us/chunk ({conc} streams)", c, " us", None if c is None else c <= 20)
    last = summary.get("open_streams_last")
    if last:
        streams = int(last["opened"])
        total = float(last["rss_with_streams_mib"])
        label = "10,000 open streams < 1 GiB edge RSS"
        if streams < 10_000:
            # Projected from the largest count measured: idle RSS + per-stream growth.
            total = float(last["rss_before_mib"]) + last["rss_kib_per_stream"] * 10_000 / 1024
            label += f" (projected from {streams:,})"
        add(label, total, " MiB", total < 1024)
    dc = med(dig(summary, "disconnect", "edge_p50_ms"))
    add("disconnect -> CancelRun p50 <= 2 ms", dc, " ms", None if dc is None else dc <= 2.0)
    for key, rps in dig(summary, "rate_keys") or []:
        if rps < 1000:
            continue
        achieved = med(dig(summary, "nonstream", key, "edge", "achieved_rps"))
        added = med(dig(summary, "nonstream", key, "added_p99_ms"))
        sustained = achieved is not None and achieved >= 0.95 * rps
        add(f">= {rps:,.0f} non-stream req/s sustained", achieved, " req/s", sustained)
        add(
            f"added p99 <= 5 ms at {rps:,.0f} req/s",
            added,
            " ms",
            None if added is None else (added <= 5.0 and sustained),
        )
    return rows
