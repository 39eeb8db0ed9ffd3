"""Tests of `openai+http(s)://` node addresses and `iop-node`'s settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.cli import build_parser as edge_parser
from edge.config import ConfigError, parse_config, upstream_url
from edge.nodes.upstream.cli import SettingsError, resolve
from edge.nodes.upstream.cli import build_parser as node_parser


@pytest.mark.parametrize(
    ("address", "url"),
    [
        ("openai+http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
        ("openai+https://models.internal/v1", "https://models.internal/v1"),
        ("127.0.0.1:50051", None),
        ("embedded", None),
    ],
)
def test_upstream_addresses(address: str, url: str | None) -> None:
    """`openai+http(s)://` node addresses name a model server; others are not upstreams."""
    assert upstream_url(address) == url


@pytest.mark.parametrize(
    "address", ["openai+http://", "openai+http://host:99999/v1", "openai+http://h:x"]
)
def test_bad_upstream_addresses_are_config_errors(address: str) -> None:
    """A malformed upstream address is one config error naming the key."""
    doc = {"nodes": [{"name": "n", "address": address}]}
    with pytest.raises(ConfigError, match=r"nodes\[0\]\.address: expected openai\+http://"):
        parse_config(doc, "edge.toml")


def test_config_and_cli_accept_upstream_addresses() -> None:
    """`[[nodes]]` and `iop-edge --node` both take the scheme."""
    doc = {"nodes": [{"name": "local", "address": "openai+http://127.0.0.1:8000/v1"}]}
    assert parse_config(doc, "edge.toml").nodes[0].address == "openai+http://127.0.0.1:8000/v1"
    args = edge_parser().parse_args(["--node", "openai+http://127.0.0.1:8000/v1"])
    assert args.node == ["openai+http://127.0.0.1:8000/v1"]


def test_node_settings_from_file_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The [node] table is read, flags win, `/v1` is added, the key comes from the env."""
    path = tmp_path / "node.toml"
    path.write_text(
        '[node]\nupstream = "http://gpu:8000"\nlisten = "0.0.0.0:7000"\n'
        'models = ["a"]\napi_key_env = "UPSTREAM_KEY"\n'
    )
    monkeypatch.setenv("UPSTREAM_KEY", "sk-test")
    args = node_parser().parse_args(["--config", str(path), "--models", "b,c", "--models", "d"])
    settings = resolve(args)
    assert (settings.host, settings.port, settings.upstream) == (
        "0.0.0.0",
        7000,
        "http://gpu:8000/v1",
    )
    assert settings.models == ("b", "c", "d")
    assert settings.api_key == "sk-test"


def test_node_settings_logprobs(tmp_path: Path) -> None:
    """Logprobs are on by default; `logprobs = false` in [node] or `--no-logprobs` turn
    them off; a value that is not a boolean is an error naming the key."""
    path = tmp_path / "node.toml"
    path.write_text('[node]\nupstream = "http://h/v1"\n')
    assert resolve(node_parser().parse_args(["--config", str(path)])).logprobs is True
    flag = node_parser().parse_args(["--config", str(path), "--no-logprobs"])
    assert resolve(flag).logprobs is False
    path.write_text('[node]\nupstream = "http://h/v1"\nlogprobs = false\n')
    assert resolve(node_parser().parse_args(["--config", str(path)])).logprobs is False
    path.write_text('[node]\nupstream = "http://h/v1"\nlogprobs = "no"\n')
    with pytest.raises(SettingsError, match=r"node\.logprobs"):
        resolve(node_parser().parse_args(["--config", str(path)]))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[node]\nupstream = "http://h/v1"\nport = 1\n', "unknown key node.port"),
        ('[node]\nupstream = "http://h/v1"\nmodels = [1]\n', "node.models: expected a list"),
        ('[node]\nupstream = "http://h/v1"\nread_timeout_s = 0\n', "node.read_timeout_s"),
        ("[node]\nupstream = 5\n", "node.upstream: expected a string"),
        ('[node]\nupstream = "ftp://h"\n', "expected an http:// or https:// URL"),
        (
            '[node]\nupstream = "http://h/v1"\napi_key_env = "IOP_UNSET_KEY_VAR"\n',
            "IOP_UNSET_KEY_VAR is not set",
        ),
        ("[node]\n", "--upstream URL is required"),
    ],
)
def test_node_settings_errors(tmp_path: Path, text: str, message: str) -> None:
    """Each mistake is one line naming what is wrong."""
    path = tmp_path / "node.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=message):
        resolve(node_parser().parse_args(["--config", str(path)]))


