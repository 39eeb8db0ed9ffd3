"""Callers' JSON Schemas: bounded checks, and validation whose cost is bounded.

This module owns what the edge does with a schema a caller sent (a tool's
`parameters`, a strict `response_format`): its size and depth limits, whether
it is a valid schema, and validating model output against it. It does not
know tools, requests or the stream; it does no I/O ($refs are never fetched).

Why not plain jsonschema: its `pattern`, `patternProperties` and
`additionalProperties` run the caller's regex in Python's backtracking `re`,
where `^(a+)+$` against 30 a's and a "b" takes minutes. Here those keywords run
in RE2 (linear in the text; see `edge.stream.schemare`); the
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
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec
import referencing
import referencing.exceptions
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator
from jsonschema.validators import Draft202012Validator, validator_for
from referencing.jsonschema import DRAFT202012

from edge.stream.bounds import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, MAX_VALIDATION_STEPS
from edge.stream.schemare import (
    LINEAR,
    META_FORMATS,
    BudgetExceeded,
    PatternError,
    validation_budget,
)

__all__ = [
    "schema_error",
    "schema_key",
    "schema_limit_problem",
    "schema_problem",
    "schema_size",
    "validation_budget",
]


# --- limits and validity of a declared schema ----------------------------------------


def schema_key(schema: Mapping[str, Any]) -> str:
    """The canonical JSON of a schema: its cache key, and what its size is measured on."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), default=str)


_NAME_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
_DATA = frozenset({"const", "enum", "default", "examples"})
_NESTED_TOO_DEEPLY = "the schema is nested too deeply"
_TOO_DEEP = f"is nested more than {MAX_SCHEMA_DEPTH} levels deep (limit {MAX_SCHEMA_DEPTH})"


# A path as a linked list, (step, parent): built in O(1) per node and spelled
# out only for the error message (a long key must not be copied per child).
_Trail = tuple[str, "_Trail"] | None


def _spelled(trail: _Trail) -> str:
    steps: list[str] = []
    while trail is not None:
        step, trail = trail
        steps.append(step)
    return "$" + "".join(reversed(steps))


def _structure_problem(schema: Mapping[str, Any]) -> str | None:
    """Depth, a nested `$schema`, or `unevaluatedProperties` with `patternProperties`.

    Iterative, so a deep schema costs no recursion; data keywords (`const`,
    `enum`, ...) are skipped except where they name properties.
    """
    stack: list[tuple[Any, int, _Trail, bool]] = [(schema, 1, None, False)]
    seen: set[str] = set()
    while stack:
        node, depth, trail, name_map = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return _TOO_DEEP
        if isinstance(node, dict):
            if not name_map:
                if isinstance(node.get("$schema"), str) and depth > 1:
                    where = _spelled(trail)
                    return f"has $schema below its root (at {where}); only the root names a dialect"
                seen.update(k for k in ("unevaluatedProperties", "patternProperties") if k in node)
            for key, value in node.items():
                if isinstance(value, dict | list) and (name_map or key not in _DATA):
                    stack.append((value, depth + 1, (f".{key}", trail), key in _NAME_MAPS))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, (f"[{i}]", trail), False) for i, v in enumerate(node))
    if len(seen) == 2:
        return "uses unevaluatedProperties together with patternProperties, which is not supported"
    return None


def schema_size(schema: Mapping[str, Any]) -> int:
    """The size that `MAX_SCHEMA_BYTES` bounds: compact UTF-8 JSON, as msgspec writes
    it (fast, so a body-sized schema is measured before anything walks it).

    Raises:
        RecursionError: the schema is nested past what the encoder goes.
    """
    return len(msgspec.json.encode(schema))


def schema_limit_problem(schema: Mapping[str, Any]) -> str | None:
    """Which limit `schema` breaks, said as "is ... (limit N)"; None when within them."""
    try:
        size = schema_size(schema)
    except RecursionError:
        return _TOO_DEEP
    if size > MAX_SCHEMA_BYTES:
        return f"is {size} bytes as JSON; the limit is {MAX_SCHEMA_BYTES} bytes"
    return _structure_problem(schema)


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
        key = schema_key(schema)
    except RecursionError:
        return _NESTED_TOO_DEEPLY
    return _checked_problem(schema, key)


def _checked_problem(schema: Mapping[str, Any], key: str) -> str | None:
    """`schema_problem` for a schema whose `schema_key` is `key`."""
    digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
    if digest in _CHECKED:
        _CHECKED.move_to_end(digest)
        return _CHECKED[digest]
    problem = _problem(schema)
    _CHECKED[digest] = problem
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
        return _NESTED_TOO_DEEPLY
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
        meta = _METASCHEMAS[dialect] = cls(dialect.META_SCHEMA, format_checker=META_FORMATS)
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


def _validator(schema: Mapping[str, Any], key: str) -> Validator:
    validator = _VALIDATORS.get(key)
    if validator is None:
        dialect = validator_for(schema, default=Draft202012Validator)
        cls = LINEAR.get(dialect, LINEAR[Draft202012Validator])
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
    try:
        key = schema_key(schema)
    except RecursionError:
        return f"the schema is not valid: {_NESTED_TOO_DEEPLY}"
    problem = _checked_problem(schema, key)
    if problem is not None:
        return f"the schema is not valid: {problem}"
    try:
        with validation_budget():
            error = best_match(_validator(schema, key).iter_errors(instance))
    except BudgetExceeded:
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
