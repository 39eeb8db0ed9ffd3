"""Multi-turn sim scripts end to end: raw HTTP -> real edge -> `iop-sim-node` process.

An agent loop is scripted once, in the first user message or a system
message; each request of the loop plays the turn its assistant messages say.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import trio

from tests.integration.conftest import WEATHER_TOOL, RunningEdge

CALL = {"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}
LOOP = json.dumps(
    {
        "turns": [
            {"events": [{"type": "complete", "tool_calls": [CALL]}]},
            {
                "events": [
                    {"type": "delta", "delta": "Sunny in Paris."},
                    {"type": "complete", "metadata": {"finish_reason": "stop"}},
                ]
            },
        ]
    }
)
ASSISTANT_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        }
    ],
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}


async def post(http: httpx.AsyncClient, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "sim-script", "messages": messages, "tools": [WEATHER_TOOL]}
    return await http.post("/v1/chat/completions", json=body)


async def test_tool_loop_of_two_turns_from_first_user_message(http: httpx.AsyncClient) -> None:
    """Turn 0 calls the tool; with the call and its result sent back, turn 1 answers."""
    first = await post(http, [{"role": "user", "content": LOOP}])
    assert first.status_code == 200, first.text
    choice = first.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"

    second = await post(http, [{"role": "user", "content": LOOP}, ASSISTANT_CALL, TOOL_RESULT])
    assert second.status_code == 200, second.text
    choice = second.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "Sunny in Paris."


async def test_script_in_system_message_with_framework_text_as_user(
    http: httpx.AsyncClient,
) -> None:
    """A system message's script plays when the user message is ordinary (framework) text."""
    messages = [
        {"role": "system", "content": LOOP},
        {"role": "user", "content": "Weather in Paris? Use the tools you have."},
        ASSISTANT_CALL,
        TOOL_RESULT,
    ]
    response = await post(http, messages)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Sunny in Paris."


async def test_past_the_last_turn_is_an_error_naming_the_turn(http: httpx.AsyncClient) -> None:
    """A third request of a two-turn loop is refused (400: the request's fault) with the
    node's words, which say which turn it was."""
    messages = [
        {"role": "user", "content": LOOP},
        ASSISTANT_CALL,
        TOOL_RESULT,
        {"role": "assistant", "content": "Sunny in Paris."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    response = await post(http, messages)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_script")
    assert "turn 2" in error["message"]
    assert "2 turn(s)" in error["message"]


async def test_script_in_first_user_message_behind_a_retry_prompt(
    http: httpx.AsyncClient,
) -> None:
    """A framework's retry prompt as the last user message: the first user message's script
    plays, at the turn its assistant messages say."""
    messages = [
        {"role": "user", "content": LOOP},
        {"role": "assistant", "content": "I will look it up."},
        {"role": "user", "content": "Validation error: call the tool again, fix the errors."},
    ]
    response = await post(http, messages)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Sunny in Paris."


async def test_streamed_turn_ends_with_its_terminal(http: httpx.AsyncClient) -> None:
    """Streamed, turn 1 of a loop sends its text and finish_reason stop, then [DONE]."""
    body = {
        "model": "sim-script",
        "messages": [{"role": "user", "content": LOOP}, ASSISTANT_CALL, TOOL_RESULT],
        "tools": [WEATHER_TOOL],
        "stream": True,
    }
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "Sunny in Paris."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# CrewAI's task prompt around the user's text (its words, as its agents send them), and the
# system prompt of its tool-using agent (braces and JSON examples of its own).
CREWAI_SYSTEM = (
    "You are Weather reporter. You report the weather.\nYour personal goal is: Answer"
    " weather questions\nYou ONLY have access to the following tools: get_weather\n"
    "Action Input: the input to the action, just a simple JSON object, enclosed in curly"
    ' braces, using " to wrap keys and values, e.g. {"city": "Paris"}\n'
)
CREWAI_TASK = (
    "\nCurrent Task: {}\n\nThis is the expected criteria for your final answer: A short"
    " weather report.\nyou MUST return the actual complete content as the final answer, not"
    " a summary.\n\nBegin! This is VERY important to you, use the tools available and give"
    " your best Final Answer, your job depends on it!\n\nThought:"
)


async def test_a_script_inside_a_frameworks_prompt_plays_its_turns(edge: RunningEdge) -> None:
    """CrewAI wraps the user's text in its task prompt (and DSPy, ADK in theirs): the script
    inside it is found (`"Extra data"` no more), through the `openai` SDK, both turns of
    the loop, streamed and not; the system prompt's JSON example is not taken for one."""
    tools = [WEATHER_TOOL]
    task = {"role": "user", "content": CREWAI_TASK.format(LOOP)}

    def loop(client: openai.OpenAI) -> tuple[Any, str]:
        messages: list[Any] = [{"role": "system", "content": CREWAI_SYSTEM}, task]
        first = client.chat.completions.create(model="sim-script", messages=messages, tools=tools)
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message, {**TOOL_RESULT, "tool_call_id": call.id}]
        streamed = client.chat.completions.create(
            model="sim-script", messages=messages, tools=tools, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        return call, text

    def run() -> tuple[Any, str]:
        with openai.OpenAI(base_url=f"{edge.url}/v1", api_key="x", max_retries=0) as client:
            return loop(client)

    call, text = await trio.to_thread.run_sync(run)
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"},
    )  # fmt: skip
    assert text == "Sunny in Paris."
