"""The node hop's cost: the same edge and simulated node over plaintext gRPC and over a
locked hop (mutual TLS and a bearer token), side by side, alternating, in one run.

Each round runs both, each on a stack of its own (one `iop-sim-node`, the edge), with
the load of `benchmarks.tracing`: non-stream requests in a closed loop of keep-alive
connections (figure: the edge's CPU per request) and concurrent streams of zero-delay
deltas (the edge's CPU per content chunk), driven by the load-generator processes;
then, on an idle stack, sequential streamed requests timed to their first byte (the
time to first token the edge and its hop add; the node answers at once). The locked
stack's certificates are made for the run (`trustme`): a CA, the node's certificate,
the edge's client certificate.

The edge's hop keeps its connections open (a TLS handshake per connection, not per
run): what TLS adds per request and per chunk is the encryption of the bytes.
"""

from __future__ import annotations

import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.httpclient import build_post
from benchmarks.loadgen import Pool
from benchmarks.report import added_pct, fmt, median_span, sig, table
from benchmarks.scripts import SHORT_SCRIPT, chat_body, long_script
from benchmarks.stack import Stack
from benchmarks.workers import phase, settle, wait_workers

TOKEN = "bench-node-token"


@dataclass(frozen=True)
class HopSettings:
    rounds: int = 2
    conns: int = 16
    seconds: float = 4.0
    streams: int = 25
    chunks: int = 1000
    first_bytes: int = 60
    timeout_s: float = 60.0


QUICK = HopSettings(rounds=2, seconds=2.0, streams=10, chunks=500, first_bytes=30)


def _locked(where: Path) -> tuple[tuple[str, ...], str]:
    """The node's flags and the edge's `[[nodes]]` keys of a hop with mutual TLS and a
    token, their files made in `where`."""
    import trustme

    ca = trustme.CA()
    node = ca.issue_cert("127.0.0.1")
    edge = ca.issue_cert("iop-edge")
    files = {name: where / name for name in ("ca.pem", "node.pem", "edge.pem", "token")}
    ca.cert_pem.write_to_path(str(files["ca.pem"]))
    node.private_key_and_cert_chain_pem.write_to_path(str(files["node.pem"]))
    edge.private_key_and_cert_chain_pem.write_to_path(str(files["edge.pem"]))
    files["token"].write_text(TOKEN + "\n")
    node_args = (
        "--tls-cert", str(files["node.pem"]), "--tls-key", str(files["node.pem"]),
        "--tls-client-ca", str(files["ca.pem"]), "--token-file", str(files["token"]),
    )  # fmt: skip
    node_keys = (
        f'ca_file = "{files["ca.pem"]}"\ncert_file = "{files["edge.pem"]}"\n'
        f'key_file = "{files["edge.pem"]}"\ntoken_file = "{files["token"]}"\n'
    )
    return node_args, node_keys


def _first_bytes(host: str, port: int, count: int) -> list[float]:
    """`count` streamed requests one after another on one keep-alive connection: the
    milliseconds from each request's last byte sent to its answer's first byte."""
    request = build_post(host, port, "/v1/chat/completions", chat_body(SHORT_SCRIPT, stream=True))
    times: list[float] = []
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            sent = time.perf_counter()
            sock.sendall(request)
            data = sock.recv(65536)
            times.append((time.perf_counter() - sent) * 1000)
            while not data.endswith(b"data: [DONE]\n\n") and not data.endswith(b"0\r\n\r\n"):
                more = sock.recv(65536)
                if not more:
                    raise ConnectionError("the edge closed the connection")
                data += more
    return times


