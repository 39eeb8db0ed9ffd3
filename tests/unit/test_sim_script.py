"""sim-script lookup, turn selection and checks (`edge.nodes.sim.script`), on RunRequests
built here.

Each test states one rule of the module's docstring: where a script may sit,
which one wins, which turn plays, what happens past the last turn, and which
numbers and shapes a script may hold (anything else is a ScriptError).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.sim import jsonscan
from edge.nodes.sim.play import event_from_item
from edge.nodes.sim.script import (
    MAX_DELTA_CHARS,
    MAX_REPEAT,
    MAX_SCRIPT_CHARS,
    MAX_SCRIPT_EVENTS,
    MAX_SLEEP_MS,
    SCRIPT_KEYS,
    ScriptError,
    find_script,
    script_items,
)

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


# How frameworks wrap the user's text: CrewAI's task, DSPy's fields, an agent's reminder.
WRAPPERS = (
    "Current Task: {}\n\nThis is the expected criteria for your final answer: the answer."
    "\nyou MUST return the actual complete content as the final answer, not a summary.",
    "[[ ## question ## ]]\n{}\n\nRespond with the corresponding output fields, starting with"
    " the field `[[ ## answer ## ]]`, and then ending with the marker `[[ ## completed ## ]]`.",
    "<reminder>Answer in {{format}}; use {{tools}} if needed.</reminder>\n{}\nThanks!",
)


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=["crewai", "dspy", "reminder"])
def test_a_script_inside_a_frameworks_text_is_found(wrapper: str) -> None:
    """The first JSON object of a text that has `events` or `turns` is its script, whatever
    words (and prose braces) stand around it; a multi-turn one counts its turns as ever."""
    assert deltas(script_items(request(msg("user", wrapper.format(json.dumps(ONE)))))) == ["one"]
    wrapped = wrapper.format(json.dumps(TURNS))
    second = request(msg("user", wrapped), msg("assistant", "called"), msg("tool", "sunny"))
    assert deltas(script_items(second)) == ["done"]


def test_which_object_of_a_text_is_the_script() -> None:
    """Objects that are not scripts, and objects that do not parse, are passed over whole:
    the first script after them wins; one inside another object is not a script of its
    own; an object that never closes ends the reading."""
    example = 'Answer as {"answer": "...", "note": "not events"}. '
    text = example + 'Broken: {"events": [1,,]}. Script: ' + json.dumps(ONE) + " " + json.dumps(TWO)
    assert deltas(script_items(request(msg("user", text)))) == ["one"]
    nested = "Input: " + json.dumps({"input": ONE})
    with pytest.raises(ScriptError, match="no message holds a script"):
        script_items(request(msg("user", nested)))
    unclosed = 'Note {"a": "x" and then ' + json.dumps(ONE)
    with pytest.raises(ScriptError, match="no message holds a script"):
        script_items(request(msg("user", unclosed)))
    braces_in_strings = json.dumps(
        {"events": [{"type": "delta", "delta": '}{ " }'}, {"type": "complete"}]}
    )
    assert deltas(script_items(request(msg("user", f"Go: {braces_in_strings} now")))) == ['}{ " }']


def test_which_message_wins_with_wrapped_scripts() -> None:
    """The lookup order holds for scripts inside text: the last user message's wins over a
    system message's, which wins over an earlier user message's."""
    system = msg("system", "You are a bot. " + json.dumps(ONE))
    last = msg("user", WRAPPERS[0].format(json.dumps(TWO)))
    assert find_script([system, last]) == (TWO, 1)
    retry = msg("user", "Fix the errors {and} try again.")
    assert find_script([msg("user", "Task: " + json.dumps(TWO)), system, retry]) == (ONE, 1)


def test_a_wrapped_script_that_does_not_parse_is_named() -> None:
    """A last user message whose object names events but is not JSON says so (the parser's
    words), rather than that the message is not JSON."""
    with pytest.raises(ScriptError, match=r"holds a script that is not JSON \(Expecting value"):
        script_items(request(msg("user", 'Run {"events": [{"type": "complete"},,]} now')))


@pytest.mark.parametrize(
    "text",
    [
        '{"a":' * 5000 + "x" + "}" * 5000,  # nested past the parser, broken at the bottom
        '{"events":' * 3000 + "1" + "}" * 3000,  # nested past the parser, naming events
        '{"events": x} ' * 2000,  # many broken objects, each naming events
        '{"' * 10000,  # objects that open and never close
        '{"a": "' + '{\\"' * 5000,  # a string that never closes, full of escaped quotes
    ],
    ids=["deep-broken", "deep-events", "many-broken", "never-closed", "open-string"],
)
def test_the_scan_parses_each_character_at_most_once(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hostile text is read in one pass: the objects handed to the JSON parser never
    overlap, so it parses at most as many characters as the text has, and the lookup
    ends in a ScriptError (never another exception)."""
    parsed: list[int] = []
    loads = jsonscan.json.loads

    def counting(doc: str) -> Any:
        parsed.append(len(doc))
        return loads(doc)

    monkeypatch.setattr(jsonscan.json, "loads", counting)
    found = list(jsonscan.json_objects(text, SCRIPT_KEYS))
    assert sum(parsed) <= len(text)
    assert all(f.end <= g.start for f, g in itertools.pairwise(found))
    monkeypatch.undo()
    with pytest.raises(ScriptError):
        script_items(request(msg("user", text)))


