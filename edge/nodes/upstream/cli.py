"""`iop-node`: serve runs from an OpenAI-compatible server as a node.

    iop-node --listen HOST:PORT --upstream URL [--api-key-env NAME]
             [--models NAME ...] [--name NAME] [--runs-log FILE] [--config FILE]
             [--no-logprobs] [--load-source auto|vllm|sglang|llamacpp|none]
             [--load-interval-s S] [--continuation auto|vllm|llamacpp|none]
             [--max-output-tokens N] [--allow-chat-template] [--allow-ignore-eos]
             [--media-url-schemes data,http,https]
             [--token-file FILE] [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]
             [--insecure]
             [--kv-events tcp://HOST:PORT [--kv-replay tcp://HOST:PORT] [--kv-topic T]
              [--kv-block-size N] [--kv-table-mib N]]

`--config FILE` reads a TOML file's `[node]` table (listen, upstream,
api_key_env, models, name, runs_log, read_timeout_s, logprobs, load_source,
load_interval_s, continuation, max_output_tokens, allow_chat_template,
allow_ignore_eos, media_url_schemes, token_file, tls_cert, tls_key, tls_client_ca,
insecure, kv_events, kv_replay, kv_topic, kv_block_size, kv_table_mib); flags win
over it.
`--kv-events` subscribes to the server's KV events (vLLM's or SGLang's
`--kv-events-config` publisher; `--kv-replay` its replay endpoint): the node then
reports the server's cached blocks by the edge's prefix blocks on Watch, and the
edge's index for it is exact (`edge.nodes.upstream.kvfeed`); it says which at start
(`kv index: exact from ...`, or `kv index: approximate (no --kv-events)`).
The forwarding policy (`max_output_tokens` ... `media_url_schemes`: the keys, and the
defaults, of the edge's `[models.NAME]`) is applied to every run before it is sent
(`edge.nodes.upstream.admit`), whoever calls the node.
`--token-file`, `--tls-cert`, `--tls-key`, `--tls-client-ca` lock the node
(`edge.nodes.guard`; SIGHUP reads the files again); an address other than loopback
without them is refused unless `--insecure`.
The API key is read from the environment, never from a flag or a file.
Prints `iop-node listening on HOST:PORT` once it serves. This module turns
arguments into settings and runs the server; it knows nothing of the mapping.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.config.address import split_address
from edge.config.toml import ConfigError, TableReader, read_toml
from edge.forwarding import DEFAULT_MAX_OUTPUT_TOKENS, ForwardPolicy, media_schemes
from edge.nodes.guard import (
    GuardError,
    GuardSettings,
    NodeGuard,
    add_arguments,
    say_refused,
    settings_from,
    start_guard,
)
from edge.nodes.kit import start_server, stop_server, wait_for_stop_signal
from edge.nodes.upstream.continuation import MODES
from edge.nodes.upstream.kvfeed import KVSettings
from edge.nodes.upstream.load import SOURCES
from edge.nodes.upstream.server import UpstreamNode, normalize_upstream
from edge.observe.tracing import setup_tracing

DEFAULT_LISTEN = "127.0.0.1:50061"
_STRING_KEYS = (
    "listen", "upstream", "api_key_env", "name", "runs_log", "load_source", "continuation",
    "token_file", "tls_cert", "tls_key", "tls_client_ca", "kv_events", "kv_replay", "kv_topic",
)  # fmt: skip
DEFAULT_LOAD_INTERVAL_S = 1.0
# A load interval other than 0 (off) is at least this, at most the other.
MIN_LOAD_INTERVAL_S = 0.05
MAX_LOAD_INTERVAL_S = 3600.0
# The largest `max_output_tokens`: the contract's counts are 32-bit.
MAX_OUTPUT_TOKENS_CAP = 2**32 - 1
# The server's KV block size (tokens) and the KV map's memory (MiB) a node takes.
MAX_KV_BLOCK_SIZE = 4096
MAX_KV_TABLE_MIB = 65536
_KV_SCHEMES = ("tcp://", "ipc://")


class SettingsError(Exception):
    """A mistake in the flags or the config file; the message is one line."""


@dataclass(frozen=True, slots=True)
class NodeSettings:
    host: str
    port: int
    upstream: str
    api_key: str | None = None
    models: tuple[str, ...] = ()
    name: str = "iop-node"
    runs_log: Path | None = None
    read_timeout_s: float = 600.0
    logprobs: bool = True
    load_source: str = "auto"
    load_interval_s: float = DEFAULT_LOAD_INTERVAL_S
    continuation: str = "auto"
    # What a run may send the upstream (`edge.forwarding`).
    policy: ForwardPolicy = field(default_factory=ForwardPolicy)
    # The token and TLS the node serves with (`edge.nodes.guard`).
    guard: GuardSettings = field(default_factory=GuardSettings)
    # The server's KV events (`edge.nodes.upstream.kvfeed`); None: not read.
    kv: KVSettings | None = None


def _split_listen(value: str) -> tuple[str, int]:
    try:
        return split_address(value)
    except ValueError as exc:
        raise SettingsError(f"listen: {exc}") from None


def _models(values: list[str] | None) -> tuple[str, ...]:
    """`--models a b`, `--models a,b` and repeated flags all mean the same list."""
    return tuple(m for v in values or () for m in v.split(",") if m.strip())


def _file_table(path: Path) -> dict[str, Any]:
    """The `[node]` table's settings that are set, checked as the edge's config is."""
    try:
        r = TableReader(str(path), "node", read_toml(path).get("node", {}))
        table: dict[str, Any] = {
            key: value for key in _STRING_KEYS if (value := r.get(key, str, None)) is not None
        }
        if "models" in r.table:
            table["models"] = r.strings("models", ())
        if "read_timeout_s" in r.table:
            table["read_timeout_s"] = r.number("read_timeout_s", 0.0, minimum=0.001)
        if "insecure" in r.table:
            table["insecure"] = r.get("insecure", bool, False)
        if "logprobs" in r.table:
            table["logprobs"] = r.get("logprobs", bool, True)
        if "load_interval_s" in r.table:
            table["load_interval_s"] = r.number("load_interval_s", DEFAULT_LOAD_INTERVAL_S)
        if "max_output_tokens" in r.table:
            table["max_output_tokens"] = r.integer(
                "max_output_tokens", DEFAULT_MAX_OUTPUT_TOKENS, minimum=1,
                maximum=MAX_OUTPUT_TOKENS_CAP,
            )  # fmt: skip
        for key in ("allow_chat_template", "allow_ignore_eos"):
            if key in r.table:
                table[key] = r.get(key, bool, False)
        for key, maximum in (("kv_block_size", MAX_KV_BLOCK_SIZE),
                             ("kv_table_mib", MAX_KV_TABLE_MIB)):  # fmt: skip
            if key in r.table:
                table[key] = r.integer(key, 1, minimum=1, maximum=maximum)
        if "media_url_schemes" in r.table:
            try:
                table["media_url_schemes"] = media_schemes(r.strings("media_url_schemes", ()))
            except ValueError as exc:
                raise r.fail("media_url_schemes", str(exc)) from None
        r.done()
    except ConfigError as exc:
        raise SettingsError(str(exc)) from None
    return table


def resolve(args: argparse.Namespace) -> NodeSettings:
    """The config file's `[node]` table (if any) with the flags on top."""
    table = _file_table(args.config) if args.config else {}
    listen = args.listen or table.get("listen") or DEFAULT_LISTEN
    host, port = _split_listen(listen)
    upstream = args.upstream or table.get("upstream")
    if not upstream:
        raise SettingsError("--upstream URL is required (or node.upstream in --config)")
    try:
        upstream = normalize_upstream(upstream)
    except ValueError as exc:
        raise SettingsError(f"upstream: {exc}") from None
    key_env = args.api_key_env or table.get("api_key_env")
    api_key = None
    if key_env:
        api_key = os.environ.get(key_env)
        if not api_key:
            raise SettingsError(f"api key: the environment variable {key_env} is not set")
    runs_log = args.runs_log or (Path(table["runs_log"]) if "runs_log" in table else None)
    load_source = args.load_source or table.get("load_source") or "auto"
    if load_source not in SOURCES:
        raise SettingsError(f"load_source: {load_source!r} is not one of {', '.join(SOURCES)}")
    continuation = args.continuation or table.get("continuation") or "auto"
    if continuation not in MODES:
        raise SettingsError(f"continuation: {continuation!r} is not one of {', '.join(MODES)}")
    try:
        guard = settings_from(args, table)
    except GuardError as exc:
        raise SettingsError(str(exc)) from None
    policy = _policy(args, table)
    load_interval_s = _load_interval(
        args.load_interval_s
        if args.load_interval_s is not None
        else table.get("load_interval_s", DEFAULT_LOAD_INTERVAL_S)
    )
    return NodeSettings(
        host=host,
        port=port,
        upstream=upstream,
        api_key=api_key,
        models=_models(args.models) or tuple(table.get("models", ())),
        name=args.name or table.get("name") or "iop-node",
        runs_log=runs_log,
        read_timeout_s=float(args.read_timeout_s or table.get("read_timeout_s") or 600.0),
        logprobs=not args.no_logprobs and bool(table.get("logprobs", True)),
        load_source=load_source,
        load_interval_s=load_interval_s,
        continuation=continuation,
        policy=policy,
        guard=guard,
        kv=_kv(args, table),
    )


