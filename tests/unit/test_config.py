"""Config: typed values from TOML, and one line naming the file and key per mistake."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import edge.config
from edge.config import Config, ConfigError, load_config


def _load(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "edge.toml"
    path.write_text(text)
    return load_config(path)


def test_the_shipped_config_loads() -> None:
    """config.toml in the repo is valid and runs an embedded node."""
    config = load_config(Path(__file__).parents[2] / "config.toml")
    assert [n.address for n in config.nodes] == ["embedded"]
    assert config.server.listen == "127.0.0.1:8080"


def test_values_are_read(tmp_path: Path) -> None:
    """Every section's keys land in typed fields."""
    config = _load(
        tmp_path,
        """
[server]
listen = "0.0.0.0:9000"
api_keys = ["k1"]
drain_timeout_s = 5
[log]
level = "DEBUG"
format = "json"
queue_bytes = 65536
[timeouts]
first_event_s = 1.5
idle_s = 2
total_s = 3
slow_client_s = 4
[[nodes]]
name = "a"
address = "10.0.0.1:50051"
[models.m1]
strict = true
stream_buffer = true
reasoning_parser = "think_start"
tool_call_formats = ["hermes"]
sentinels = ["<eos>"]
""",
    )
    assert config.server.listen == "0.0.0.0:9000"
    assert config.server.api_keys == ("k1",)
    assert config.log.format == "json"
    assert config.log.queue_bytes == 65536
    assert config.timeouts.first_event_s == 1.5
    assert config.timeouts.slow_client_s == 4
    assert config.nodes[0].address == "10.0.0.1:50051"
    model = config.model("m1")
    assert model.strict
    assert model.reasoning_parser == "think_start"
    assert model.tool_call_formats == ("hermes",)
    assert model.sentinels == ("<eos>",)


def test_model_defaults() -> None:
    """Unconfigured sim models parse <think>; other unconfigured models do not."""
    config = Config()
    assert config.model("sim-echo").reasoning_parser == "think"
    assert config.model("llama").reasoning_parser == "none"


def test_tool_validation(tmp_path: Path) -> None:
    """[models.NAME] tool_validation is strict, report or off; unset, it is None (derived per
    request from the request and the strict output policy)."""
    config = _load(
        tmp_path,
        '[models.a]\ntool_validation = "report"\n[models.b]\ntool_validation = "off"\n'
        '[models.c]\ntool_validation = "strict"\n[models.d]\nstrict = true\n',
    )
    assert [config.model(n).tool_validation for n in "abcd"] == ["report", "off", "strict", None]
    assert config.model("unconfigured").tool_validation is None
    assert config.model("sim-script").tool_validation is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"lenient"', "models.m.tool_validation: expected one of strict, report, off"),
        ("true", "models.m.tool_validation: expected a string"),
        ('["strict"]', "models.m.tool_validation: expected a string"),
    ],
)
def test_bad_tool_validation_is_a_config_error(tmp_path: Path, value: str, message: str) -> None:
    """A bad tool_validation names the file and the key."""
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, f"[models.m]\ntool_validation = {value}\n")


def test_tool_call_formats_default_to_the_tags(tmp_path: Path) -> None:
    """Text tool calls are parsed in the tag formats unless a model opts in to bare and
    fenced JSON; a model table without the key keeps the default."""
    config = _load(
        tmp_path,
        "[models.a]\nstrict = false\n"
        '[models.b]\ntool_call_formats = ["hermes", "json", "fenced"]\n',
    )
    for name in ("a", "unconfigured", "sim-script"):
        assert config.model(name).tool_call_formats == ("hermes", "mistral", "llama")
    assert config.model("b").tool_call_formats == ("hermes", "json", "fenced")