def test_node_load_settings_from_file_and_flags(tmp_path: Path) -> None:
    """The load's source and interval come from the [node] table, flags win, and the
    defaults are auto every second; a bad value is one error naming its key."""
    path = tmp_path / "node.toml"
    path.write_text(
        '[node]\nupstream = "http://gpu:8000"\nload_source = "sglang"\nload_interval_s = 5\n'
    )
    settings = resolve(node_parser().parse_args(["--config", str(path)]))
    assert (settings.load_source, settings.load_interval_s) == ("sglang", 5.0)
    args = ["--config", str(path), "--load-source", "none", "--load-interval-s", "0"]
    settings = resolve(node_parser().parse_args(args))
    assert (settings.load_source, settings.load_interval_s) == ("none", 0.0)
    settings = resolve(node_parser().parse_args(["--upstream", "http://gpu:8000"]))
    assert (settings.load_source, settings.load_interval_s) == ("auto", 1.0)
    path.write_text('[node]\nupstream = "http://gpu:8000"\nload_source = "ollama"\n')
    with pytest.raises(SettingsError, match="load_source: 'ollama' is not one of"):
        resolve(node_parser().parse_args(["--config", str(path)]))
    path.write_text('[node]\nupstream = "http://gpu:8000"\nload_interval_s = 0.01\n')
    with pytest.raises(SettingsError, match=r"load_interval_s: 0\.01 is not 0"):
        resolve(node_parser().parse_args(["--config", str(path)]))


def test_node_continuation_setting_from_file_and_flags(tmp_path: Path) -> None:
    """`continuation` comes from the [node] table, the flag wins, the default is auto;
    a value that names no way of continuing is one error naming the key."""
    path = tmp_path / "node.toml"
    path.write_text('[node]\nupstream = "http://gpu:8000"\ncontinuation = "llamacpp"\n')
    assert resolve(node_parser().parse_args(["--config", str(path)])).continuation == "llamacpp"
    args = ["--config", str(path), "--continuation", "none"]
    assert resolve(node_parser().parse_args(args)).continuation == "none"
    args = ["--upstream", "http://gpu:8000"]
    assert resolve(node_parser().parse_args(args)).continuation == "auto"
    path.write_text('[node]\nupstream = "http://gpu:8000"\ncontinuation = "ollama"\n')
    with pytest.raises(SettingsError, match="continuation: 'ollama' is not one of"):
        resolve(node_parser().parse_args(["--config", str(path)]))


def test_node_kv_event_settings_from_file_and_flags(tmp_path: Path) -> None:
    """Without `--kv-events` nothing is read; the [node] table's kv_* keys set where the
    server publishes and the map's bounds, flags win; defaults: every topic, 16-token
    blocks, 64 MiB."""
    parse = node_parser().parse_args
    assert resolve(parse(["--upstream", "http://gpu:8000"])).kv is None
    kv = resolve(parse(["--upstream", "http://gpu:8000", "--kv-events", "tcp://gpu:5557"])).kv
    assert kv is not None
    assert (kv.events, kv.replay, kv.topic, kv.block_size, kv.table_mib) == (
        "tcp://gpu:5557", None, "", 16, 64,
    )  # fmt: skip
    path = tmp_path / "node.toml"
    path.write_text(
        '[node]\nupstream = "http://gpu:8000"\nkv_events = "tcp://gpu:5557"\n'
        'kv_replay = "tcp://gpu:5558"\nkv_topic = "kv"\nkv_block_size = 32\nkv_table_mib = 8\n'
    )
    kv = resolve(parse(["--config", str(path), "--kv-block-size", "64"])).kv
    assert kv is not None
    assert (kv.events, kv.replay, kv.topic, kv.block_size, kv.table_mib) == (
        "tcp://gpu:5557", "tcp://gpu:5558", "kv", 64, 8,
    )  # fmt: skip
    assert kv.max_blocks == 8 * 2**20 // 768


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-replay", "tcp://gpu:5558"], "kv_replay: needs kv_events"),
        (["--kv-events", "gpu:5557"], "kv_events: 'gpu:5557' is not a ZMQ endpoint"),
        (["--kv-events", "tcp://*:5557"], "kv_events: 'tcp://\\*:5557' is not a ZMQ endpoint"),
        (["--kv-events", "tcp://gpu:5557", "--kv-block-size", "0"], "kv_block_size: 0 is not"),
        (["--kv-events", "tcp://gpu:5557", "--kv-table-mib", "0"], "kv_table_mib: 0 is not"),
    ],
)
def test_node_kv_event_settings_errors(flags: list[str], message: str) -> None:
    """A replay without a publisher, an endpoint iop-node cannot connect to (no scheme, a
    wildcard: the server's own bind address) and bounds out of range are one line each."""
    with pytest.raises(SettingsError, match=message):
        resolve(node_parser().parse_args(["--upstream", "http://gpu:8000", *flags]))