def _policy(args: argparse.Namespace, table: dict[str, Any]) -> ForwardPolicy:
    """The forwarding policy: the flags, else the `[node]` table, else the edge's
    defaults."""
    cap = args.max_output_tokens
    if cap is None:
        cap = table.get("max_output_tokens", DEFAULT_MAX_OUTPUT_TOKENS)
    elif not 1 <= cap <= MAX_OUTPUT_TOKENS_CAP:
        raise SettingsError(
            f"max_output_tokens: {cap} is not between 1 and {MAX_OUTPUT_TOKENS_CAP}"
        )
    schemes = table.get("media_url_schemes", ("data",))
    if args.media_url_schemes:
        try:
            schemes = media_schemes(
                s for v in args.media_url_schemes for s in v.split(",") if s.strip()
            )
        except ValueError as exc:
            raise SettingsError(f"media_url_schemes: {exc}") from None
    return ForwardPolicy(
        max_output_tokens=cap,
        allow_chat_template=args.allow_chat_template or table.get("allow_chat_template", False),
        allow_ignore_eos=args.allow_ignore_eos or table.get("allow_ignore_eos", False),
        media_url_schemes=frozenset(schemes) | {"data"},
    )


def _kv(args: argparse.Namespace, table: dict[str, Any]) -> KVSettings | None:
    """Where the server publishes its KV events (None: not read), checked."""
    events = args.kv_events or table.get("kv_events")
    replay = args.kv_replay or table.get("kv_replay")
    if not events:
        if replay:
            raise SettingsError("kv_replay: needs kv_events (the publisher it replays)")
        return None
    for key, endpoint in (("kv_events", events), ("kv_replay", replay)):
        if endpoint and (not endpoint.startswith(_KV_SCHEMES) or "*" in endpoint):
            raise SettingsError(
                f"{key}: {endpoint!r} is not a ZMQ endpoint to connect to (tcp://HOST:PORT)"
            )
    numbers = {}
    for key, maximum in (("kv_block_size", MAX_KV_BLOCK_SIZE),
                         ("kv_table_mib", MAX_KV_TABLE_MIB)):  # fmt: skip
        value = getattr(args, key)
        if value is not None and not 1 <= value <= maximum:
            raise SettingsError(f"{key}: {value} is not between 1 and {maximum}")
        if value is None:
            value = table.get(key)
        if value is not None:
            numbers[key.removeprefix("kv_")] = value
    topic = args.kv_topic if args.kv_topic is not None else table.get("kv_topic", "")
    return KVSettings(events, replay, topic, **numbers)


