"""The OpenAI Agents SDK (openai-agents) on its default model, the Responses API, against
a real edge (`POST /v1/responses`).

As in test_openai_agents.py: the agent's instructions hold the sim script, each case
runs on its own asyncio loop with its own AsyncOpenAI client, tracing is off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import openai
from agents import (
    Agent,
    OpenAIResponsesModel,
    ReasoningItem,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import ResponseTextDeltaEvent

from tests.clients.scripts import WEATHER_ANSWER, WEATHER_ARGS, call, say, script, turns
from tests.clients.test_openai_agents import CITIES

set_tracing_disabled(True)

T = TypeVar("T")


@function_tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    CITIES.append(city)
    return f"22 C, sunny in {city}"


def with_agent(
    base_url: str, instructions: str, go: Callable[[Agent[Any]], Awaitable[T]], **kwargs: Any
) -> T:
    """`go(agent)` on a fresh asyncio loop, the agent's client closed before the loop ends."""

    async def main() -> T:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            model = OpenAIResponsesModel(model="sim-script", openai_client=client)
            agent = Agent(name="assistant", instructions=instructions, model=model, **kwargs)
            return await go(agent)

    return asyncio.run(main())


def test_streaming_text_usage_and_reasoning(base_url: str) -> None:
    """run_streamed over /v1/responses: text deltas add up, reasoning becomes a
    ReasoningItem, usage is counted."""

    async def go(agent: Agent[Any]) -> tuple[str, Any]:
        result = Runner.run_streamed(agent, "Say hello.")
        text = ""
        async for event in result.stream_events():
            if event.type == "raw_response_event" and isinstance(
                event.data, ResponseTextDeltaEvent
            ):
                text += event.data.delta
        return text, result

    text, result = with_agent(base_url, script(say("Hello there", reasoning="Hmm.")), go)
    assert text == "Hello there"
    assert result.final_output == "Hello there"
    assert any(isinstance(item, ReasoningItem) for item in result.new_items)
    usage = result.context_wrapper.usage
    assert (usage.input_tokens, usage.output_tokens) == (11, 7)


def test_tool_loop_of_two_turns(base_url: str) -> None:
    """The agent runs the tool the model called, sends its output back as a
    function_call_output item; turn 2 answers."""
    CITIES.clear()
    instructions = turns(call("get_weather", WEATHER_ARGS), say(WEATHER_ANSWER))
    result = with_agent(
        base_url, instructions, lambda a: Runner.run(a, "Weather?"), tools=[get_weather]
    )
    assert CITIES == ["Paris"]
    assert result.final_output == WEATHER_ANSWER
