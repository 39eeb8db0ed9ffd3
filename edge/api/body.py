"""A request body's way in: bytes to JSON values within the body's bounds.

This module owns the first step of every API's parser: the body must be JSON,
an object, and within MAX_JSON_DEPTH levels and MAX_JSON_VALUES values
(`edge.stream.bounds`) before any field is read; a body nested past what the
decoder itself can recurse into is the same 400 (`deep_is_refused`). The
words for JSON types in error messages are here too.

It must not know any API's fields, nor nodes, HTTP or streams: bytes in,
values out (or a `RequestError`). No trio, quart, grpclib or asyncio.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

import msgspec

from edge.errors import RequestError
from edge.stream import bounds

__all__ = [
    "TOO_DEEP",
    "TOO_MANY_VALUES",
    "TYPE_WORDS",
    "check_json_bounds",
    "decode_object",
    "deep_is_refused",
]

_MALFORMED: Final = (
    "We could not parse the JSON body of your request. The API expects a JSON object "
    "(Content-Type: application/json), but what was sent was not valid JSON."
)
TOO_DEEP: Final = (
    "The JSON body of your request is nested too deeply: objects and arrays may be nested "
    f"at most {bounds.MAX_JSON_DEPTH} levels deep."
)
TOO_MANY_VALUES: Final = (
    "The JSON body of your request holds too many values: the limit is "
    f"{bounds.MAX_JSON_VALUES} array elements and object members in all, at any depth."
)
# A JSON type (as msgspec names it) in an error message's words.
TYPE_WORDS: Final = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "object": "an object",
    "array": "an array",
    "null": "null",
}
_Parsed = TypeVar("_Parsed")
_Args = ParamSpec("_Args")


def deep_is_refused(
    parse: Callable[Concatenate[bytes, _Args], _Parsed],
) -> Callable[Concatenate[bytes, _Args], _Parsed]:
    """A body parser whose too deeply nested input is a 400 naming the limit, never a
    500: past Python's recursion limit the decoder itself stops (the body never gets
    to `check_json_bounds`, which bounds every shallower one to MAX_JSON_DEPTH)."""

    @functools.wraps(parse)
    def guarded(body: bytes, /, *args: _Args.args, **kwargs: _Args.kwargs) -> _Parsed:
        try:
            return parse(body, *args, **kwargs)
        except RecursionError:
            raise RequestError(TOO_DEEP) from None

    return guarded


def decode_object(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object within the body's bounds: where the body of
    every API enters (the first step of each parser, all `deep_is_refused`).

    Raises:
        RequestError: the body is not JSON, not an object, or past MAX_JSON_DEPTH or
            MAX_JSON_VALUES.
    """
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise RequestError(_MALFORMED) from None
    if not isinstance(value, dict):
        got = TYPE_WORDS.get(json_type(value), "a value")
        raise RequestError(f"The request body must be a JSON object, but got {got}.")
    check_json_bounds(value)
    return value


def check_json_bounds(value: object) -> None:
    """Decoded JSON `value` within MAX_JSON_DEPTH levels and MAX_JSON_VALUES values.

    One level at a time, without recursion: a level's values are counted (its
    containers' lengths, at C speed) before any of them is looked at, so the work
    is linear and stops at the first bound passed.

    Raises:
        RequestError: TOO_DEEP or TOO_MANY_VALUES.
    """
    level: list[Any] = [value] if type(value) is dict or type(value) is list else []
    depth = values = 0
    while level:
        depth += 1
        if depth > bounds.MAX_JSON_DEPTH:
            raise RequestError(TOO_DEEP)
        values += sum(map(len, level))
        if values > bounds.MAX_JSON_VALUES:
            raise RequestError(TOO_MANY_VALUES)
        level = [
            child
            for container in level
            for child in (container.values() if type(container) is dict else container)
            if type(child) is dict or type(child) is list
        ]


def json_type(value: object) -> str:
    """A decoded JSON value's type, as msgspec names it (a key of TYPE_WORDS)."""
    for kind, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"),
                       (list, "array"), (type(None), "null")):  # fmt: skip
        if isinstance(value, kind):
            return name
    return "object"
