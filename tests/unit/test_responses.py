"""The Responses API over the one stream core: request translation, rendering, and the
property that chat, responses and messages renderings of any session agree.

Pure and synchronous: request bodies in, `ChatRequest`s out; session output in, wire
events out. What goes over sockets is in tests/integration/test_responses_e2e.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.api.messages import parse_messages_request
from edge.api.messages_out import STOP_REASONS, MessagesRenderer
from edge.api.render import ResponseBuilder, SSEEncoder
from edge.api.request import TOO_DEEP, parse_chat_request
from edge.api.responses import parse_responses_request
from edge.api.responses_out import ResponsesRenderer, custom_input
from edge.errors import RequestError, status_of
from edge.stream.events import Complete, NodeEvent, Usage
from edge.stream.output import ContentOut, ErrorOut, FinishOut, ReasoningOut, RoleOut, ToolCallsOut
from edge.stream.session import SessionSettings, StreamSession
from edge.stream.toolcall import ToolCall
from tests.unit.test_session import _end, endings, node_events, session_settings

RUN = "run1"


def parse(body: dict[str, Any]) -> Any:
    return parse_responses_request(json.dumps(body).encode())


# --- request translation -----------------------------------------------------------


def test_string_input_and_instructions() -> None:
    """A string input is one user message; instructions a system message before it."""
    request = parse({"model": "m", "input": "hi", "instructions": "Be brief."}).chat
    assert [(m.role, m.text()) for m in request.messages] == [
        ("system", "Be brief."),
        ("user", "hi"),
    ]


def test_items_become_messages() -> None:
    """Messages, a reasoning item, function calls and their outputs: the chat conversation
    they stand for (calls on one assistant message, reasoning on it, outputs as tool
    messages); developer is kept as a role; images become image_url parts."""
    parsed = parse({"model": "m", "input": [
        {"type": "message", "role": "developer", "content": "rules"},
        {"role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": "data:image/png;base64,AA"},
        ]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a":1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
    ]})  # fmt: skip
    messages = parsed.chat.messages
    assert [m.role for m in messages] == ["developer", "user", "assistant", "tool", "tool"]
    assert messages[1].parts[1].raw == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AA"},
    }
    assistant = messages[2]
    assert [c.id for c in assistant.tool_calls] == ["c1", "c2"]
    assert assistant.reasoning_content == "hmm"
    assert [(m.tool_call_id, m.text()) for m in messages[3:]] == [("c1", "one"), ("c2", "two")]


def test_tools_choice_format_effort() -> None:
    """Function tools (namespaces flattened, hosted tools dropped and said), tool_choice,
    text.format json_schema, reasoning.effort and max_output_tokens reach the run."""
    parsed = parse({
        "model": "m", "input": "x", "max_output_tokens": 7,
        "tools": [
            {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True},
            {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g"}]},
            {"type": "web_search"},
        ],
        "tool_choice": {"type": "function", "name": "g"},
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
        "reasoning": {"effort": "xhigh", "summary": "auto"},
        "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
    })  # fmt: skip
    chat = parsed.chat
    assert [t.name for t in chat.tools.tools] == ["f", "g"]
    assert chat.tools.tools[0].strict is True
    assert (chat.tools.choice.mode, chat.tools.choice.name) == ("function", "g")
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}},
    }
    assert chat.reasoning_effort == "high"
    assert chat.max_tokens == 7
    assert chat.prompt_cache_key == "k"
    assert parsed.dropped == ("tools[2] (type 'web_search': a hosted tool)",)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation"),
        ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": "x", "prompt_cache_key": 7}, "prompt_cache_key"),
        ({"model": "m", "input": 3}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"model": "m", "input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"model": "m", "input": "x", "temperature": 9}, "temperature"),
        ({"model": "", "input": "x"}, "model"),
    ],
)
def test_refused_requests(body: dict[str, Any], param: str) -> None:
    """Each refused request is a 400 naming the parameter (stateless ones saying why)."""
    with pytest.raises(RequestError) as refused:
        parse(body)
    assert refused.value.param == param
    assert refused.value.status == 400


def test_not_json_is_400() -> None:
    with pytest.raises(RequestError, match="could not parse"):
        parse_responses_request(b"{nope")
    with pytest.raises(RequestError, match="JSON object"):
        parse_responses_request(b"[1]")


# --- rendering -----------------------------------------------------------------------


def _responses_events(raw: bytes) -> list[dict[str, Any]]:
    events = []
    for frame in raw.decode().split("\n\n")[:-1]:
        event_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == event_line.removeprefix("event: ")
        events.append(data)
    return events


def test_render_order_and_items() -> None:
    """Reasoning, then text, then a call: three items, each opened and closed in order,
    sequence numbers 0..n-1, one response.completed carrying all three."""
    renderer = ResponsesRenderer(RUN, 1, "m", {})
    call = ToolCall(id="call_1", name="f", arguments='{"a":1}')
    raw = renderer.encode([RoleOut(), ReasoningOut("r1"), ReasoningOut("r2")])
    raw += renderer.encode([ContentOut("t1"), ContentOut("t2")])
    raw += renderer.encode([ToolCallsOut((call,)), FinishOut("tool_calls", Usage(1, 2, 1, 0))])
    events = _responses_events(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "t1t2"
    assert final["output"][2]["call_id"] == "call_1"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 1
    assert renderer.response() == final


def test_error_is_response_failed() -> None:
    """An error: response.failed with the error; the open item is incomplete."""
    renderer = ResponsesRenderer(RUN, 1, "m", {})
    events = _responses_events(
        renderer.encode([RoleOut(), ContentOut("part"), ErrorOut("run_error", "boom")])
    )
    assert events[-1]["type"] == "response.failed"
    final = events[-1]["response"]
    assert final["status"] == "failed"
    assert final["error"] == {"code": "run_error", "message": "boom"}
    assert final["output"][0]["status"] == "incomplete"
    assert final["output"][0]["content"][0]["text"] == "part"


def test_reasoning_summary_render() -> None:
    """Asked for a summary, a reasoning item carries its text as one summary_text part,
    with OpenAI's summary events in OpenAI's order (no reasoning_text content)."""
    echo = parse({"model": "m", "input": "x", "reasoning": {"summary": "auto"}}).echo
    renderer = ResponsesRenderer(RUN, 1, "m", echo)
    raw = renderer.encode([RoleOut(), ReasoningOut("r1"), ReasoningOut("r2")])
    raw += renderer.encode([ContentOut("t"), FinishOut("stop", None)])
    events = _responses_events(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[2:9]] == [
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
        "response.output_item.done",
    ]  # fmt: skip
    item_id = events[2]["item"]["id"]
    for e in events[3:8]:
        assert (e["item_id"], e["output_index"], e["summary_index"]) == (item_id, 0, 0)
    assert [e["delta"] for e in events[4:6]] == ["r1", "r2"]
    assert events[6]["text"] == "r1r2"
    assert events[7]["part"] == {"type": "summary_text", "text": "r1r2"}
    reasoning = events[-1]["response"]["output"][0]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "r1r2"}]
    assert "content" not in reasoning
    assert renderer.response() == events[-1]["response"]
    assert events[-1]["response"]["reasoning"] == {"effort": None, "summary": "auto"}
    cut = ResponsesRenderer(RUN, 1, "m", echo)
    cut.add([RoleOut(), ReasoningOut("half"), ErrorOut("run_error", "boom")])
    item = cut.response()["output"][0]
    assert (item["status"], item["summary"]) == (
        "incomplete", [{"type": "summary_text", "text": "half"}]
    )  # fmt: skip


def test_custom_tools_parse() -> None:
    """A custom tool is a function of one string, `input` (a grammar told in its
    description), listed back as the custom tool it is; tool_choice may name it; its
    earlier calls and outputs in `input` are that function's."""
    grammar = {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}
    parsed = parse({
        "model": "m",
        "tools": [{"type": "custom", "name": "apply_patch", "description": "Edit files.",
                   "format": grammar},
                  {"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "sh"}]}],
        "tool_choice": {"type": "custom", "name": "apply_patch"},
        "input": [
            {"role": "user", "content": "fix it"},
            {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** x"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"},
        ],
    })  # fmt: skip
    tools = parsed.chat.tools.tools
    assert [t.name for t in tools] == ["apply_patch", "sh"]
    assert tools[0].parameters["properties"] == {"input": {"type": "string"}}
    assert tools[0].parameters["required"] == ["input"]
    assert "Edit files." in tools[0].description
    assert "lark grammar:\nstart: /.+/" in tools[0].description
    assert parsed.chat.tools.choice.name == "apply_patch"
    assert parsed.echo["tools"] == [
        {"type": "custom", "name": "apply_patch", "description": "Edit files.", "format": grammar},
        {"type": "custom", "name": "sh"},
    ]
    assert parsed.dropped == ()
    _, call, output = parsed.chat.messages
    assert [(c.id, c.name, json.loads(c.arguments)) for c in call.tool_calls] == [
        ("c1", "apply_patch", {"input": "*** x"})
    ]
    assert (output.role, output.tool_call_id, output.text()) == ("tool", "c1", "Done")


def test_custom_tool_call_render() -> None:
    """A call of a custom tool is a custom_tool_call item with its freeform input, with
    the custom_tool_call_input events; a function tool's call stays a function_call."""
    tools = [{"type": "custom", "name": "apply_patch"}, {"type": "function", "name": "f"}]
    echo = parse({"model": "m", "input": "x", "tools": tools}).echo
    renderer = ResponsesRenderer(RUN, 1, "m", echo)
    calls = (ToolCall(id="c1", name="apply_patch", arguments='{"input": "*** Begin"}'),
             ToolCall(id="c2", name="f", arguments="{}"))  # fmt: skip
    events = _responses_events(
        renderer.encode([RoleOut(), ToolCallsOut(calls), FinishOut("tool_calls", None)])
    )
    assert [e["type"] for e in events[2:6]] == [
        "response.output_item.added", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done",
    ]  # fmt: skip
    assert events[3]["delta"] == events[4]["input"] == "*** Begin"
    assert events[3]["item_id"] == events[2]["item"]["id"]
    custom, function = events[-1]["response"]["output"]
    assert custom == {"id": f"ctc_{RUN}_0", "type": "custom_tool_call", "call_id": "c1",
                      "name": "apply_patch", "input": "*** Begin"}  # fmt: skip
    assert function["type"] == "function_call"


@pytest.mark.parametrize(
    ("arguments", "text"),
    [
        ('{"input": "a\\nb"}', "a\nb"),
        ('{"patch": "p"}', "p"),  # the model's own key, let through by report validation
        ('{"a": "1", "b": "2"}', '{"a": "1", "b": "2"}'),
        ("not json", "not json"),
        ("[1]", "[1]"),
    ],
)
def test_custom_input(arguments: str, text: str) -> None:
    """A custom tool's call reads as its `input` string, its one string value, or as written."""
    assert custom_input(arguments) == text


def test_truncation_and_summary_values() -> None:
    """`truncation` is repeated as asked (the edge truncates neither way); unknown values
    of it and of `reasoning.summary` are 400s naming them."""
    assert parse({"model": "m", "input": "x", "truncation": "auto"}).echo["truncation"] == "auto"
    assert parse({"model": "m", "input": "x"}).echo["truncation"] == "disabled"
    for body, param in (
        ({"truncation": "sometimes"}, "truncation"),
        ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
    ):
        with pytest.raises(RequestError) as refused:
            parse({"model": "m", "input": "x", **body})
        assert refused.value.param == param


# --- the property: three renderings of one session agree ----------------------------


def _chat_view(raw: bytes) -> tuple[Any, ...]:
    text, reasoning, calls, end = "", "", [], None
    for frame in raw.decode().split("\n\n")[:-1]:
        payload = frame.removeprefix("data: ")
        if payload == "[DONE]":
            continue
        data = json.loads(payload)
        if "error" in data:
            end = ("error", data["error"]["type"], data["error"]["message"])
            continue
        if not data["choices"]:
            continue  # the usage chunk
        choice = data["choices"][0]
        delta = choice["delta"]
        text += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        calls += [(c["id"], c["function"]["name"], c["function"]["arguments"])
                  for c in delta.get("tool_calls") or ()]  # fmt: skip
        if choice["finish_reason"] is not None:
            end = ("finish", choice["finish_reason"])
    return text, reasoning, calls, end


def _responses_view(raw: bytes) -> tuple[Any, ...]:
    text, reasoning, calls, end = "", "", [], None
    for event in _responses_events(raw):
        kind = event["type"]
        if kind == "response.output_text.delta":
            text += event["delta"]
        elif kind == "response.reasoning_text.delta":
            reasoning += event["delta"]
        elif kind == "response.output_item.done" and event["item"]["type"] == "function_call":
            item = event["item"]
            calls.append((item["call_id"], item["name"], item["arguments"]))
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            assert end is None, "one terminal"
            end = event["response"]
    return text, reasoning, calls, end


def _messages_view(raw: bytes) -> tuple[Any, ...]:
    text, reasoning, calls, end = "", "", [], None
    blocks: dict[int, dict[str, Any]] = {}
    for frame in raw.decode().split("\n\n")[:-1]:
        event_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        kind = data["type"]
        assert kind == event_line.removeprefix("event: ")
        if kind == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"], partial="")
        elif kind == "content_block_delta":
            delta = data["delta"]
            if delta["type"] == "text_delta":
                text += delta["text"]
            elif delta["type"] == "thinking_delta":
                reasoning += delta["thinking"]
            else:
                blocks[data["index"]]["partial"] += delta["partial_json"]
        elif kind == "content_block_stop":
            block = blocks[data["index"]]
            if block["type"] == "tool_use":
                calls.append((block["id"], block["name"], json.loads(block["partial"])))
        elif kind in ("message_delta", "error"):
            assert end is None, "one terminal"
            end = data
    return text, reasoning, calls, end


def _parsed(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@given(
    cfg=session_settings(),
    events=st.lists(node_events, max_size=10),
    ending=endings,
    run_ended=st.booleans(),
)
def test_property_three_renderings_agree(
    cfg: SessionSettings, events: list[NodeEvent], ending: str, run_ended: bool
) -> None:
    """For any node event sequence and any ending, the chat, responses and messages
    renderings of the one session (fed batch by batch, as the HTTP layer does) agree on
    the text, the reasoning, the tool calls (ids, names, arguments) and how the answer
    ended; each non-streaming fold agrees with its stream."""
    session = StreamSession(cfg)
    chat = SSEEncoder("chatcmpl-" + RUN, 1, "m", include_usage=True)
    responses = ResponsesRenderer(RUN, 1, "m", {})
    messages = MessagesRenderer(RUN, "m", status_of=status_of)
    folds = (ResponseBuilder(), ResponsesRenderer(RUN, 1, "m", {}),
             MessagesRenderer(RUN, "m", status_of=status_of))  # fmt: skip
    raw = [b"", b"", b""]

    def take() -> None:
        batch = session.drain()
        for i, renderer in enumerate((chat, responses, messages)):
            raw[i] += renderer.encode(batch)
        for fold in folds:
            fold.add(batch)

    take()
    for event in [*events, Complete(Usage(1, 2))] if run_ended else events:
        session.feed(event)
        take()
    _end(session, ending)
    take()

    c_text, c_reasoning, c_calls, c_end = _chat_view(raw[0])
    r_text, r_reasoning, r_calls, r_end = _responses_view(raw[1])
    m_text, m_reasoning, m_calls, m_end = _messages_view(raw[2])
    assert c_text == r_text == m_text
    assert c_reasoning == r_reasoning == m_reasoning
    assert c_calls == r_calls
    assert [(i, n, _parsed(a)) for i, n, a in c_calls] == m_calls

    if c_end is None:  # cancelled without a notice: no terminal in any rendering
        assert r_end is None
        assert m_end is None
        return
    if c_end[0] == "finish":
        finish_reason = c_end[1]
        incomplete = finish_reason in ("length", "content_filter")
        assert r_end["status"] == ("incomplete" if incomplete else "completed")
        assert m_end["type"] == "message_delta"
        assert m_end["delta"]["stop_reason"] == STOP_REASONS.get(finish_reason, "end_turn")
        # The whole answers agree with the streams.
        chat_body = folds[0].response("chatcmpl-" + RUN, 1, "m")
        assert (chat_body["choices"][0]["message"]["content"] or "") == c_text
        assert folds[1].response() == r_end
        whole = folds[2].response()
        assert "".join(b["text"] for b in whole["content"] if b["type"] == "text") == m_text
        assert [(b["id"], b["name"], b["input"]) for b in whole["content"]
                if b["type"] == "tool_use"] == m_calls  # fmt: skip
    else:
        _, error_type, message = c_end
        assert r_end["status"] == "failed"
        assert r_end["error"] == {"code": error_type, "message": message}
        assert m_end["type"] == "error"
        assert message in m_end["error"]["message"]
        assert folds[0].error == folds[1].error == folds[2].error == ErrorOut(error_type, message)


@pytest.mark.parametrize(
    "parse", [parse_chat_request, parse_responses_request, parse_messages_request]
)
def test_a_body_nested_too_deeply_is_a_400_in_every_api(
    parse: Callable[[bytes], object],
) -> None:
    """Past Python's recursion limit in the JSON decoder, each API's parser answers the
    same 400 (`deep_is_refused`), never a 500."""
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(RequestError) as raised:
        parse(b'{"model": "m", "nested": ' + deep + b"}")
    assert raised.value.message == TOO_DEEP


# Where a body holds 975 nested arrays (spliced into its JSON text): deep enough to
# pass the JSON decoder and, before the body's depth bound, to exhaust Python's
# recursion limit in the walks that build the node's RunRequest.
_DEEP = "<deep>"
_DEEP_JSON = "[" * 975 + "]" * 975


def _deep() -> str:
    return _DEEP


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def _messages(*blocks: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": list(blocks)}],
            **fields}  # fmt: skip


def _responses(*parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": [{"role": "user", "content": list(parts)}], **fields}


_DEEP_BODIES: dict[str, tuple[Callable[[bytes], object], dict[str, Any]]] = {
    "chat content part": (parse_chat_request, _chat(messages=[
        {"role": "user", "content": [{"type": "input_audio", "input_audio": _deep()}]}])),
    "chat response_format extra": (parse_chat_request, _chat(
        response_format={"type": "json_object", "extra": _deep()})),
    "chat chat_template_kwargs": (parse_chat_request, _chat(chat_template_kwargs={"x": _deep()})),
    "chat tool schema": (parse_chat_request, _chat(tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"x": _deep()}}}])),
    "chat metadata": (parse_chat_request, _chat(metadata={"x": _deep()})),
    "chat assistant tool call": (parse_chat_request, _chat(messages=[
        {"role": "assistant", "tool_calls": [{"id": "c", "function": _deep()}]}])),
    "messages document": (parse_messages_request, _messages(
        {"type": "document", "source": {"type": "content", "content": _deep()}})),
    "messages tool_result": (parse_messages_request, _messages(
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "x", "y": _deep()}]})),
    "messages tool_use input": (parse_messages_request, {"model": "m", "max_tokens": 5,
        "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {"x": _deep()}}]}]}),
    "messages tool input_schema": (parse_messages_request, _messages(
        {"type": "text", "text": "hi"}, tools=[{"name": "f", "input_schema": {"x": _deep()}}])),
    "messages metadata": (parse_messages_request, _messages(
        {"type": "text", "text": "hi"}, metadata={"x": _deep()})),
    "responses input_file": (parse_responses_request, _responses(
        {"type": "input_file", "file_data": _deep()})),
    "responses function_call_output": (parse_responses_request, {"model": "m", "input": [
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "x",
                                                                   "y": _deep()}]}]}),
    "responses text.format": (parse_responses_request, _responses(
        {"type": "input_text", "text": "hi"},
        text={"format": {"type": "json_schema", "name": "n", "schema": {"x": _deep()}}})),
    "responses tools": (parse_responses_request, _responses(
        {"type": "input_text", "text": "hi"},
        tools=[{"type": "function", "name": "f", "parameters": {"x": _deep()}}])),
    "responses reasoning": (parse_responses_request, _responses(
        {"type": "input_text", "text": "hi"}, reasoning={"effort": "low", "x": _deep()})),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_DEEP_BODIES))
def test_a_deep_free_form_field_is_refused_where_the_body_enters(case: str) -> None:
    """Any field of any API nested past MAX_JSON_DEPTH (975 levels: under the decoder's
    own recursion limit) is the same 400 naming the limit, raised where the body is
    decoded, before any field is read or any value walked recursively."""
    parse, obj = _DEEP_BODIES[case]
    text = json.dumps(obj)
    assert text.count(json.dumps(_DEEP)) == 1
    with pytest.raises(RequestError) as raised:
        parse(text.replace(json.dumps(_DEEP), _DEEP_JSON).encode())
    assert raised.value.message == TOO_DEEP
    assert raised.value.status == 400
