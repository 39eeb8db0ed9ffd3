"""sim-script lookup and turn selection (`edge.sim.script`), on RunRequests built here.

Each test states one rule of the module's docstring: where a script may sit,
which one wins, which turn plays, and what happens past the last turn.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from edge.node._proto.iop.node import v1 as pb
from edge.sim.script import ScriptError, find_script, script_items

ONE = {"events": [{"type": "delta", "delta": "one"}, {"type": "complete"}]}
TWO = {"events": [{"type": "delta", "delta": "two"}, {"type": "complete"}]}
TURNS = {
    "turns": [
        {"events": [{"type": "complete", "tool_calls": [{"id": "c1", "name": "f"}]}]},
        {"events": [{"type": "delta", "delta": "done"}, {"type": "complete"}]},
    ]
}


def msg(role: str, content: Any = None, parts: list[str] | None = None) -> pb.Message:
    if parts is not None:
        return pb.Message(role=role, parts=[pb.ContentPart(type="text", text=t) for t in parts])
    text = content if isinstance(content, str) else json.dumps(content)
    return pb.Message(role=role, content=text)


def request(*messages: pb.Message) -> pb.RunRequest:
    return pb.RunRequest(model="sim-script", messages=list(messages))


def deltas(items: list[dict[str, Any]]) -> list[str]:
    return [i.get("delta", "") for i in items if i.get("type") == "delta"]


def test_single_turn_script_in_last_user_message_plays_as_before() -> None:
    """The old rule: the last user message's {"events": [...]} plays, whatever the turn."""
    req = request(msg("user", ONE), msg("assistant", "x"), msg("user", TWO))
    assert deltas(script_items(req)) == ["two"]
    req = request(msg("user", ONE), msg("assistant", "x"), msg("assistant", "y"))
    assert deltas(script_items(req)) == ["one"]


def test_turn_is_the_number_of_assistant_messages_after_the_script() -> None:
    """A tool call and its result move a multi-turn script on by one turn."""
    first = request(msg("user", TURNS))
    assert script_items(first)[0]["tool_calls"][0]["name"] == "f"
    second = request(
        msg("user", TURNS),
        pb.Message(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="f")]),
        pb.Message(role="tool", tool_call_id="c1", content="sunny"),
    )
    assert deltas(script_items(second)) == ["done"]


def test_past_the_last_turn_is_a_clear_error() -> None:
    """A turn the script does not have is a ScriptError naming the turn and the count."""
    req = request(msg("user", TURNS), msg("assistant", "a"), msg("assistant", "b"))
    with pytest.raises(ScriptError, match=r"turn 2 .* 2 turn\(s\)"):
        script_items(req)


def test_script_in_system_message_survives_appended_instructions() -> None:
    """A system message's script plays when the last user message is a framework's text."""
    req = request(msg("system", TURNS), msg("user", "What is the weather? Answer in JSON."))
    assert script_items(req)[0]["type"] == "complete"
    req = request(msg("developer", ONE), msg("user", "plain words"))
    assert deltas(script_items(req)) == ["one"]


def test_script_in_first_user_message_when_later_ones_are_retry_prompts() -> None:
    """With a retry prompt as the last user message, the first user message's script plays."""
    req = request(
        msg("user", TURNS),
        msg("assistant", "not a call"),
        msg("user", "Validation failed: fix the errors and try again."),
    )
    assert deltas(script_items(req)) == ["done"]


def test_lookup_order_last_user_then_system_then_first_user() -> None:
    """The last user message wins over a system script, which wins over earlier user messages."""
    assert find_script([msg("system", ONE), msg("user", TWO)])[1] == 1
    messages = [msg("user", TWO), msg("system", ONE), msg("assistant", "x"), msg("user", "hi")]
    assert find_script(messages) == (ONE, 1)


def test_script_in_one_text_part_among_others() -> None:
    """A script in one text part of a message is found (agents prepend reminder parts)."""
    req = request(msg("user", parts=["<reminder>be brief</reminder>", json.dumps(ONE)]))
    assert deltas(script_items(req)) == ["one"]
    # Parts that only together make a script: still found, as before.
    text = json.dumps(TWO)
    req = request(msg("user", parts=[text[:10], text[10:]]))
    assert deltas(script_items(req)) == ["two"]


def test_no_script_anywhere_is_an_error_naming_the_last_user_message() -> None:
    """Without a script the error says the last user message is not JSON, or not a script."""
    with pytest.raises(ScriptError, match="last user message is not JSON"):
        script_items(request(msg("user", "hello")))
    with pytest.raises(ScriptError, match=r"expected \{\"events\""):
        script_items(request(msg("user", {"evnts": []})))


def test_a_script_that_is_found_but_broken_is_reported_not_skipped() -> None:
    """The first script found is the one played: its mistakes are errors, not a fallback."""
    broken = {"turns": [{"events": [1]}]}
    with pytest.raises(ScriptError, match=r"turns\[0\]\.events\[0\] is not an object"):
        script_items(request(msg("system", ONE), msg("user", broken)))
    with pytest.raises(ScriptError, match="non-empty list"):
        script_items(request(msg("user", {"turns": []})))
    with pytest.raises(ScriptError, match=r"turns\[1\] is not"):
        script_items(request(msg("user", {"turns": [{"events": []}, []]})))
