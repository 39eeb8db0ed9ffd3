"""sim-script documents: where a script sits in a conversation, and which turn plays.

A script is a JSON object, either single-turn, `{"events": [...]}`, or
multi-turn, `{"turns": [{"events": [...]}, ...]}`. This module finds it in
a RunRequest's messages and returns the items of the turn to play; playing
them is the server's (`edge.nodes.sim.server`). Pure: no asyncio, no gRPC stream.

Lookup, the first text that holds a script winning (a text is a message's
string content, its text parts joined, or any one text part; it "holds a
script" when one of its JSON objects has an `events` or `turns` key, the
object all of the text or inside words around it; `edge.nodes.sim.jsonscan`
says which objects a text holds, and the first script among them is the
text's):

1. the last user message (a new script there always wins);
2. system and developer messages, first to last (frameworks that append
   their own instructions to the last user message leave these alone);
3. user messages, first to last (the first user message of an agent loop,
   whose later user messages are the framework's retry prompts).

The turn played is the number of assistant messages after the message that
holds the script (so, for a script in the system or first user message, the
number of assistant messages in the conversation): each answer of the
model, a tool call included, moves it on. A single-turn script plays its
events whatever the turn. Asking past the last turn is a ScriptError (the
node refuses the run with an error event that says so), never a silent replay.

Every number a script holds is checked here, before anything plays (`check_item`):
a JSON number (a bool is not one), finite, within its bound. `sleep_ms` and
`accept_after_ms` are 0 to MAX_SLEEP_MS; `repeat` an integer from 1 to
MAX_REPEAT; `delta_times` an integer from 0 whose delta is at most
MAX_DELTA_CHARS; `usage` counts integers that fit their uint32; a logprob a
finite number; `http_status`, on an error only, 0 or 400 to 599. The turn
played sends at most MAX_SCRIPT_EVENTS events and MAX_SCRIPT_CHARS characters
of delta text, repeats counted. A script past any of these is a ScriptError
naming the item and the bound: the node refuses the run (an error event with
`http_status` 400: the request's fault), its timers and the runs beside it
untouched.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.sim.jsonscan import json_objects

Items = list[dict[str, Any]]

# The longest pause a `sleep_ms` or `accept_after_ms` asks for (ten minutes; a run
# that should wait longer is a `hang`).
MAX_SLEEP_MS = 600_000
# The most times `repeat` sends one event.
MAX_REPEAT = 1_000_000
# The longest delta `delta_times` builds, in characters: past the gRPC message
# limit (an oversized message is something a script may ask for), far from a
# node's memory.
MAX_DELTA_CHARS = 16 * 1024 * 1024
# What the turn played sends at most, repeats counted: events, and characters of
# delta text.
MAX_SCRIPT_EVENTS = 1_000_000
MAX_SCRIPT_CHARS = 1024 * 1024 * 1024
_USAGE_FIELDS = frozenset(
    {"input_tokens", "output_tokens", "reasoning_tokens", "cached_input_tokens"}
)
_UINT32 = 2**32 - 1


# The keys that make a JSON object a script.
SCRIPT_KEYS = ("events", "turns")


class ScriptError(ValueError):
    """The sim-script conversation holds no valid script, or not for this turn."""


def message_text(message: pb.Message) -> str:
    """A message's text: its string content, or its text parts joined."""
    if message.content is not None:
        return str(message.content)
    return "".join(p.text for p in message.parts if p.type == "text")


def _texts(message: pb.Message) -> Iterator[str]:
    yield message_text(message)
    texts = [p.text for p in message.parts if p.type == "text"]
    if len(texts) > 1:
        yield from texts


def _as_script(text: str) -> dict[str, Any] | None:
    """The first JSON object `text` holds that is a script (has events or turns), else None."""
    for found in json_objects(text, SCRIPT_KEYS):
        doc = found.value
        if isinstance(doc, dict) and ("events" in doc or "turns" in doc):
            return doc
    return None


