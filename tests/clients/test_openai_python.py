"""openai-python (the official SDK) against a real edge and sim node.

Streaming text, usage, reasoning, a two-turn tool loop, structured output,
a mid-stream error and a 404, each the way an application writes it.
"""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from tests.clients.scripts import (
    USAGE,
    WEATHER_ANSWER,
    WEATHER_ARGS,
    call,
    fail_midway,
    say,
    script,
    turns,
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


def test_streaming_text_usage_and_reasoning(client: openai.OpenAI) -> None:
    """Content arrives in pieces, reasoning as `reasoning_content`, usage in the last chunk."""
    stream = client.chat.completions.create(
        model="sim-script",
        messages=[{"role": "user", "content": script(say("Hello there", reasoning="Hmm."))}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for c in chunks
        if c.choices
    )
    assert text == "Hello there"
    assert reasoning == "Hmm."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (11, 7)
    assert usage.completion_tokens_details.reasoning_tokens == 3


def test_tool_loop_of_two_turns(client: openai.OpenAI) -> None:
    """The call comes back typed; the tool result sent back gets the final answer."""
    messages: list[dict[str, object]] = [
        {"role": "user", "content": turns(call("get_weather", WEATHER_ARGS), say(WEATHER_ANSWER))}
    ]
    first = client.chat.completions.create(
        model="sim-script", messages=messages, tools=[WEATHER_TOOL]
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (tool_call,) = choice.message.tool_calls or []
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == WEATHER_ARGS
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": "22 C, sunny"},
    ]
    second = client.chat.completions.create(
        model="sim-script", messages=messages, tools=[WEATHER_TOOL]
    )
    assert second.choices[0].message.content == WEATHER_ANSWER
    assert second.choices[0].finish_reason == "stop"


class City(BaseModel):
    name: str
    population: int


def test_structured_output_with_parse(client: openai.OpenAI) -> None:
    """`chat.completions.parse` with a pydantic response_format reads the model's JSON."""
    answer = json.dumps({"name": "Paris", "population": 2100000})
    completion = client.chat.completions.parse(
        model="sim-script",
        messages=[{"role": "user", "content": script(say(answer))}],
        response_format=City,
    )
    assert completion.choices[0].message.parsed == City(name="Paris", population=2100000)


def test_mid_stream_error_is_raised(client: openai.OpenAI) -> None:
    """An error after content has streamed is raised by the iterator, with the node's words."""
    stream = client.chat.completions.create(
        model="sim-script",
        messages=[{"role": "user", "content": script(fail_midway("partial ", "GPU fell over"))}],
        stream=True,
    )
    seen: list[str] = []

    def read() -> None:
        for chunk in stream:
            if chunk.choices:
                seen.append(chunk.choices[0].delta.content or "")

    with pytest.raises(openai.APIError, match="GPU fell over"):
        read()
    assert "".join(seen) == "partial "


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    """An unknown model is the SDK's NotFoundError, code model_not_found."""
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 404


def test_models_retrieve(client: openai.OpenAI) -> None:
    """`models.retrieve` gives the model object; an unknown id is NotFoundError."""
    model = client.models.retrieve("sim-echo")
    assert (model.id, model.object, model.owned_by) == ("sim-echo", "model", "iop")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_legacy_completions(client: openai.OpenAI) -> None:
    """`completions.create`, whole and streamed (with usage): `choices[0].text`, its
    finish reason, usage; the stream's text pieces join to the same text."""
    prompt = script(say("Once upon a time"))
    whole = client.completions.create(model="sim-script", prompt=prompt, max_tokens=50)
    assert whole.object == "text_completion"
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == ("Once upon a time", "stop")
    assert whole.usage is not None
    assert whole.usage.completion_tokens == USAGE["output_tokens"]
    chunks = list(
        client.completions.create(
            model="sim-script", prompt=prompt, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Once upon a time"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == USAGE["input_tokens"] + USAGE["output_tokens"]
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model="sim-script", prompt="x", suffix="y")
