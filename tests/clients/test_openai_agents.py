"""The OpenAI Agents SDK (openai-agents) on its Chat Completions model, against a real edge.

The agent's instructions (its system message) hold the sim script, so the
user input is ordinary text, as in an application. Each case runs on its
own asyncio loop with its own AsyncOpenAI client, closed before the loop
ends. Tracing is off: it would export to OpenAI. Usage in a stream needs
`ModelSettings(include_usage=True)` for a server that is not OpenAI's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    ReasoningItem,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import ResponseTextDeltaEvent
from pydantic import BaseModel

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

set_tracing_disabled(True)

T = TypeVar("T")
CITIES: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    CITIES.append(city)
    return f"22 C, sunny in {city}"


@function_tool(strict_mode=False)
def get_weather_loose(city: str) -> str:
    """Current weather for a city (a non-strict tool: the model's mistakes reach the agent)."""
    CITIES.append(city)
    return f"22 C, sunny in {city}"


def with_agent(
    base_url: str,
    instructions: str,
    go: Callable[[Agent[Any]], Awaitable[T]],
    model: str = "sim-script",
    **kwargs: Any,
) -> T:
    """`go(agent)` on a fresh asyncio loop, the agent's client closed before the loop ends."""

    async def main() -> T:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            agent = Agent(
                name="assistant",
                instructions=instructions,
                model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                **kwargs,
            )
            return await go(agent)

    return asyncio.run(main())


def test_streaming_text_usage_and_reasoning(base_url: str) -> None:
    """run_streamed: text deltas add up, reasoning becomes a ReasoningItem, usage is counted."""

    async def go(agent: Agent[Any]) -> tuple[str, Any]:
        result = Runner.run_streamed(agent, "Say hello.")
        text = ""
        async for event in result.stream_events():
            if event.type == "raw_response_event" and isinstance(
                event.data, ResponseTextDeltaEvent
            ):
                text += event.data.delta
        return text, result

    text, result = with_agent(
        base_url,
        script(say("Hello there", reasoning="Hmm.")),
        go,
        model_settings=ModelSettings(include_usage=True),
    )
    assert text == "Hello there"
    assert result.final_output == "Hello there"
    assert any(isinstance(item, ReasoningItem) for item in result.new_items)
    usage = result.context_wrapper.usage
    assert (usage.input_tokens, usage.output_tokens) == (11, 7)


def test_tool_loop_of_two_turns(base_url: str) -> None:
    """The agent runs the tool the model called and sends the result back; turn 2 answers."""
    CITIES.clear()
    instructions = turns(call("get_weather", WEATHER_ARGS), say(WEATHER_ANSWER))
    result = with_agent(
        base_url, instructions, lambda a: Runner.run(a, "Weather?"), tools=[get_weather]
    )
    assert CITIES == ["Paris"]
    assert result.final_output == WEATHER_ANSWER


def test_repaired_bad_call(base_url: str) -> None:
    """A non-strict tool called with {"city": 123}: the agent sends the error back as the
    tool's output, and the model's next turn calls it right."""
    CITIES.clear()
    instructions = turns(
        call("get_weather_loose", BAD_WEATHER_ARGS, "call_1"),
        call("get_weather_loose", WEATHER_ARGS, "call_2"),
        say(WEATHER_ANSWER),
    )
    result = with_agent(
        base_url, instructions, lambda a: Runner.run(a, "Weather?"), tools=[get_weather_loose]
    )
    assert CITIES == ["Paris"]
    assert result.final_output == WEATHER_ANSWER


class City(BaseModel):
    name: str
    population: int


def test_structured_output(base_url: str) -> None:
    """output_type: the model's JSON answer becomes the final output, validated."""
    answer = json.dumps({"name": "Paris", "population": 2100000})
    result = with_agent(
        base_url, script(say(answer)), lambda a: Runner.run(a, "Paris?"), output_type=City
    )
    assert result.final_output == City(name="Paris", population=2100000)


def test_mid_stream_error_is_raised(base_url: str) -> None:
    """An error frame mid-stream fails the run with the SDK's APIError, not a short answer."""

    async def go(agent: Agent[Any]) -> None:
        async for _ in Runner.run_streamed(agent, "Go.").stream_events():
            pass

    with pytest.raises(openai.APIError, match="GPU fell over"):
        with_agent(base_url, script(fail_midway("partial ", "GPU fell over")), go)


def test_unknown_model_is_404(base_url: str) -> None:
    with pytest.raises(openai.NotFoundError):
        with_agent(base_url, "Be brief.", lambda a: Runner.run(a, "hi"), model="no-such-model")