def _events(doc: Any, where: str, path: str) -> Items:
    """The items of `doc` (`where` names it in errors; `path` is the JSON path of its events)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("events"), list):
        raise ScriptError(f'sim-script: {where} is not {{"events": [...]}}')
    items: Items = doc["events"]
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ScriptError(f"sim-script: {path}[{i}] is not an object")
        check_item(item, f"{path}[{i}]")
    return items


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(item: dict[str, Any], key: str, where: str, high: float) -> None:
    value = item[key]
    if not _is_number(value) or not math.isfinite(value) or not 0 <= value <= high:
        raise ScriptError(
            f"sim-script: {where}.{key} must be a number from 0 to {high} (got {_shown(value)})"
        )


def _integer(item: dict[str, Any], key: str, where: str, low: int, high: int) -> int:
    value = item[key]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ScriptError(
            f"sim-script: {where}.{key} must be an integer from {low} to {high}"
            f" (got {_shown(value)})"
        )
    return value


def _shown(value: Any) -> str:
    """A value as an error message quotes it: short, whatever its size."""
    text = (
        json.dumps(value) if _is_number(value) or isinstance(value, str) else type(value).__name__
    )
    return text if len(text) <= 40 else text[:37] + "..."


def _list(item: dict[str, Any], key: str, where: str) -> None:
    if item.get(key) is not None and not isinstance(item[key], list):
        raise ScriptError(f"sim-script: {where}.{key} must be a list")


def check_item(item: dict[str, Any], where: str) -> None:
    """Raise ScriptError unless every number and shape `item` holds is one the node plays."""
    for key in ("sleep_ms", "accept_after_ms"):
        if key in item:
            _number(item, key, where, MAX_SLEEP_MS)
    if "repeat" in item:
        _integer(item, "repeat", where, 1, MAX_REPEAT)
    if "http_status" in item:
        if item.get("type") != "error":
            raise ScriptError(f"sim-script: {where}.http_status belongs on an error event")
        status = _integer(item, "http_status", where, 0, 599)
        if 0 < status < 400:
            raise ScriptError(
                f"sim-script: {where}.http_status must be 0 or an HTTP error status, 400 to 599"
                f" (got {status})"
            )
    if "delta_times" in item:
        times = _integer(item, "delta_times", where, 0, MAX_DELTA_CHARS)
        if len(_delta(item)) * times > MAX_DELTA_CHARS:
            raise ScriptError(
                f"sim-script: {where}: delta x delta_times is over {MAX_DELTA_CHARS} characters"
            )
    usage = item.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            raise ScriptError(f"sim-script: {where}.usage must be an object")
        for key in usage:
            if key not in _USAGE_FIELDS:
                raise ScriptError(f"sim-script: {where}.usage.{key} is not a usage field")
            _integer(usage, key, f"{where}.usage", 0, _UINT32)
    if item.get("metadata") is not None and not isinstance(item["metadata"], dict):
        raise ScriptError(f"sim-script: {where}.metadata must be an object")
    _list(item, "tool_calls", where)
    _list(item, "logprobs", where)
    for k, token in enumerate(item.get("logprobs") or ()):
        if not isinstance(token, dict):
            raise ScriptError(f"sim-script: {where}.logprobs[{k}] is not an object")
        tops = token.get("top_logprobs")
        if tops is not None and not isinstance(tops, list):
            raise ScriptError(f"sim-script: {where}.logprobs[{k}].top_logprobs must be a list")
        for entry, at in [(token, f"logprobs[{k}]")] + [
            (top, f"logprobs[{k}].top_logprobs[{j}]") for j, top in enumerate(tops or ())
        ]:
            if not isinstance(entry, dict):
                raise ScriptError(f"sim-script: {where}.{at} is not an object")
            value = entry.get("logprob", 0.0)
            if not _is_number(value) or not math.isfinite(value):
                raise ScriptError(
                    f"sim-script: {where}.{at}.logprob must be a finite number"
                    f" (got {_shown(value)})"
                )


def _delta(item: dict[str, Any]) -> str:
    """The text of a delta item (one copy: before `delta_times`)."""
    return str(item.get("delta", ""))


def check_budget(items: Items) -> None:
    """Raise ScriptError when `items`, repeats counted, send more than MAX_SCRIPT_EVENTS
    events or MAX_SCRIPT_CHARS characters of delta text."""
    events = chars = 0
    for item in items:
        if "sleep_ms" in item or "accept_after_ms" in item:
            continue
        repeat = item.get("repeat", 1)
        events += repeat
        chars += repeat * len(_delta(item)) * item.get("delta_times", 1)
    if events > MAX_SCRIPT_EVENTS:
        raise ScriptError(
            f"sim-script: the turn sends {events} events, over the limit of {MAX_SCRIPT_EVENTS}"
        )
    if chars > MAX_SCRIPT_CHARS:
        raise ScriptError(
            f"sim-script: the turn sends {chars} characters of delta text,"
            f" over the limit of {MAX_SCRIPT_CHARS}"
        )


def parse_turns(doc: dict[str, Any]) -> list[Items]:
    """The turns of a script document (one turn for a single-turn script)."""
    if "turns" not in doc:
        return [_events(doc, "the script", "events")]
    turns = doc["turns"]
    if not isinstance(turns, list) or not turns:
        raise ScriptError('sim-script: "turns" is not a non-empty list')
    return [_events(turn, f"turns[{i}]", f"turns[{i}].events") for i, turn in enumerate(turns)]


def _lookup_order(messages: Sequence[pb.Message]) -> Iterator[int]:
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if users:
        yield users[-1]
    yield from (i for i, m in enumerate(messages) if m.role in ("system", "developer"))
    yield from users[:-1]


def find_script(messages: Sequence[pb.Message]) -> tuple[dict[str, Any], int]:
    """The first script in lookup order, and the index of the message that holds it."""
    for index in _lookup_order(messages):
        for text in _texts(messages[index]):
            doc = _as_script(text)
            if doc is not None:
                return doc, index
    raise ScriptError(_no_script(messages))


def _no_script(messages: Sequence[pb.Message]) -> str:
    """Why no script was found, as the refusal says it: of the last user message, the
    first object that names events or turns but is not JSON, else whether it is JSON."""
    users = [m for m in messages if m.role == "user"]
    none = 'no message holds a script ({"events": [...]} or {"turns": [...]}, alone or in text)'
    if not users:
        return f"sim-script: {none}"
    text = message_text(users[-1])
    for found in json_objects(text, SCRIPT_KEYS):
        if found.error is not None:
            return (
                f"sim-script: the last user message holds a script that is not JSON ({found.error})"
            )
    try:
        json.loads(text)
    except (ValueError, RecursionError) as exc:
        return f"sim-script: the last user message is not JSON ({exc}); {none}"
    return 'sim-script: expected {"events": [...]} or {"turns": [...]}; no message holds one'


def script_items(request: pb.RunRequest) -> Items:
    """The items to play for this request: its script's turn, chosen as the module says."""
    doc, index = find_script(request.messages)
    turns = parse_turns(doc)
    if "turns" not in doc:
        check_budget(turns[0])
        return turns[0]
    turn = sum(1 for m in request.messages[index + 1 :] if m.role == "assistant")
    if turn >= len(turns):
        raise ScriptError(
            f"sim-script: this is turn {turn} (assistant messages after the script), "
            f"but the script has {len(turns)} turn(s)"
        )
    check_budget(turns[turn])
    return turns[turn]