def test_a_script_that_is_found_but_broken_is_reported_not_skipped() -> None:
    """The first script found is the one played: its mistakes are errors, not a fallback."""
    broken = {"turns": [{"events": [1]}]}
    with pytest.raises(ScriptError, match=r"turns\[0\]\.events\[0\] is not an object"):
        script_items(request(msg("system", ONE), msg("user", broken)))
    with pytest.raises(ScriptError, match="non-empty list"):
        script_items(request(msg("user", {"turns": []})))
    with pytest.raises(ScriptError, match=r"turns\[1\] is not"):
        script_items(request(msg("user", {"turns": [{"events": []}, []]})))


# --- the numbers and shapes of a script ---------------------------------------------

NOT_A_SLEEP = [
    "nan",
    float("nan"),
    float("inf"),
    float("-inf"),
    1e308,
    -1,
    -0.5,
    True,
    "200",
    None,
    [],
    {},
    MAX_SLEEP_MS + 1,
]


@pytest.mark.parametrize("key", ["sleep_ms", "accept_after_ms"])
@pytest.mark.parametrize("value", NOT_A_SLEEP, ids=repr)
def test_a_pause_that_is_not_a_finite_bounded_number_is_a_script_error(
    key: str, value: Any
) -> None:
    """sleep_ms / accept_after_ms: a JSON number (not a bool, not a string), finite, from
    0 to MAX_SLEEP_MS; anything else is a ScriptError naming the item and the bound."""
    text = json.dumps({"events": [{key: value}, {"type": "complete"}]})  # NaN, Infinity: as JSON
    with pytest.raises(ScriptError, match=rf"events\[0\]\.{key} must be a number from 0 to"):
        script_items(request(msg("user", text)))


@pytest.mark.parametrize("value", [0, 0.25, 200, MAX_SLEEP_MS])
def test_pauses_within_the_bound_play(value: float) -> None:
    """Fractional and boundary pauses are valid (the paced benchmark sleeps 0.5 ms)."""
    items = script_items(request(msg("user", {"events": [{"sleep_ms": value}]})))
    assert items == [{"sleep_ms": value}]


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"type": "delta", "repeat": 0}, r"repeat must be an integer from 1 to"),
        ({"type": "delta", "repeat": 2.0}, r"repeat must be an integer"),
        ({"type": "delta", "repeat": True}, r"repeat must be an integer"),
        ({"type": "delta", "repeat": "3"}, r"repeat must be an integer"),
        ({"type": "delta", "repeat": MAX_REPEAT + 1}, r"repeat must be an integer"),
        ({"type": "delta", "repeat": 10**30}, r"repeat must be an integer"),
        ({"type": "delta", "delta_times": -1}, r"delta_times must be an integer from 0"),
        ({"type": "delta", "delta": "ab", "delta_times": MAX_DELTA_CHARS}, "characters"),
        ({"type": "complete", "usage": {"input_tokens": -1}}, r"usage\.input_tokens must be"),
        ({"type": "complete", "usage": {"input_tokens": 2**32}}, r"usage\.input_tokens must"),
        ({"type": "complete", "usage": {"input_tokens": 1.5}}, r"usage\.input_tokens must"),
        ({"type": "complete", "usage": {"tokens": 1}}, r"usage\.tokens is not a usage field"),
        ({"type": "complete", "usage": [1]}, r"usage must be an object"),
        ({"type": "complete", "metadata": "x"}, r"metadata must be an object"),
        ({"type": "complete", "tool_calls": 5}, r"tool_calls must be a list"),
        ({"type": "delta", "logprobs": {"token": "a"}}, r"logprobs must be a list"),
        ({"type": "delta", "logprobs": [{"logprob": "x"}]}, r"logprob must be a finite number"),
        (
            {"type": "delta", "logprobs": [{"top_logprobs": [{"logprob": float("nan")}]}]},
            r"top_logprobs\[0\]\.logprob must be a finite",
        ),
        ({"type": "error", "http_status": 200}, r"http_status must be 0 or an HTTP error"),
        ({"type": "error", "http_status": 600}, r"http_status must be an integer from 0 to 599"),
        ({"type": "error", "http_status": "400"}, r"http_status must be an integer"),
        ({"type": "error", "http_status": 400.0}, r"http_status must be an integer"),
        ({"type": "delta", "http_status": 400}, r"http_status belongs on an error event"),
    ],
)
def test_bad_numbers_and_shapes_are_script_errors(item: dict[str, Any], message: str) -> None:
    """repeat, delta_times, usage, metadata, tool_calls and logprobs are checked before
    anything plays: a bad one is a ScriptError that says what is wrong."""
    text = json.dumps({"events": [{"type": "delta", "delta": "ok"}, item]})
    with pytest.raises(ScriptError, match=message):
        script_items(request(msg("user", text)))


