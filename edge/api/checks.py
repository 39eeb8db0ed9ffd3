"""The rules of a request's fields that msgspec cannot express, and their 400s.

This module owns the checks every API's request validation shares (a length,
a count, a range, a choice among names) and the two shapes of the message a
broken rule earns, OpenAI's: "Invalid value for 'param': why." and "Missing
required parameter: 'param' (why).", each with `param` set.

It must not know which fields a request has, nor nodes, HTTP or streams.
"""

from __future__ import annotations

from collections.abc import Sized

from edge.errors import RequestError

__all__ = [
    "check_chars",
    "check_choice",
    "check_count",
    "check_range",
    "invalid",
    "missing",
]


def check_count(items: Sized, param: str, limit: int, what: str) -> None:
    """A list or map longer than its limit is a 400 naming the limit."""
    if len(items) > limit:
        raise invalid(param, f"{len(items)} {what}; the limit is {limit} {what}")


def check_chars(text: str, param: str, limit: int, what: str = "the value") -> None:
    """A string longer than its limit is a 400 naming the limit."""
    if len(text) > limit:
        raise invalid(
            param, f"{what} is {len(text)} characters long; the limit is {limit} characters"
        )


def check_range(
    value: float | None, param: str, low: float, high: float, *, low_open: bool = False
) -> None:
    if value is None or ((value > low if low_open else value >= low) and value <= high):
        return
    bound = f"greater than {low}" if low_open else f"at least {low}"
    raise invalid(param, f"{value}; must be {bound} and at most {high}")


def check_choice(
    value: object, param: str, allowed: frozenset[str], *, optional: bool = True
) -> None:
    if not ((value is None and optional) or (isinstance(value, str) and value in allowed)):
        expected = ", ".join(repr(v) for v in sorted(allowed))
        raise invalid(param, f"{value!r}; expected one of {expected}")


def invalid(param: str, why: str) -> RequestError:
    return RequestError(f"Invalid value for '{param}': {why}.", param=param)


def missing(param: str, why: str) -> RequestError:
    return RequestError(f"Missing required parameter: '{param}' ({why}).", param=param)
