"""The seeded case list: case `index` of a kind comes from its own generator.

So any single case replays alone from (seed, kind, index), whatever ran
before it; the fuzz test and the hostile mix draw from the same list. The
kind `trigger` is the fixed list of known one-packet triggers (no seed).
"""

from __future__ import annotations

import random

from tests.hostile.h1 import h1_case
from tests.hostile.h2 import h2_case
from tests.hostile.triggers import triggers
from tests.hostile.wire import Case

KINDS = ("h1", "h2")
# The API key the edge under fuzz accepts (some cases send it, some do not).
KEY = "hostile-key"


def make_case(seed: int, kind: str, index: int, key: str) -> Case:
    """Case `index` of `kind` (h1, h2, trigger) for `seed`; `key` is the API key some
    cases send."""
    if kind == "trigger":
        return triggers()[index]
    if kind not in KINDS:
        raise ValueError(f"a case kind is one of {(*KINDS, 'trigger')}, not {kind!r}")
    rng = random.Random(f"{seed}:{kind}:{index}")
    return (h1_case if kind == "h1" else h2_case)(rng, index, key)


def interleaved(seed: int, per_kind: int, key: str) -> list[Case]:
    """`per_kind` cases of each kind, alternating h1 and h2."""
    return [make_case(seed, kind, i, key) for i in range(per_kind) for kind in KINDS]