@pytest.mark.parametrize("status", [0, 400, 404, 413, 422, 429, 408, 500, 503, 599])
def test_an_error_plays_the_model_servers_status(status: int) -> None:
    """An error step's http_status (0, or an HTTP error status) reaches the RunEvent as
    written, with its error and message; an error step without one plays 0 (as before)."""
    item = {"type": "error", "error": "context_length_exceeded", "message": "too long",
            "http_status": status}  # fmt: skip
    (played,) = script_items(request(msg("user", {"events": [item]})))
    assert event_from_item(played) == pb.RunEvent(
        type="error", error="context_length_exceeded", message="too long", http_status=status
    )
    (plain,) = script_items(request(msg("user", {"events": [{"type": "error", "error": "x"}]})))
    assert event_from_item(plain) == pb.RunEvent(type="error", error="x")


def test_what_a_turn_sends_is_bounded_repeats_counted() -> None:
    """A turn whose items send more than MAX_SCRIPT_EVENTS events or MAX_SCRIPT_CHARS
    characters of delta text, repeats counted, is refused before it plays; a bad later
    turn is refused on the first turn too (the whole script is checked)."""
    many = {"type": "delta", "delta": "x", "repeat": MAX_REPEAT}
    with pytest.raises(ScriptError, match=f"over the limit of {MAX_SCRIPT_EVENTS}"):
        script_items(request(msg("user", {"events": [many, many]})))
    big = {"type": "delta", "delta": "x", "delta_times": MAX_DELTA_CHARS, "repeat": 65}
    with pytest.raises(
        ScriptError, match=f"characters of delta text, over the limit of {MAX_SCRIPT_CHARS}"
    ):
        script_items(request(msg("user", {"events": [big]})))
    fine = {"type": "delta", "delta": "x", "delta_times": 65536, "repeat": 4096}
    assert script_items(request(msg("user", {"events": [fine]}))) == [fine]
    bad_later = {"turns": [{"events": [fine]}, {"events": [{"sleep_ms": "nan"}]}]}
    with pytest.raises(ScriptError, match=r"turns\[1\]\.events\[0\]\.sleep_ms"):
        script_items(request(msg("user", bad_later)))


_JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
_JSON = st.recursive(
    _JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_KEYS = (
    "type",
    "delta",
    "delta_times",
    "repeat",
    "sleep_ms",
    "accept_after_ms",
    "usage",
    "metadata",
    "tool_calls",
    "logprobs",
    "error",
    "message",
    "on_node",
    "http_status",
)
_SMALL_INTS = st.integers(min_value=-3, max_value=70_000)
_VALUES = {
    "type": st.sampled_from(["delta", "complete", "error", "request"]) | _JSON,
    "delta_times": _SMALL_INTS | _JSON,
    "repeat": _SMALL_INTS | _JSON,
    "http_status": st.integers(min_value=-1, max_value=700) | _JSON,
    "usage": st.dictionaries(
        st.sampled_from(["input_tokens", "output_tokens", "bogus"]), _SMALL_INTS | _JSON
    )
    | _JSON,
    "logprobs": st.lists(
        st.dictionaries(st.sampled_from(["token", "logprob", "bytes", "top_logprobs"]), _JSON)
    )
    | _JSON,
}
# An item: some of the keys a script knows, each with a value of its own kind or any JSON.
_ITEM = st.lists(st.sampled_from(_KEYS), unique=True, max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({k: _VALUES.get(k, _JSON) for k in keys})
)


@given(st.lists(_ITEM, max_size=4))
def test_any_json_in_a_script_is_played_or_a_script_error(items: list[dict[str, Any]]) -> None:
    """Whatever JSON values a script's items hold (NaN, Infinity, huge or negative numbers,
    bools, strings, lists, objects), reading it raises nothing but a ScriptError, and every
    item it lets through becomes a RunEvent the node can serialize: nothing reaches the
    node's loop as another exception."""
    text = json.dumps({"events": items})
    try:
        played = script_items(request(msg("user", text)))
    except ScriptError:
        return
    for item in played:
        if "sleep_ms" in item or "accept_after_ms" in item:
            continue
        try:
            event = event_from_item(item)
        except ScriptError:  # a tool call or a logprob's bytes: checked as the event is built
            continue
        assert isinstance(bytes(event), bytes)