def _measure_one(
    pool: Pool, tmp: Path, locked: bool, s: HopSettings, log: Callable[[str], None]
) -> dict[str, Any]:
    label = "mutual TLS + token" if locked else "plaintext"
    where = tmp / ("locked" if locked else "plaintext")
    where.mkdir(parents=True, exist_ok=True)
    node_args, node_keys = _locked(where) if locked else ((), "")
    with Stack(where, node_args=node_args, node_keys=node_keys) as stack:
        probes = wait_workers(stack, 1)
        assert stack.node_probe is not None
        host, port = "127.0.0.1", stack.edge_port
        short = build_post(
            host, port, "/v1/chat/completions", chat_body(SHORT_SCRIPT, stream=False)
        )
        streamed = build_post(
            host, port, "/v1/chat/completions", chat_body(long_script(s.chunks), stream=True)
        )
        phase(
            pool, probes, stack.node_probe, "closed", host=host, port=port, request=short,
            conns=4, seconds=0.5, timeout_s=s.timeout_s,
        )  # fmt: skip
        settle(probes)
        c0 = sum(p.cpu() for p in probes)
        nonstream = phase(
            pool, probes, stack.node_probe, "closed", host=host, port=port, request=short,
            conns=s.conns, seconds=s.seconds, timeout_s=s.timeout_s,
        )  # fmt: skip
        settle(probes)
        c1 = sum(p.cpu() for p in probes)
        done = sum(p["requests"] for p in nonstream.pop("parts"))
        streams = phase(
            pool, probes, stack.node_probe, "streams", host=host, port=port, request=streamed,
            count=s.streams, connect_limit=128, timeout_s=s.timeout_s,
        )  # fmt: skip
        settle(probes)
        c2 = sum(p.cpu() for p in probes)
        chunks = sum(p["chunks"] for p in streams.pop("parts"))
        first = _first_bytes(host, port, s.first_bytes)
        result = {
            "label": label,
            "locked": locked,
            "req_us": sig((c1 - c0) * 1e6 / max(done, 1)),
            "req_per_s": sig(done / nonstream["wall_s"]),
            "chunk_us": sig((c2 - c1) * 1e6 / max(chunks, 1)),
            "chunks_per_s": sig(chunks / streams["wall_s"]),
            "first_byte_ms_p50": sig(statistics.median(first)),
            "limits": (nonstream["limit"], streams["limit"]),
            "errors": nonstream["errors"] + streams["errors"],
        }
        log(
            f"node hop: {label}: {result['req_us']} us/request, {result['chunk_us']} us/chunk,"
            f" first byte p50 {result['first_byte_ms_p50']} ms"
        )
        return result


def measure_nodehop(
    pool: Pool, tmp: Path, s: HopSettings, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Plaintext and locked, alternating, `s.rounds` times (drift hits both alike)."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for rnd in range(s.rounds):
        for locked in (False, True):
            runs[locked].append(_measure_one(pool, tmp / f"hop-round-{rnd}", locked, s, say))
    out: dict[str, Any] = {"settings": s.__dict__, "clients": pool.size}
    for locked, results in runs.items():
        out["locked" if locked else "plaintext"] = {
            key: [r[key] for r in results]
            for key in ("req_us", "req_per_s", "chunk_us", "chunks_per_s", "first_byte_ms_p50",
                        "limits", "errors")
        }  # fmt: skip
    for figure in ("req_us", "chunk_us", "first_byte_ms_p50"):
        out[f"added_{figure}_pct"] = added_pct(out["plaintext"][figure], out["locked"][figure])
    return out


def render_nodehop(r: dict[str, Any]) -> list[str]:
    rows = []
    for key in ("plaintext", "locked"):
        d = r[key]
        rows.append([
            "plaintext" if key == "plaintext" else "mutual TLS + token",
            median_span(d["req_us"]),
            f"{fmt(statistics.median(d['req_per_s']))}",
            median_span(d["chunk_us"]),
            f"{fmt(statistics.median(d['chunks_per_s']))}",
            median_span(d["first_byte_ms_p50"]),
        ])  # fmt: skip
    s = r["settings"]
    return [
        f"Node hop cost ({s['rounds']} rounds, plaintext and locked alternating; non-stream: "
        f"closed loop, {s['conns']} connections x {r['clients']} clients; streams: "
        f"{s['streams']} x {r['clients']} streams of {s['chunks']} deltas; first byte: "
        f"{s['first_bytes']} streamed requests one after another)",
        table(
            [
                "node hop",
                "edge CPU per request, median (range)",
                "req/s",
                "edge CPU per chunk, median (range)",
                "chunks/s",
                "first byte p50 ms, median (range)",
            ],
            rows,
        ),
        f"added by mutual TLS and a token on the hop: {fmt(r['added_req_us_pct'])}% CPU per "
        f"request, {fmt(r['added_chunk_us_pct'])}% CPU per chunk, "
        f"{fmt(r['added_first_byte_ms_p50_pct'])}% time to first byte",
    ]
