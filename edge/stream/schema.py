"""Callers' JSON Schemas: bounded checks, and validation whose cost is bounded.

This module owns what the edge does with a schema a caller sent (a tool's
`parameters`, a strict `response_format`): its size and depth limits, whether
it is a valid schema, and validating model output against it. It does not
know tools, requests or the stream; it does no I/O ($refs are never fetched).

Why not plain jsonschema: its `pattern`, `patternProperties` and
`additionalProperties` run the caller's regex in Python's backtracking `re`,
where `^(a+)+$` against 30 a's and a "b" takes minutes. Here those keywords run
in RE2 (linear in the text), through `jsonschema.validators.extend`; the
`regex` format of the metaschema checks patterns with RE2 too, so a pattern RE2
cannot compile (backreferences, lookaround) is refused when the schema is
declared. Every keyword evaluation also counts against a budget
(`MAX_VALIDATION_STEPS`): past it, validation stops with an error.

jsonschema picks the validator class again for any subschema carrying its
own `$schema` (`evolve` calls `validator_for`), which would leave RE2 behind:
so `$schema` is accepted only at the root, where it picks the dialect and is
then dropped from the schema the validator sees (a `$ref` to the root then
keeps the RE2 class). `unevaluatedProperties` finds evaluated keys with `re`
(in jsonschema's private helpers), so it is refused next to `patternProperties`.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from typing import Any

import re2
import referencing
import referencing.exceptions
from jsonschema import FormatChecker
from jsonschema.exceptions import ValidationError, best_match
from jsonschema.protocols import Validator
from jsonschema.validators import (
    Draft3Validator,
    Draft4Validator,
    Draft6Validator,
    Draft7Validator,
    Draft201909Validator,
    Draft202012Validator,
    extend,
    validator_for,
)
from referencing.jsonschema import DRAFT202012

from edge.stream.limits import (
    MAX_PATTERN_PROGRAM,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_VALIDATION_STEPS,
)

__all__ = [
    "schema_error",
    "schema_key",
    "schema_limit_problem",
    "schema_problem",
    "validation_budget",
]

# --- RE2 -------------------------------------------------------------------------

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is the caller's error, not a log line
_RE2_OPTIONS.never_capture = True  # only "does it match" is asked
# Bounds the lazily built DFA of each cached pattern (RE2's default is 8 MiB).
_RE2_OPTIONS.max_mem = 2 << 20


class PatternError(ValueError):
    """A regex that RE2 cannot run, or only at a cost past `MAX_PATTERN_PROGRAM`."""


@lru_cache(maxsize=256)
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


def pattern_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be used (None when RE2 runs it within the limits)."""
    try:
        _compiled(pattern)
    except PatternError as exc:
        return str(exc)
    return None


# --- the validation budget ---------------------------------------------------------


class _BudgetExceeded(Exception):
    """Validation took more than `MAX_VALIDATION_STEPS` steps."""


class _Budget:
    __slots__ = ("left",)

    def __init__(self, steps: int) -> None:
        self.left = steps

    def spend(self, steps: int = 1) -> None:
        self.left -= steps
        if self.left < 0:
            raise _BudgetExceeded


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
    # A step per 512 characters: RE2 scans that in about the time of one keyword.
    _spend(len(text) >> 9)
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
_LINEAR: dict[Any, Any] = {cls: _linear(cls) for cls in _DRAFTS}

# The metaschemas check `pattern`s and `patternProperties` keys with the
# "regex" format: here that means "RE2 runs it", not "Python's re compiles it".
_META_FORMATS = FormatChecker(formats=())


@_META_FORMATS.checks("regex", raises=PatternError)
def _is_regex(instance: object) -> bool:
    if isinstance(instance, str):
        _compiled(instance)
    return True


# --- limits and validity of a declared schema ----------------------------------------


