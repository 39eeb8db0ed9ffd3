"""The files a configuration names (key files, `api_keys_file`, a node's token and TLS
files), read once and carried with it.

The supervisor parses the configuration reading each file from disk (`ConfigFiles()`
records what it read); its workers parse the same bytes from the supervisor's copy
(`ConfigFiles(bundle)`), never the disk, so every worker, started or restarted, runs the
keys the supervisor checked. `bundle` / `unbundle` are that copy's format: the
configuration file's bytes and every file's bytes by path, one msgpack document.
`files_digest` folds the files into the configuration's digest.
"""

from __future__ import annotations

import errno
import hashlib
from collections.abc import Mapping
from pathlib import Path

import msgspec


class ConfigFiles:
    """Where a parse reads the files its configuration names: the disk (each read kept),
    or the bytes a supervisor read (`given`; a path it did not read is an error)."""

    __slots__ = ("_given", "read")

    def __init__(self, given: Mapping[str, bytes] | None = None) -> None:
        self._given = given
        # Every file read, by path as the configuration resolved it.
        self.read: dict[str, bytes] = {}

    def bytes_of(self, path: Path) -> bytes:
        """The bytes of `path`. Raises OSError as reading it would."""
        key = str(path)
        if self._given is None:
            data = path.read_bytes()
        elif key in self._given:
            data = self._given[key]
        else:
            raise FileNotFoundError(errno.ENOENT, "not in the supervisor's copy", key)
        self.read[key] = data
        return data


class _Bundle(msgspec.Struct, frozen=True):
    config: bytes
    files: dict[str, bytes]


def bundle(config: bytes, files: Mapping[str, bytes]) -> bytes:
    """The configuration file's bytes and the files it names, as one document."""
    return msgspec.msgpack.encode(_Bundle(config, dict(files)))


def unbundle(data: bytes) -> tuple[bytes, dict[str, bytes]]:
    """`bundle`'s input back. Raises msgspec.DecodeError for anything else."""
    found = msgspec.msgpack.decode(data, type=_Bundle)
    return found.config, found.files


def files_digest(config_digest: str, files: Mapping[str, bytes]) -> str:
    """A configuration's digest with the files it names folded in (none: `config_digest`
    as it is), the first 16 hex digits of a sha256 like it."""
    if not files:
        return config_digest
    h = hashlib.sha256(config_digest.encode())
    for path in sorted(files):
        h.update(b"\0" + path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()[:16]
