"""API keys in the configuration: the `[[keys]]` entries and `[server] api_keys_file`.

Owns where a secret comes from (the file, the environment, a key file), the checks on
names and secrets, and comparing secrets in constant time. Messages name the entry and
the setting, never the secret.
"""

from __future__ import annotations

import hmac
import os
import re
from pathlib import Path
from typing import Any

from edge.config.files import ConfigFiles
from edge.config.routing import SERVICE_TIERS
from edge.config.schema import KeyConfig
from edge.config.spec import read_key, read_keys
from edge.config.toml import ConfigError, TableReader

# A key's name is a metric label and a log field: short, plain.
_KEY_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# Where a `[[keys]]` entry's secret comes from, exactly one of these keys, and what each
# holds (its meaning in the generated reference: no field of KeyConfig is named so).
SECRET_SOURCES = {
    "key": "The key itself.",
    "key_env": "The name of an environment variable holding the key.",
    "key_file": "A file holding the key (relative to the config file).",
}


def _keys(
    source: str, raw_keys: list[Any], api_keys: tuple[str, ...], files: ConfigFiles
) -> tuple[KeyConfig, ...]:
    """`[[keys]]`: each with a name and exactly one of key, key_env, key_file.

    Messages name the entry and the setting, never the secret.
    """
    keys: list[KeyConfig] = []
    for i, raw in enumerate(raw_keys):
        r = TableReader(source, f"keys[{i}]", raw)
        name = read_key(r, KeyConfig, "name")
        if name is None:
            raise r.fail("name", "missing (a name for logs and metrics)")
        if not _KEY_NAME.match(name):
            raise r.fail("name", "expected 1 to 64 of A-Z a-z 0-9 . _ -")
        if name.startswith("api_keys"):
            raise r.fail(
                "name", "names starting 'api_keys' are the keys of [server] api_keys; pick another"
            )
        sources = {k: r.get(k, str, None) for k in SECRET_SOURCES}
        given = [k for k, value in sources.items() if value is not None]
        if len(given) != 1:
            raise r.fail("key", f"give exactly one of {', '.join(SECRET_SOURCES)}")
        secret = _secret(source, r, given[0], sources[given[0]], files)
        if any(not 1 <= ord(c) < 127 or c.isspace() for c in secret):
            raise r.fail(given[0], "the key must be printable ASCII without spaces")
        settings = read_keys(r, KeyConfig, skip=("name",), checks={"service_tiers": _tiers})
        if settings["service_tier"] not in settings["service_tiers"]:
            raise r.fail("service_tier", "must be one of the key's service_tiers")
        r.done()
        if any(k.name == name for k in keys):
            raise ConfigError(f"{source}: keys[{i}].name: duplicate key name {name!r}")
        if any(hmac_equal(k.secret, secret) for k in keys) or secret in api_keys:
            raise ConfigError(f"{source}: keys[{i}].{given[0]}: the same key is configured twice")
        keys.append(KeyConfig(name, secret, **settings))
    return tuple(keys)


def _tiers(r: TableReader, key: str, tiers: tuple[str, ...]) -> tuple[str, ...]:
    """A key's `service_tiers`: known tiers, at least one, each once."""
    unknown = [tier for tier in tiers if tier not in SERVICE_TIERS]
    if unknown:
        raise r.fail(key, f"{unknown[0]!r} is not one of {', '.join(SERVICE_TIERS)}")
    if not tiers:
        raise r.fail(key, "name at least one tier")
    return tuple(dict.fromkeys(tiers))


def hmac_equal(a: str, b: str) -> bool:
    """Whether two secrets are equal, in time that does not tell where they differ."""
    return hmac.compare_digest(a.encode(), b.encode())


def _secret(source: str, r: TableReader, how: str, value: str, files: ConfigFiles) -> str:
    """The secret of a `[[keys]]` entry, from the config, the environment or a file."""
    if how == "key_env":
        secret = os.environ.get(value, "").strip()
        if not secret:
            raise r.fail(how, f"the environment variable {value!r} is not set or empty")
        return secret
    if how == "key_file":
        try:
            secret = files.bytes_of(_beside(source, value)).decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise r.fail(how, f"cannot read {value}: {why}") from None
        if not secret:
            raise r.fail(how, f"{value} holds no key")
        return secret
    if not value.strip():
        raise r.fail(how, "an empty key would let anyone in")
    return value.strip()


def _read_keys(source: str, path: str, files: ConfigFiles) -> tuple[str, ...]:
    """API keys from a file: one per line; blank lines and # comments skipped."""
    try:
        text = files.bytes_of(_beside(source, path)).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"{source}: server.api_keys_file: cannot read {path}: {why}") from None
    stripped = (line.strip() for line in text.splitlines())
    keys = tuple(line for line in stripped if line and not line.startswith("#"))
    if not keys:
        raise ConfigError(f"{source}: server.api_keys_file: {path} holds no key")
    return keys


def _beside(source: str, path: str) -> Path:
    """`path` relative to the config file `source` (the working directory for defaults)."""
    return (Path(source).parent if source != "<defaults>" else Path(".")) / path