def test_forwarding_policy_keys(tmp_path: Path) -> None:
    """A model table sets its forwarding policy; data: is always allowed; models without a
    table get the defaults (131072 tokens, nothing unsafe forwarded, data: only)."""
    config = _load(
        tmp_path,
        """
[models.big]
max_output_tokens = 1000
allow_chat_template = true
allow_ignore_eos = true
media_url_schemes = ["HTTPS", "http:"]
""",
    )
    policy = config.model("big").forward_policy
    assert policy.max_output_tokens == 1000
    assert policy.allow_chat_template
    assert policy.allow_ignore_eos
    assert policy.media_url_schemes == {"data", "http", "https"}
    for name in ("other", "sim-echo"):
        default = config.model(name).forward_policy
        assert default.max_output_tokens == 131_072
        assert not default.allow_chat_template
        assert not default.allow_ignore_eos
        assert default.media_url_schemes == {"data"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nlisten = 8080\n", "server.listen: expected a string, got int"),
        ('[server]\nlisten = "nohost"\n', "server.listen: expected HOST:PORT"),
        ("[server]\nbogus = 1\n", "unknown key server.bogus"),
        ("[serer]\n", "unknown key serer"),
        ('[log]\nformat = "xml"\n', "log.format: expected one of text, json"),
        ("[log]\nqueue_bytes = 100\n", "log.queue_bytes: must be between 16384 and"),
        ("[timeouts]\nidle_s = -1\n", "timeouts.idle_s: must be >="),
        ("[timeouts]\nidle_s = true\n", "timeouts.idle_s: expected an integer or a number"),
        ('[[nodes]]\nname = "a"\n', "nodes[0].address: missing"),
        ('[[nodes]]\naddress = "a:1"\n[[nodes]]\naddress = "a:1"\n', "duplicate node name"),
        ('[models.m]\ntool_call_formats = ["xml"]\n', "unknown format 'xml'"),
        ('[models.m]\nstrict = "yes"\n', "models.m.strict: expected a boolean"),
        ("[models.m]\nmax_output_tokens = 0\n", "models.m.max_output_tokens: must be between 1"),
        (
            "[models.m]\nmax_output_tokens = 4294967296\n",
            "models.m.max_output_tokens: must be between 1 and 4294967295",
        ),
        ("[models.m]\nmax_output_tokens = 1.5\n", "max_output_tokens: expected an integer"),
        ('[models.m]\nallow_ignore_eos = "no"\n', "models.m.allow_ignore_eos: expected a boolean"),
        ("[models.m]\nallow_chat_template = 1\n", "models.m.allow_chat_template: expected a"),
        (
            '[models.m]\nmedia_url_schemes = ["file"]\n',
            "models.m.media_url_schemes: unsupported scheme 'file' (allowed: data, http, https)",
        ),
        ('[models.m]\nmedia_url_schemes = "https"\n', "models.m.media_url_schemes: expected a"),
        ('[server]\napi_keys_file = "missing.txt"\n', "server.api_keys_file: cannot read"),
        (
            '[server]\ncors_allow_origins = ["https://a.example/"]\n',
            "server.cors_allow_origins: 'https://a.example/' is not an origin",
        ),
        ('[server]\ncors_allow_origins = ["a.example"]\n', "is not an origin"),
        ('[server]\ncors_allow_origins = "*"\n', "server.cors_allow_origins: expected a"),
        ("[server\n", "not valid TOML"),
    ],
)
def test_mistakes_name_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    """Each mistake is one ConfigError line that names the file and the key."""
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(str(tmp_path / "edge.toml"))
    assert message in line


def test_cors_origins_are_read_in_lower_case(tmp_path: Path) -> None:
    """Origins as browsers send them (lower case), "*" as it is; none by default."""
    assert _load(tmp_path, "").server.cors_allow_origins == ()
    text = '[server]\ncors_allow_origins = ["HTTPS://App.example.com:8443", "*"]\n'
    config = _load(tmp_path, text)
    assert config.server.cors_allow_origins == ("https://app.example.com:8443", "*")


def test_api_keys_file(tmp_path: Path) -> None:
    """Keys from api_keys_file (relative to the config) join api_keys; comments skipped."""
    (tmp_path / "keys.txt").write_text("# ops keys\nkey-a\n\nkey-b\n")
    config = _load(tmp_path, '[server]\napi_keys = ["k0"]\napi_keys_file = "keys.txt"\n')
    assert config.server.api_keys == ("k0", "key-a", "key-b")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[timeouts]\ntotal_s = inf\n", "timeouts.total_s: must be a finite number"),
        ("[timeouts]\nidle_s = nan\n", "timeouts.idle_s: must be a finite number"),
        ("[timeouts]\ntotal_s = 1e300\n", "timeouts.total_s: must be <="),
        ('[server]\napi_keys = [" "]\n', "server.api_keys: an empty key"),
    ],
)
def test_numbers_are_finite_and_keys_non_empty(tmp_path: Path, text: str, message: str) -> None:
    """Infinite, NaN or absurd durations and empty API keys are config mistakes, not 500s."""
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        _load(tmp_path, text)


def test_indented_comments_in_the_keys_file_are_not_keys(tmp_path: Path) -> None:
    """A comment line is skipped even when indented: it never becomes a valid key."""
    (tmp_path / "keys.txt").write_text("key-a\n  # revoked: sk-old\n")
    config = _load(tmp_path, '[server]\napi_keys_file = "keys.txt"\n')
    assert config.server.api_keys == ("key-a",)


def test_max_connections_defaults_to_derived_and_takes_a_whole_number(tmp_path: Path) -> None:
    """0 (the default) means derived from the file-descriptor limit; a fraction, a
    negative number or a string is a config error naming the key."""
    assert Config().server.max_connections == 0
    assert _load(tmp_path, "[server]\nmax_connections = 500\n").server.max_connections == 500
    for bad in ("-1", "1.5", '"many"', "true"):
        with pytest.raises(ConfigError, match=r"server\.max_connections"):
            _load(tmp_path, f"[server]\nmax_connections = {bad}\n")


