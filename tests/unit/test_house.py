"""The house rules of edge/, checked so they cannot creep back (docs/architecture.md).

In edge/ (the generated contract code aside): no function over 80 lines, no class
with more than 15 methods (properties count), no module over 500 lines, one
opening per module (a docstring, not a comment block and a docstring), and no
comment that narrates history (an issue's number, "as before"): git keeps that.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

EDGE = Path(__file__).resolve().parents[2] / "edge"
MAX_FUNCTION_LINES = 80
MAX_METHODS = 15
MAX_MODULE_LINES = 500
_HISTORY = re.compile(
    r"\bissue\s+#?\d+|\bas before\b|\bformerly\b|\bno longer\b|\bused to be\b", re.IGNORECASE
)


def _modules() -> list[Path]:
    return sorted(p for p in EDGE.rglob("*.py") if "_proto" not in p.parts)


def _name(path: Path) -> str:
    return str(path.relative_to(EDGE.parent))


def test_no_function_is_over_80_lines() -> None:
    long = [
        f"{_name(path)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long


def test_no_class_has_more_than_15_methods() -> None:
    large = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [
                    item for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                ]  # fmt: skip
                if len(methods) > MAX_METHODS:
                    large.append(f"{_name(path)}:{node.lineno} {node.name} ({len(methods)})")
    assert not large


def test_no_module_is_over_500_lines() -> None:
    long = [
        f"{_name(path)} ({n} lines)"
        for path in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long


def test_a_module_opens_once() -> None:
    """A module's opening is its docstring: no comment block before it."""
    twice = []
    for path in _modules():
        text = path.read_text()
        first = next((line for line in text.splitlines() if line.strip()), "")
        if first.startswith("#") and ast.get_docstring(ast.parse(text)) is not None:
            twice.append(_name(path))
    assert not twice


def test_no_comment_narrates_history() -> None:
    narrating = []
    for path in _modules():
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for token in tokens:
            if token.type == tokenize.COMMENT and _HISTORY.search(token.string):
                narrating.append(f"{_name(path)}:{token.start[0]}: {token.string.strip()}")
    assert not narrating
