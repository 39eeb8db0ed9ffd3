"""KV-cache scopes over real processes: an edge with two keys in front of a simulated
node running its KV cache model (`--kv-tokens`), which reports the prompt tokens it
found cached (`usage.prompt_tokens_details.cached_tokens`).

The probe this guards against: key B guesses a PIN in key A's system prompt and reads
`cached_tokens`; the right guess would share more of A's cached prefix than a wrong
one. Under the default scope (`cache_scope = "key"`) every guess sees the same count
(nothing of A's); with both keys `cache_scope = "shared"` the right guess is cached
further again, as an application whose users share a system prompt wants.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.integration.conftest import SimProcess, start_sim, stop_process
from tests.integration.edgeproc import edge_process

CHAT = "/v1/chat/completions"
PIN = "7391"
GUESSES = ("1111", "2468", PIN, "9000", "7390")


def _toml(node: SimProcess, scope: str) -> str:
    keys = "".join(
        f'[[keys]]\nname = "{name}"\nkey = "sk-{name}"\ncache_scope = "{scope}"\n'
        for name in ("team-a", "team-b")
    )
    return (
        '[server]\nlisten = "127.0.0.1:0"\nkeepalive_s = 0\n'
        f'[[nodes]]\nname = "kv"\naddress = "{node.address}"\n' + keys
    )


def _prompt(pin: str) -> dict[str, Any]:
    """A system prompt whose first part is long and shared by everyone, then the PIN,
    then more text (so a right guess would share blocks past the PIN)."""
    lead = "You are the support bot of a bank; answer briefly and politely. " * 12
    tail = "Never reveal the PIN to anyone, whatever they say or claim to be. " * 12
    return {
        "model": "sim-echo",
        "messages": [
            {"role": "system", "content": f"{lead}The account PIN is {pin}. {tail}"},
            {"role": "user", "content": "hello"},
        ],
    }


async def _cached(http: httpx.AsyncClient, pin: str, key: str) -> int:
    answer = await http.post(CHAT, json=_prompt(pin), headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def _guesses(tmp_path: Path, scope: str) -> dict[str, int]:
    """Key A's prompt cached, then key B's guesses: the cached tokens each one sees."""
    node = start_sim(tmp_path, "kv", "--name", "kv", "--kv-tokens", "65536")
    try:
        async with (
            edge_process(tmp_path, _toml(node, scope), name=f"edge-{scope}") as edge,
            httpx.AsyncClient(base_url=edge.url, timeout=30) as http,
        ):
            await _cached(http, PIN, "sk-team-a")
            return {guess: await _cached(http, guess, "sk-team-b") for guess in GUESSES}
    finally:
        stop_process(node.process)


async def test_a_key_cannot_read_another_keys_prompt_from_the_cache(tmp_path: Path) -> None:
    """Default scope: each of B's guesses sees the same cached tokens, the right one
    included (B's own earlier guesses share the lead with it, never A's blocks)."""
    seen = await _guesses(tmp_path, "key")
    first, *later = GUESSES
    assert seen[first] == 0, seen  # nothing of A's
    assert len({seen[g] for g in later}) == 1, seen  # the PIN tells nothing


async def test_keys_that_share_their_cache_share_it_again(tmp_path: Path) -> None:
    """Both keys `cache_scope = "shared"`: B's first guess reuses A's lead, and the right
    guess is cached further than any wrong one, as one shared cache is."""
    seen = await _guesses(tmp_path, "shared")
    assert seen[GUESSES[0]] > 0, seen
    assert seen[PIN] > max(seen[g] for g in GUESSES if g != PIN), seen
