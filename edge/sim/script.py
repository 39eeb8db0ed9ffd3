"""sim-script documents: where a script sits in a conversation, and which turn plays.

A script is a JSON object, either single-turn, `{"events": [...]}`, or
multi-turn, `{"turns": [{"events": [...]}, ...]}`. This module finds it in
a RunRequest's messages and returns the items of the turn to play; playing
them is the server's (`edge.sim.server`). Pure: no asyncio, no gRPC stream.

Lookup, the first text that is a script winning (a text is a message's
string content, its text parts joined, or any one text part; it "is a
script" when it is a JSON object with an `events` or `turns` key):

1. the last user message (the old rule: a new script there always wins);
2. system and developer messages, first to last (frameworks that append
   their own instructions to the last user message leave these alone);
3. user messages, first to last (the first user message of an agent loop,
   whose later user messages are the framework's retry prompts).

The turn played is the number of assistant messages after the message that
holds the script (so, for a script in the system or first user message, the
number of assistant messages in the conversation): each answer of the
model, a tool call included, moves it on. A single-turn script plays its
events whatever the turn. Asking past the last turn is a ScriptError (the
node answers with an error event that says so), never a silent replay.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from edge.node._proto.iop.node import v1 as pb

Items = list[dict[str, Any]]


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
    """The JSON object `text` holds when it is a script (has events or turns), else None."""
    if "{" not in text:
        return None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(doc, dict) and ("events" in doc or "turns" in doc):
        return doc
    return None


def _events(doc: Any, where: str) -> Items:
    if not isinstance(doc, dict) or not isinstance(doc.get("events"), list):
        raise ScriptError(f'sim-script: {where} is not {{"events": [...]}}')
    items: Items = doc["events"]
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ScriptError(f"sim-script: {where}.events[{i}] is not an object")
    return items


def parse_turns(doc: dict[str, Any]) -> list[Items]:
    """The turns of a script document (one turn for a single-turn script)."""
    if "turns" not in doc:
        return [_events(doc, "the script")]
    turns = doc["turns"]
    if not isinstance(turns, list) or not turns:
        raise ScriptError('sim-script: "turns" is not a non-empty list')
    return [_events(turn, f"turns[{i}]") for i, turn in enumerate(turns)]


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
    users = [m for m in messages if m.role == "user"]
    if not users:
        return 'sim-script: no message holds a script ({"events": [...]} or {"turns": [...]})'
    try:
        json.loads(message_text(users[-1]))
    except json.JSONDecodeError as exc:
        return f"sim-script: the last user message is not JSON ({exc}); no message holds a script"
    return 'sim-script: expected {"events": [...]} or {"turns": [...]}; no message holds one'


def script_items(request: pb.RunRequest) -> Items:
    """The items to play for this request: its script's turn, chosen as the module says."""
    doc, index = find_script(request.messages)
    turns = parse_turns(doc)
    if "turns" not in doc:
        return turns[0]
    turn = sum(1 for m in request.messages[index + 1 :] if m.role == "assistant")
    if turn >= len(turns):
        raise ScriptError(
            f"sim-script: this is turn {turn} (assistant messages after the script), "
            f"but the script has {len(turns)} turn(s)"
        )
    return turns[turn]