def _load_interval(seconds: float) -> float:
    """0 (off), or MIN_LOAD_INTERVAL_S to MAX_LOAD_INTERVAL_S seconds."""
    if seconds == 0 or MIN_LOAD_INTERVAL_S <= seconds <= MAX_LOAD_INTERVAL_S:
        return float(seconds)
    raise SettingsError(
        f"load_interval_s: {seconds} is not 0 (off) nor between "
        f"{MIN_LOAD_INTERVAL_S} and {MAX_LOAD_INTERVAL_S} seconds"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iop-node", description="A node that serves runs from an OpenAI-compatible server."
    )
    parser.add_argument("--config", type=Path, help="TOML file with a [node] table")
    parser.add_argument("--listen", help=f"HOST:PORT to serve gRPC on (default {DEFAULT_LISTEN})")
    parser.add_argument("--upstream", help="the server's API base URL, e.g. http://host:8000/v1")
    parser.add_argument("--api-key-env", metavar="NAME", help="environment variable with the key")
    parser.add_argument(
        "--models",
        nargs="+",
        action="extend",
        metavar="NAME",
        help="models to serve (default: the upstream's /models)",
    )
    parser.add_argument("--name", help="node name reported by Describe (default iop-node)")
    parser.add_argument("--runs-log", type=Path, help="append one JSON line per run")
    parser.add_argument("--read-timeout-s", type=float, help="longest upstream silence (600)")
    parser.add_argument(
        "--no-logprobs",
        action="store_true",
        help="the upstream cannot give logprobs: Describe says so (the edge answers 400)",
    )
    parser.add_argument(
        "--load-source",
        choices=SOURCES,
        help="how the upstream's /metrics is read for Describe's load (default auto: by "
        "its metric prefix; none: not read)",
    )
    parser.add_argument(
        "--load-interval-s",
        type=float,
        metavar="S",
        help=f"seconds between reads of the upstream's load (default "
        f"{DEFAULT_LOAD_INTERVAL_S}; 0: off)",
    )
    parser.add_argument(
        "--continuation",
        choices=MODES,
        help="how the upstream continues an answer another node started (default auto: "
        "vllm for vLLM and SGLang, else none; llamacpp: llama-server's assistant prefill)",
    )
    policy = parser.add_argument_group(
        "forwarding policy", "what a run may send the upstream (the edge's [models.NAME] keys)"
    )
    policy.add_argument(
        "--max-output-tokens",
        type=int,
        metavar="N",
        help=f"refuse a run asking for more output tokens (default {DEFAULT_MAX_OUTPUT_TOKENS})",
    )
    policy.add_argument(
        "--allow-chat-template",
        action="store_true",
        help="forward a caller's chat template (default: dropped)",
    )
    policy.add_argument(
        "--allow-ignore-eos", action="store_true", help="forward ignore_eos (default: dropped)"
    )
    policy.add_argument(
        "--media-url-schemes",
        nargs="+",
        action="extend",
        metavar="SCHEME",
        help="media URL schemes forwarded: data, http, https (default data; data is always "
        "allowed); others are refused",
    )
    _kv_arguments(parser)
    add_arguments(parser)
    return parser


