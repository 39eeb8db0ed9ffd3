"""An import-linter contract type: no import cycle between modules or between packages.

import-linter's own `acyclic_siblings` finds these cycles but names neither their
members nor the imports that make them, and knows no cycle that is allowed for now.
This one, for every package under `ancestors` (at every depth), treats its children as
nodes (a child package stands for everything in it), and fails on each set of children
that import one another in a circle, printing the circle and, per step, the
file:line of the imports that make it. `known_cycles` lists the circles allowed for now
("PACKAGE: CHILD, CHILD, ..."): each is reported as a warning, and so is an entry that no
longer matches; a circle that is not listed, or that has grown past its entry, fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import grimp
from importlinter import Contract, ContractCheck, fields, output

Step = tuple[str, str]  # (importer child, imported child) of one package


class AcyclicContract(Contract):
    type_name = "acyclic"

    ancestors = fields.ListField(subfield=fields.StringField())
    known_cycles = fields.ListField(subfield=fields.StringField(), required=False)

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        ancestors = cast("list[str]", self.ancestors)  # the fields hold their values now
        entries = cast("list[str] | None", self.known_cycles) or []
        known = [_parse_known(entry) for entry in entries]
        matched: set[int] = set()
        broken: list[str] = []
        warnings: list[str] = []
        for package in sorted(_packages(graph, ancestors)):
            steps = _steps(graph, package)
            for members in _circles(steps):
                text = _describe(graph, package, members, steps)
                entry = next(
                    (i for i, (p, m) in enumerate(known) if p == package and members <= m), None
                )
                if entry is None:
                    broken.append(text)
                else:
                    matched.add(entry)
                    warnings.append(f"known cycle (to be removed by the layout move): {text}")
        for i, listed in enumerate(entries):
            if i not in matched:
                warnings.append(f"known cycle {listed!r} matches no cycle now: update known_cycles")
        return ContractCheck(kept=not broken, warnings=warnings, metadata={"broken": broken})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for text in check.metadata["broken"]:
            output.print_error(f"New import cycle: {text}", bold=False)
            output.new_line()


def _parse_known(entry: str) -> tuple[str, frozenset[str]]:
    package, _, children = entry.partition(":")
    names = frozenset(f"{package.strip()}.{c.strip()}" for c in children.split(",") if c.strip())
    return package.strip(), names


def _packages(graph: grimp.ImportGraph, ancestors: list[str]) -> set[str]:
    """Every package under (and including) the ancestors: a module with children."""
    out: set[str] = set()
    for ancestor in ancestors:
        for module in {ancestor} | graph.find_descendants(ancestor):
            if graph.find_children(module):
                out.add(module)
    return out


def _steps(graph: grimp.ImportGraph, package: str) -> dict[Step, list[tuple[str, str]]]:
    """Child -> child imports within `package`, each with its (importer, imported) modules."""
    prefix = package + "."
    steps: dict[Step, list[tuple[str, str]]] = {}
    for child in graph.find_children(package):
        for module in {child} | graph.find_descendants(child):
            for imported in graph.find_modules_directly_imported_by(module):
                if not imported.startswith(prefix):
                    continue
                target = prefix + imported[len(prefix) :].split(".")[0]
                if target != child:
                    steps.setdefault((child, target), []).append((module, imported))
    return steps


def _circles(steps: dict[Step, Any]) -> list[frozenset[str]]:
    """The strongly connected sets of two or more children (fine for dozens of them)."""
    succ: dict[str, set[str]] = {}
    for a, b in steps:
        succ.setdefault(a, set()).add(b)
    reach = {node: _reachable(succ, node) for node in succ}
    circles = {
        frozenset({a} | {b for b in reach[a] if a in reach.get(b, ())})
        for a in succ
        if a in reach[a]
    }
    return sorted(circles, key=sorted)


def _reachable(succ: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(succ.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(succ.get(node, ()))
    return seen


def _describe(
    graph: grimp.ImportGraph, package: str, members: frozenset[str], steps: dict[Step, Any]
) -> str:
    """`package: a -> b -> a` (the shortest circle), then each step's imports (file:line)."""
    path = min((_shortest_circle(m, members, steps) for m in sorted(members)), key=len)
    start = path[0]
    short = " -> ".join(m[len(package) + 1 :] for m in [*path, start])
    lines = [f"{package}: {short} (members: {', '.join(sorted(members))})"]
    for a, b in zip(path, [*path[1:], start], strict=True):
        for importer, imported in sorted(steps[(a, b)]):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                where = f"{_path_of(importer)}:{detail['line_number']}"
                lines.append(f"    {where}: {importer} -> {imported}")
    return "\n".join(lines)


def _shortest_circle(start: str, members: frozenset[str], steps: dict[Step, Any]) -> list[str]:
    """The shortest path start -> ... -> start through the members (breadth first)."""
    paths = [[start]]
    while paths:
        path = paths.pop(0)
        for a, b in sorted(steps):
            if a != path[-1] or b not in members:
                continue
            if b == start:
                return path
            if b not in path:
                paths.append([*path, b])
    raise AssertionError(f"no circle through {start}")


def _path_of(module: str) -> str:
    base = Path(*module.split("."))
    return str(base / "__init__.py") if base.is_dir() else f"{base}.py"
