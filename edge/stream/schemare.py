"""JSON Schema keywords that run a caller's regexes in RE2, and the validation budget.

This module owns how `edge.stream.schema` keeps validation linear and bounded:
RE2 (google-re2) compiles and runs every `pattern`, `patternProperties` and
`additionalProperties` regex, in place of jsonschema's Python `re`; the
validator classes of every draft are rebuilt with those keywords through the
public `jsonschema.validators.extend`, with every keyword counted against a
step budget; and a format checker makes the metaschemas' "regex" format mean
"RE2 runs it". It knows nothing of tools, requests or streams.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from typing import Any

import re2
from jsonschema import FormatChecker
from jsonschema.exceptions import ValidationError
from jsonschema.validators import (
    Draft3Validator,
    Draft4Validator,
    Draft6Validator,
    Draft7Validator,
    Draft201909Validator,
    Draft202012Validator,
    extend,
)

from edge.stream.bounds import MAX_PATTERN_PROGRAM, MAX_VALIDATION_STEPS

__all__ = [
    "LINEAR",
    "META_FORMATS",
    "BudgetExceeded",
    "PatternError",
    "validation_budget",
]

# --- RE2 -------------------------------------------------------------------------

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is the caller's error, not a log line
_RE2_OPTIONS.never_capture = True  # only "does it match" is asked
# Bounds the lazily built DFA of each cached pattern (RE2's default is 8 MiB).
_RE2_OPTIONS.max_mem = 1 << 20


class PatternError(ValueError):
    """A regex that RE2 cannot run, or only at a cost past `MAX_PATTERN_PROGRAM`."""


@lru_cache(maxsize=128)  # with max_mem, at most 128 MiB of RE2 state in all
def _compiled(pattern: str) -> Any:
    try:
        regex = re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as exc:
        why = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise PatternError(
            f"RE2 cannot compile it ({why}); patterns use RE2 syntax, which runs in "
            "linear time (no backreferences or lookaround)"
        ) from None
    if regex.programsize > MAX_PATTERN_PROGRAM:
        raise PatternError(
            f"it compiles to {regex.programsize} RE2 instructions; the limit is "
            f"{MAX_PATTERN_PROGRAM} (use smaller repetition counts)"
        )
    return regex


# --- the validation budget ---------------------------------------------------------


class BudgetExceeded(Exception):
    """Validation took more than `MAX_VALIDATION_STEPS` steps."""


class _Budget:
    __slots__ = ("left",)

    def __init__(self, steps: int) -> None:
        self.left = steps

    def spend(self, steps: int = 1) -> None:
        self.left -= steps
        if self.left < 0:
            raise BudgetExceeded


# A context variable, not a global: validation may run in a worker thread.
_BUDGET: ContextVar[_Budget | None] = ContextVar("schema_budget", default=None)


def _spend(steps: int = 1) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.spend(steps)


@contextmanager
def validation_budget() -> Iterator[None]:
    """One budget of `MAX_VALIDATION_STEPS` for every `schema_error` inside the block
    (all the tool calls of one answer share it); a no-op inside another budget."""
    if _BUDGET.get() is not None:
        yield
        return
    token = _BUDGET.set(_Budget(MAX_VALIDATION_STEPS))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def _search(pattern: str, text: str) -> bool:
    """Whether RE2 finds `pattern` in `text`; a pattern it cannot run matches nothing."""
    # A step per search and per 512 characters: RE2 scans that many in about the
    # time of one keyword (and many patterns times many keys add up).
    _spend(1 + (len(text) >> 9))
    try:
        regex = _compiled(pattern)
    except PatternError:
        return False
    return regex.search(text) is not None


# --- keywords that run regexes, in RE2 ---------------------------------------------

Keyword = Callable[[Any, Any, Any, Any], Iterator[ValidationError] | None]


def _pattern(validator: Any, pattern: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(
    validator: Any, patterns: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional(instance: Mapping[str, Any], schema: Mapping[str, Any]) -> list[str]:
    """The keys matched by neither `properties` nor a `patternProperties` regex."""
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    return [
        key
        for key in instance
        if key not in properties and not any(_search(p, key) for p in patterns)
    ]


def _additional_properties(
    validator: Any, additional: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    extras = _additional(instance, schema)
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        listed = ", ".join(repr(extra) for extra in sorted(extras))
        if "patternProperties" in schema:
            regexes = ", ".join(repr(p) for p in sorted(schema["patternProperties"]))
            verb = "does" if len(extras) == 1 else "do"
            yield ValidationError(f"{listed} {verb} not match any of the regexes: {regexes}")
        else:
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(
                f"Additional properties are not allowed ({listed} {verb} unexpected)"
            )


_REPLACED: dict[str, Keyword] = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
}


def _counted(keyword: Keyword) -> Keyword:
    def counted(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        _spend()
        return keyword(validator, value, instance, schema)

    return counted


def _linear(cls: Any) -> Any:
    """`cls` with regex keywords in RE2 and every keyword counted against the budget."""
    keywords = {name: _REPLACED.get(name, fn) for name, fn in cls.VALIDATORS.items()}
    return _extend(cls, {name: _counted(fn) for name, fn in keywords.items()})


_extend: Callable[..., Any] = extend  # jsonschema's public API, untyped in its stubs


_DRAFTS = (
    Draft3Validator,
    Draft4Validator,
    Draft6Validator,
    Draft7Validator,
    Draft201909Validator,
    Draft202012Validator,
)
LINEAR: dict[Any, Any] = {cls: _linear(cls) for cls in _DRAFTS}

# The metaschemas check `pattern`s and `patternProperties` keys with the
# "regex" format: here that means "RE2 runs it", not "Python's re compiles it".
META_FORMATS = FormatChecker(formats=())


@META_FORMATS.checks("regex", raises=PatternError)
def _is_regex(instance: object) -> bool:
    if isinstance(instance, str):
        _compiled(instance)
    return True
