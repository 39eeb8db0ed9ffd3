"""LangChain's ChatOpenAI (langchain-openai) against a real edge and sim node.

ChatOpenAI reads no `reasoning_content` from Chat Completions (its docs send
that to provider subclasses): the reasoning case checks only that reasoning
never leaks into the content.
"""

from __future__ import annotations

import json

import openai
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.clients.scripts import (
    WEATHER_ANSWER,
    WEATHER_ARGS,
    call,
    fail_midway,
    say,
    script,
    turns,
)


@tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return f"22 C, sunny in {city}"


def chat(base_url: str, model: str = "sim-script") -> ChatOpenAI:
    return ChatOpenAI(
        model=model, base_url=base_url, api_key="unused", max_retries=0, stream_usage=True
    )


def test_streaming_text_with_usage(base_url: str) -> None:
    """Chunks add up to the text; the usage chunk fills usage_metadata; reasoning stays out."""
    chunks = list(chat(base_url).stream(script(say("Hello there", reasoning="Hmm."))))
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert isinstance(total, AIMessageChunk)
    assert total.content == "Hello there"
    assert total.usage_metadata is not None
    assert total.usage_metadata["input_tokens"] == 11
    assert total.usage_metadata["output_tokens"] == 7
    assert total.response_metadata.get("finish_reason") == "stop"


def test_tool_loop_of_two_turns(base_url: str) -> None:
    """bind_tools: the tool call, then the ToolMessage, then the final answer."""
    model = chat(base_url).bind_tools([get_weather])
    messages: list[object] = [
        HumanMessage(turns(call("get_weather", WEATHER_ARGS), say(WEATHER_ANSWER)))
    ]
    first = model.invoke(messages)
    assert isinstance(first, AIMessage)
    (tool_call,) = first.tool_calls
    assert tool_call["name"] == "get_weather"
    assert tool_call["args"] == WEATHER_ARGS
    messages += [
        first,
        ToolMessage(get_weather.invoke(tool_call["args"]), tool_call_id=tool_call["id"]),
    ]
    second = model.invoke(messages)
    assert second.content == WEATHER_ANSWER


class City(BaseModel):
    name: str
    population: int


def test_structured_output(base_url: str) -> None:
    """with_structured_output (json_schema) parses the model's JSON into the model class."""
    answer = json.dumps({"name": "Paris", "population": 2100000})
    result = chat(base_url).with_structured_output(City).invoke(script(say(answer)))
    assert result == City(name="Paris", population=2100000)


def test_mid_stream_error_is_raised(base_url: str) -> None:
    """An error frame after some content raises out of .stream()."""
    with pytest.raises(openai.APIError, match="GPU fell over"):
        for _ in chat(base_url).stream(script(fail_midway("partial ", "GPU fell over"))):
            pass


def test_unknown_model_is_404(base_url: str) -> None:
    with pytest.raises(openai.NotFoundError):
        chat(base_url, model="no-such-model").invoke("hi")