def schema_key(schema: Mapping[str, Any]) -> str:
    """The canonical JSON of a schema: its cache key, and what its size is measured on."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), default=str)


_NAME_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
_DATA = frozenset({"const", "enum", "default", "examples"})


def _structure_problem(schema: Mapping[str, Any]) -> str | None:
    """Depth, a nested `$schema`, or `unevaluatedProperties` with `patternProperties`.

    Iterative, so a deep schema costs no recursion; data keywords (`const`,
    `enum`, ...) are skipped except where they name properties.
    """
    stack: list[tuple[Any, int, str, bool]] = [(schema, 1, "$", False)]
    seen: set[str] = set()
    while stack:
        node, depth, path, name_map = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"is nested more than {MAX_SCHEMA_DEPTH} levels deep (limit {MAX_SCHEMA_DEPTH})"
        if isinstance(node, dict):
            if not name_map:
                if isinstance(node.get("$schema"), str) and depth > 1:
                    return f"has $schema below its root (at {path}); only the root names a dialect"
                seen.update(k for k in ("unevaluatedProperties", "patternProperties") if k in node)
            for key, value in node.items():
                if isinstance(value, dict | list) and (name_map or key not in _DATA):
                    stack.append((value, depth + 1, f"{path}.{key}", key in _NAME_MAPS))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{path}[{i}]", False) for i, v in enumerate(node))
    if len(seen) == 2:
        return "uses unevaluatedProperties together with patternProperties, which is not supported"
    return None


def schema_limit_problem(schema: Mapping[str, Any]) -> str | None:
    """Which limit `schema` breaks, said as "is ... (limit N)"; None when within them."""
    problem = _structure_problem(schema)
    if problem is not None:
        return problem
    size = len(schema_key(schema).encode())
    if size > MAX_SCHEMA_BYTES:
        return f"is {size} bytes as JSON; the limit is {MAX_SCHEMA_BYTES} bytes"
    return None


# Schema checks, keyed by a digest of the canonical JSON: an agent declares the
# same tools on every request, and check_schema costs far more than the key. A
# schema checked at request time (in a worker thread) is still in this cache when
# its run's output is validated (on the loop) unless thousands of other schemas
# came in between; the digest keeps each entry small.
_CHECKED_MAX = 4096
_CHECKED: OrderedDict[bytes, str | None] = OrderedDict()
# Compiled validators hold their schema: fewer of them.
_CACHE_MAX = 256
_VALIDATORS: OrderedDict[str, Validator] = OrderedDict()
_NO_RETRIEVAL: referencing.Registry[Any] = referencing.Registry()
_ROOT_URI = "urn:iop:schema"


def schema_problem(schema: Mapping[str, Any]) -> str | None:
    """Why `schema` is not a valid, usable JSON Schema (None when it is); cached.

    Callers check `schema_limit_problem` first: this one assumes a bounded schema.
    """
    try:
        key = hashlib.blake2b(schema_key(schema).encode(), digest_size=16).digest()
    except RecursionError:
        return "the schema is nested too deeply"
    if key in _CHECKED:
        _CHECKED.move_to_end(key)
        return _CHECKED[key]
    problem = _problem(schema)
    _CHECKED[key] = problem
    if len(_CHECKED) > _CHECKED_MAX:
        _CHECKED.popitem(last=False)
    return problem


def _problem(schema: Mapping[str, Any]) -> str | None:
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        return "$schema must be a string (at $.$schema)"
    try:
        error = next(iter(_metaschema(schema).iter_errors(dict(schema))), None)
    except RecursionError:
        return "the schema is nested too deeply"
    if error is not None:
        if error.validator == "format" and isinstance(error.cause, PatternError):
            where = error.json_path
            return f"the pattern {error.instance!r} is not supported: {error.cause} (at {where})"
        return f"{error.message} (at {error.json_path})"
    return _unresolvable_local_ref(schema)


_METASCHEMAS: dict[Any, Validator] = {}


def _metaschema(schema: Mapping[str, Any]) -> Validator:
    """What `check_schema` does, with the RE2 "regex" format: a validator of the dialect."""
    dialect = validator_for(schema, default=Draft202012Validator)
    meta = _METASCHEMAS.get(dialect)
    if meta is None:
        cls = validator_for(dialect.META_SCHEMA, default=dialect)
        meta = _METASCHEMAS[dialect] = cls(dialect.META_SCHEMA, format_checker=_META_FORMATS)
    return meta


def _local_refs(node: Any) -> Iterator[str]:
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                yield ref
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _unresolvable_local_ref(schema: Mapping[str, Any]) -> str | None:
    """A `#...` $ref that points nowhere in the schema (remote refs are never followed)."""
    refs = list(_local_refs(schema))
    if not refs:
        return None
    root = referencing.Resource.from_contents(dict(schema), default_specification=DRAFT202012)
    resolver = referencing.Registry().with_resource(_ROOT_URI, root).resolver(_ROOT_URI)
    for ref in refs:
        try:
            resolver.lookup(ref)
        except referencing.exceptions.Unresolvable:
            return f"$ref {ref!r} points nowhere in the schema"
    return None


def _validator(schema: Mapping[str, Any]) -> Validator:
    key = schema_key(schema)
    validator = _VALIDATORS.get(key)
    if validator is None:
        dialect = validator_for(schema, default=Draft202012Validator)
        cls = _LINEAR.get(dialect, _LINEAR[Draft202012Validator])
        body = {k: v for k, v in schema.items() if k != "$schema"}
        validator = cls(body, registry=_NO_RETRIEVAL)
        _VALIDATORS[key] = validator
        if len(_VALIDATORS) > _CACHE_MAX:
            _VALIDATORS.popitem(last=False)
    else:
        _VALIDATORS.move_to_end(key)
    return validator


def schema_error(schema: Mapping[str, Any], instance: Any) -> str | None:
    """Why `instance` breaks `schema` (None when it does not), within the step budget.

    The schema is a caller's: it is checked first (cached), and a remote
    `$ref` is never retrieved (this core does no I/O).
    """
    problem = schema_problem(schema)
    if problem is not None:
        return f"the schema is not valid: {problem}"
    try:
        with validation_budget():
            error = best_match(_validator(schema).iter_errors(instance))
    except _BudgetExceeded:
        return (
            f"validating the value took more than {MAX_VALIDATION_STEPS} schema checks "
            "(the limit); the value or the schema is too large"
        )
    except referencing.exceptions.Unresolvable as exc:
        return f"the schema has an unresolvable $ref: {exc}"
    except RecursionError:
        return "the value is nested too deeply to validate"
    if error is None:
        return None
    return f"{error.message} (at {error.json_path}, rule {error.validator!r})"
