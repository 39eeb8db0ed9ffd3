"""The files a configuration names, read once (edge.config.files): the supervisor reads
them from disk, its workers from its copy, and the digest covers them."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.config import ConfigError, config_digest
from edge.config.files import bundle, unbundle
from edge.config.parse import load_config_file
from edge.process.supervisor import config_copy, read_copy

TOML = """
[server]
api_keys_file = "plain.keys"
[[keys]]
name = "team-a"
key_file = "team-a.key"
"""


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(TOML)
    (tmp_path / "plain.keys").write_text("sk-plain\n")
    (tmp_path / "team-a.key").write_text("sk-a\n")
    return path


def test_the_digest_covers_the_files_the_configuration_names(tmp_path: Path) -> None:
    """Every file read is kept with the configuration; a key file that changes changes
    the digest although the configuration file did not."""
    path = _config(tmp_path)
    first = load_config_file(path)
    assert sorted(Path(p).name for p in first.files) == ["plain.keys", "team-a.key"]
    assert first.digest != config_digest(path.read_bytes())
    (tmp_path / "team-a.key").write_text("sk-a-rotated\n")
    assert load_config_file(path).digest != first.digest


def test_a_worker_parses_the_supervisors_bytes_never_the_disk(tmp_path: Path) -> None:
    """The copy the supervisor keeps gives a worker the keys it read, whatever the disk
    holds now (a key file changed or removed since); a copy whose bytes are not of its
    digest is refused."""
    path = _config(tmp_path)
    loaded = load_config_file(path)
    copy = config_copy(tmp_path, loaded.digest)
    copy.write_bytes(bundle(loaded.data, loaded.files))
    (tmp_path / "team-a.key").unlink()
    (tmp_path / "plain.keys").write_text("sk-other\n")
    data, files = read_copy(tmp_path, loaded.digest)
    worker = load_config_file(path, data, files)
    assert worker.digest == loaded.digest
    assert worker.config.keys[0].secret == "sk-a"
    assert worker.config.server.api_keys == ("sk-plain",)
    data, files = unbundle(copy.read_bytes())
    files[str(tmp_path / "team-a.key")] = b"sk-forged\n"
    copy.write_bytes(bundle(data, files))
    with pytest.raises(ConfigError, match="changed since it was checked"):
        read_copy(tmp_path, loaded.digest)


def test_a_file_missing_from_the_copy_is_the_configurations_error(tmp_path: Path) -> None:
    path = _config(tmp_path)
    loaded = load_config_file(path)
    files = {p: b for p, b in loaded.files.items() if not p.endswith("team-a.key")}
    with pytest.raises(ConfigError, match="not in the supervisor's copy"):
        load_config_file(path, loaded.data, files)
