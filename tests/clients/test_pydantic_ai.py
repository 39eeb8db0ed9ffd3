"""pydantic-ai (pydantic-ai-slim[openai], OpenAIChatModel) against a real edge and sim node.

The sim script is the user prompt (the first user message); pydantic-ai's
retry prompts go back as tool messages, which move the script's turn on.
Each case runs on its own asyncio loop with its own AsyncOpenAI client,
closed before the loop ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import openai
import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, Tool
from pydantic_ai.exceptions import ModelAPIError, ModelHTTPError
from pydantic_ai.messages import ModelResponse, ThinkingPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

from tests.clients.scripts import (
    BAD_WEATHER_ARGS,
    WEATHER_ANSWER,
    WEATHER_ARGS,
    call,
    fail_midway,
    say,
    script,
    turns,
)

T = TypeVar("T")
CITIES: list[str] = []


def get_weather(city: str) -> str:
    """Current weather for a city."""
    CITIES.append(city)
    return f"22 C, sunny in {city}"


def with_agent(
    base_url: str,
    go: Callable[[Agent[None, Any]], Awaitable[T]],
    model: str = "sim-script",
    **kwargs: Any,
) -> T:
    """`go(agent)` on a fresh asyncio loop, the agent's client closed before the loop ends."""

    async def main() -> T:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            chat = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client))
            return await go(Agent(chat, **kwargs))

    return asyncio.run(main())


def test_streaming_text_with_usage(base_url: str) -> None:
    """run_stream: text deltas add up; usage is the node's."""

    async def go(agent: Agent[None, Any]) -> tuple[list[str], Any]:
        async with agent.run_stream(script(say("Hello there big world"))) as result:
            pieces = [p async for p in result.stream_text(delta=True)]
            return pieces, result.usage

    pieces, usage = with_agent(base_url, go)
    assert "".join(pieces) == "Hello there big world"
    assert (usage.input_tokens, usage.output_tokens) == (11, 7)


def test_reasoning_is_a_thinking_part(base_url: str) -> None:
    """reasoning_content becomes a ThinkingPart beside the text of the response."""
    result = with_agent(
        base_url, lambda a: a.run(script(say("Hello there", reasoning="Let me think.")))
    )
    assert result.output == "Hello there"
    response = result.all_messages()[-1]
    assert isinstance(response, ModelResponse)
    thinking = [p.content for p in response.parts if isinstance(p, ThinkingPart)]
    assert thinking == ["Let me think."]


def test_tool_loop_of_two_turns(base_url: str) -> None:
    """The agent runs the tool the model called and sends the result back; turn 2 answers."""
    CITIES.clear()
    prompt = turns(call("get_weather", WEATHER_ARGS), say(WEATHER_ANSWER))
    result = with_agent(base_url, lambda a: a.run(prompt), tools=[get_weather])
    assert CITIES == ["Paris"]
    assert result.output == WEATHER_ANSWER


REPAIR = turns(
    call("get_weather", BAD_WEATHER_ARGS, "call_1"),
    call("get_weather", WEATHER_ARGS, "call_2"),
    say(WEATHER_ANSWER),
)


def test_repaired_bad_call(base_url: str) -> None:
    """{"city": 123} fails the tool's validation; pydantic-ai sends the error back as a retry,
    and the model's next turn calls the tool right. pydantic-ai declares a tool strict when
    its schema allows; a non-strict tool gets the edge's default, report."""
    CITIES.clear()
    tool = Tool(get_weather, strict=False)
    result = with_agent(base_url, lambda a: a.run(REPAIR), tools=[tool])
    assert CITIES == ["Paris"]
    assert result.output == WEATHER_ANSWER


def test_repaired_bad_call_of_a_strict_tool_with_report_asked(base_url: str) -> None:
    """pydantic-ai's default (strict) tool repairs too when the request asks for report."""
    CITIES.clear()
    settings = ModelSettings(extra_body={"tool_validation": "report"})
    result = with_agent(
        base_url, lambda a: a.run(REPAIR), tools=[get_weather], model_settings=settings
    )
    assert CITIES == ["Paris"]
    assert result.output == WEATHER_ANSWER


def test_bad_call_of_a_strict_tool_is_an_error(base_url: str) -> None:
    """A tool pydantic-ai declared strict is held to its schema: the bad call is a 422."""
    CITIES.clear()
    with pytest.raises(ModelHTTPError) as caught:
        with_agent(base_url, lambda a: a.run(REPAIR), tools=[get_weather])
    assert caught.value.status_code == 422
    assert CITIES == []


class City(BaseModel):
    name: str
    population: int


def test_structured_output(base_url: str) -> None:
    """output_type: pydantic-ai's output tool, called by the model, gives the validated object."""
    prompt = script(call("final_result", {"name": "Paris", "population": 2100000}))
    result = with_agent(base_url, lambda a: a.run(prompt), output_type=City)
    assert result.output == City(name="Paris", population=2100000)


def test_mid_stream_error_is_raised(base_url: str) -> None:
    """An error frame mid-stream fails the run with an error, not a short answer."""

    async def go(agent: Agent[None, Any]) -> None:
        async with agent.run_stream(script(fail_midway("partial ", "GPU fell over"))) as result:
            async for _ in result.stream_text(delta=True):
                pass

    with pytest.raises(ModelAPIError, match="GPU fell over") as caught:
        with_agent(base_url, go)
    assert isinstance(caught.value.__cause__, openai.APIError)


def test_unknown_model_is_404(base_url: str) -> None:
    with pytest.raises(ModelHTTPError) as caught:
        with_agent(base_url, lambda a: a.run("hi"), model="no-such-model")
    assert caught.value.status_code == 404