def _kv_arguments(parser: argparse.ArgumentParser) -> None:
    kv = parser.add_argument_group(
        "KV events", "the server's cache, reported by the edge's prefix blocks (docs/nodes.md)"
    )
    kv.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="the server's KV event publisher, e.g. tcp://127.0.0.1:5557 (default: not read;"
        " the edge's index for this node is then approximate)",
    )
    kv.add_argument(
        "--kv-replay", metavar="ENDPOINT", help="its replay endpoint, asked after a gap"
    )
    kv.add_argument("--kv-topic", metavar="TOPIC", help="the topic subscribed (default: all)")
    kv.add_argument(
        "--kv-block-size",
        type=int,
        metavar="N",
        help="the server's block size in tokens, until its first event says (default 16)",
    )
    kv.add_argument(
        "--kv-table-mib",
        type=int,
        metavar="N",
        help="memory for the map of the server's blocks (default 64 MiB)",
    )


async def _serve(settings: NodeSettings, guard: NodeGuard) -> None:
    # Tracing: the OTEL_* environment variables (edge.observe.tracing), off by default.
    tracing = setup_tracing(service="iop-node")
    node = UpstreamNode(
        settings.upstream,
        name=settings.name,
        api_key=settings.api_key,
        models=settings.models,
        runs_log=settings.runs_log,
        read_timeout_s=settings.read_timeout_s,
        logprobs=settings.logprobs,
        tracing=tracing,
        load_source=settings.load_source,
        load_interval_s=settings.load_interval_s,
        continuation=settings.continuation,
        policy=settings.policy,
        kv=settings.kv,
    )
    server, bound = await start_server(node, settings.host, settings.port, guard=guard)
    print(f"iop-node listening on {settings.host}:{bound}", flush=True)
    guard.reload_on_sighup("iop-node")
    print(f"iop-node: runs go to {settings.upstream}", file=sys.stderr, flush=True)
    kv = f"exact from {settings.kv.events}" if settings.kv else "approximate (no --kv-events)"
    print(f"iop-node: kv index: {kv}", file=sys.stderr, flush=True)
    await wait_for_stop_signal()
    await stop_server(node, server)
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = resolve(args)
    except SettingsError as exc:
        print(f"iop-node: {exc}", file=sys.stderr)
        return 2
    guard = start_guard(settings.guard, settings.host, settings.port)
    if isinstance(guard, str):
        return say_refused("iop-node", guard)
    asyncio.run(_serve(settings, guard))
    return 0


if __name__ == "__main__":
    sys.exit(main())
