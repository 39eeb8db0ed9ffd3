"""Function calls per request from two cProfile files, and two trees' counts compared.

Pure, apart from reading a profile file (`load`): it knows nothing of the processes
that wrote them (`benchmarks.calls`).

- A function is known by its file, normalised so the same file compares across trees
  (`normal_path`: the tree's root, a revision's checkout, a venv's site-packages and the
  standard library's folder are cut off), and its name; line numbers are left out, since
  they move between revisions, so functions of one name in one file count together.
  C functions (builtins, methods of built-in types) are cProfile's file `~`.
- Calls per request: the counts of a run of `large` requests minus those of a run of
  `small`, over `large - small` (`per_request`): what starting and stopping the edge
  costs is in both runs and cancels out.
- `differences`: the functions whose calls per request differ most between two trees,
  with those found in only one of them marked, and a function that changed files
  compared with itself (found by its name, when one function of that name is in each
  tree alone); `areas`: calls per request by package.
- Some C methods are named with their type's address (`__new__ of type object at
  0x...`), which changes from process to process: `normal_name` drops it.
"""

from __future__ import annotations

import pstats
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

# (normalised file, function name)
Key = tuple[str, str]
BUILTIN_FILE = "~"
STDLIB = "<stdlib>"
_SITE = re.compile(r"/(?:site|dist)-packages/(.+)$")
_STDLIB = re.compile(r"/lib/python\d+\.\d+/(.+)$")
# cProfile names a type's C methods by the type's address (`... of type object at 0x...`),
# which differs from one process to the next.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def normal_path(path: str, roots: Iterable[str] = ()) -> str:
    """`path` as it reads in any tree: relative to a site-packages folder (a venv inside
    a tree's folder too), else to the first of `roots` it is under (a tree's checkout),
    else `<stdlib>/...` for the standard library's; cProfile's `~` and `<frozen ...>`,
    `<string>` as they are."""
    if match := _SITE.search(path):
        return match.group(1)
    for root in roots:
        prefix = root.rstrip("/") + "/"
        if path.startswith(prefix):
            return path[len(prefix) :]
    if match := _STDLIB.search(path):
        return f"{STDLIB}/{match.group(1)}"
    return path


def normal_name(name: str) -> str:
    """A function's name without the address cProfile gives some C methods."""
    return _ADDRESS.sub("", name) if " at 0x" in name else name


def counts(
    stats: Mapping[tuple[str, int, str], tuple[object, ...]], roots: Iterable[str] = ()
) -> dict[Key, int]:
    """Calls per function (recursive calls included) of pstats' raw table
    `{(file, line, name): (primitive calls, calls, ...)}`, by normalised key."""
    roots = tuple(roots)
    out: dict[Key, int] = {}
    for (path, _line, name), row in stats.items():
        key = (normal_path(path, roots), normal_name(name))
        calls = row[1]
        assert isinstance(calls, int)
        out[key] = out.get(key, 0) + calls
    return out


def load(profile: Path, roots: Iterable[str] = ()) -> dict[Key, int]:
    """The calls per function of a file cProfile wrote (`python -m cProfile -o FILE`)."""
    return counts(pstats.Stats(str(profile)).stats, roots)  # type: ignore[attr-defined]


def merged(*tables: Mapping[Key, int]) -> dict[Key, int]:
    """The calls of several profiles (a process's threads) added up by function."""
    out: dict[Key, int] = {}
    for table in tables:
        for key, n in table.items():
            out[key] = out.get(key, 0) + n
    return out


def per_request(
    small: Mapping[Key, int], large: Mapping[Key, int], requests: int
) -> dict[Key, float]:
    """Calls per request of every function seen in either run: (large - small) /
    `requests`, the number of requests more the large run served."""
    if requests <= 0:
        raise ValueError("the large run must serve more requests than the small one")
    return {k: (large.get(k, 0) - small.get(k, 0)) / requests for k in {*small, *large}}


def total(calls: Mapping[Key, float]) -> float:
    return sum(calls.values())


@dataclass(frozen=True)
class Difference:
    """One function's calls per request in A and B. `only` is "A" or "B" when the
    function is in one tree's profiles only (new in A, or gone from it); `moved_from`
    is B's file of a function that A has in another file."""

    file: str
    name: str
    a: float
    b: float
    only: str | None
    moved_from: str | None = None

    @property
    def delta(self) -> float:
        return self.a - self.b

    @property
    def where(self) -> str:
        return f"{self.file}:{self.name}"


def moves(a: Mapping[Key, float], b: Mapping[Key, float]) -> dict[Key, Key]:
    """A's key -> B's for a function that changed files: of the functions in one tree
    only, the one name found once in A's only and once in B's only."""
    new: dict[str, list[Key]] = {}
    gone: dict[str, list[Key]] = {}
    for key in a:
        if key not in b:
            new.setdefault(key[1], []).append(key)
    for key in b:
        if key not in a:
            gone.setdefault(key[1], []).append(key)
    return {
        keys[0]: gone[name][0]
        for name, keys in new.items()
        if len(keys) == 1 and len(gone.get(name, ())) == 1
    }


def differences(
    a: Mapping[Key, float], b: Mapping[Key, float], top: int, floor: float = 0.05
) -> list[Difference]:
    """The `top` functions whose calls per request differ most between A and B (by
    the size of the difference; ties by name), leaving out differences under `floor`.
    A function that moved to another file (`moves`) is compared with itself."""
    moved = moves(a, b)
    paired = set(moved.values())
    rows = []
    for key in {*a, *b} - paired:
        if key in moved:
            row = Difference(*key, a[key], b[moved[key]], None, moved[key][0])
        else:
            only = None if key in a and key in b else ("A" if key in a else "B")
            row = Difference(*key, a.get(key, 0.0), b.get(key, 0.0), only)
        if abs(row.delta) >= floor:
            rows.append(row)
    rows.sort(key=lambda r: (-abs(r.delta), r.file, r.name))
    return rows[:top]


def area(file: str) -> str:
    """Where a normalised file belongs: `edge/<layer>`, a package (trio, grpclib, ...),
    "stdlib", "C (builtins)", or "generated" (`<string>`: dataclasses' methods, ...)."""
    if file == BUILTIN_FILE:
        return "C (builtins)"
    if file.startswith(STDLIB + "/") or file.startswith("<frozen"):
        return "stdlib"
    if file.startswith("<"):
        return "generated"
    parts = file.split("/")
    if parts[0] == "edge" and len(parts) > 2:
        return f"edge/{parts[1]}"
    return parts[0].removesuffix(".py")


def areas(calls: Mapping[Key, float]) -> dict[str, float]:
    """Calls per request by `area`, largest first."""
    out: dict[str, float] = {}
    for (file, _), n in calls.items():
        out[area(file)] = out.get(area(file), 0.0) + n
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))