def test_idle_and_body_timeouts_default_and_take_positive_seconds(tmp_path: Path) -> None:
    """5 s idle and 60 s body by default; zero, negative or non-numbers name the key."""
    assert Config().server.idle_timeout_s == 5.0
    assert Config().server.body_timeout_s == 60.0
    config = _load(tmp_path, "[server]\nidle_timeout_s = 0.5\nbody_timeout_s = 2\n")
    assert (config.server.idle_timeout_s, config.server.body_timeout_s) == (0.5, 2.0)
    for key in ("idle_timeout_s", "body_timeout_s"):
        for bad in ("0", "-1", '"soon"', "inf", "1e9"):
            with pytest.raises(ConfigError, match=rf"server\.{key}"):
                _load(tmp_path, f"[server]\n{key} = {bad}\n")


def test_fleet_keys_default(tmp_path: Path) -> None:
    """[routing], [admission] and [[nodes]] max_runs default as docs/configuration.md says."""
    config = _load(tmp_path, '[[nodes]]\naddress = "10.0.0.1:1"\n')
    assert config.routing.policy == "least_loaded"
    assert config.routing.retries == 2
    assert config.routing.retry_backoff_s == 0.05
    assert config.routing.breaker_failures == 5
    assert config.routing.breaker_cooldown_s == 5.0
    assert config.admission.max_queue == 1000
    assert config.admission.queue_timeout_s == 30.0
    assert config.nodes[0].max_runs is None


def test_fleet_keys_are_read(tmp_path: Path) -> None:
    """Every fleet key lands in its typed field; max_runs = 0 means no limit."""
    config = _load(
        tmp_path,
        """
[routing]
policy = "affinity"
retries = 0
retry_backoff_s = 0.2
breaker_failures = 3
breaker_cooldown_s = 1.5
[admission]
max_queue = 0
queue_timeout_s = 2
[[nodes]]
name = "a"
address = "10.0.0.1:1"
max_runs = 8
[[nodes]]
name = "b"
address = "10.0.0.2:1"
max_runs = 0
""",
    )
    assert config.routing.policy == "affinity"
    assert (config.routing.retries, config.routing.retry_backoff_s) == (0, 0.2)
    assert (config.routing.breaker_failures, config.routing.breaker_cooldown_s) == (3, 1.5)
    assert (config.admission.max_queue, config.admission.queue_timeout_s) == (0, 2.0)
    assert [n.max_runs for n in config.nodes] == [8, 0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[routing]\npolicy = "random"\n', "routing.policy: expected one of least_loaded"),
        ("[routing]\nretries = -1\n", "routing.retries: must be between 0 and 10"),
        ("[routing]\nretries = 1.5\n", "routing.retries: expected an integer"),
        ("[routing]\nretry_backoff_s = -0.1\n", "routing.retry_backoff_s: must be >="),
        ("[routing]\nbreaker_failures = 0\n", "routing.breaker_failures: must be between 1"),
        ("[routing]\nbreaker_cooldown_s = 0\n", "routing.breaker_cooldown_s: must be >="),
        ("[routing]\nbreaker_cooldown_s = inf\n", "routing.breaker_cooldown_s: must be a finite"),
        ("[routing]\nbogus = 1\n", "unknown key routing.bogus"),
        ("[admission]\nmax_queue = -1\n", "admission.max_queue: must be between 0"),
        ("[admission]\nqueue_timeout_s = 0\n", "admission.queue_timeout_s: must be >="),
        ('[admission]\nmax_queue = "10"\n', "admission.max_queue: expected an integer"),
        ('[[nodes]]\naddress = "a:1"\nmax_runs = -2\n', "nodes[0].max_runs: must be between 0"),
        ('[[nodes]]\naddress = "a:1"\nmax_runs = true\n', "nodes[0].max_runs: expected an int"),
    ],
)
def test_fleet_key_mistakes_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    """A wrong fleet key is one config error line naming it."""
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text)
    assert message in str(info.value)


def test_the_package_names_come_from_its_modules() -> None:
    """`from edge.config import X` works for every name of `__all__` (looked up lazily)."""
    for name in edge.config.__all__:
        assert getattr(edge.config, name) is not None, name
    from edge.config.schema import Config as defined

    assert edge.config.Config is defined


def test_a_node_command_loads_none_of_the_edge_settings() -> None:
    """The node commands read TOML and addresses (`edge.config.toml`, `.address`) without
    loading the settings, and through them the edge's API and stream code."""
    code = (
        "import sys, edge.nodes.sim.cli, edge.nodes.upstream.cli;"
        " loaded = [m for m in sys.modules if m.startswith("
        "('edge.config.schema', 'edge.config.parse', 'edge.api', 'edge.stream'))];"
        " assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
