"""Instructor (instructor.from_openai over the sync openai client) against a real edge.

Instructor answers with pydantic objects, so its cases are structured ones:
a forced tool call (TOOLS mode, the default), a JSON answer (JSON mode),
partial objects from a stream, usage from the raw completion, the reask
that repairs a bad call (`max_retries=2`), a mid-stream error and a 404.
The script is the first user message: JSON mode writes its own
instructions into the system message, and a reask adds messages after it.
"""

from __future__ import annotations

import json

import instructor
import openai
import pytest
from instructor.core import InstructorRetryException
from pydantic import BaseModel, ConfigDict

from tests.clients.scripts import (
    BAD_WEATHER_ARGS,
    WEATHER_ARGS,
    call,
    fail_midway,
    say,
    script,
    turns,
)


class Weather(BaseModel):
    """The city to get the weather for."""

    model_config = ConfigDict(title="get_weather")
    city: str


@pytest.fixture
def client(base_url: str) -> instructor.Instructor:
    sdk = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    return instructor.from_openai(sdk)


def ask(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_tools_mode_with_usage(client: instructor.Instructor) -> None:
    """The forced call becomes the object; the raw completion carries the node's usage."""
    weather, completion = client.chat.completions.create_with_completion(
        model="sim-script",
        response_model=Weather,
        messages=ask(script(call("get_weather", WEATHER_ARGS))),
    )
    assert weather.model_dump() == WEATHER_ARGS
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (11, 7)


def test_json_mode(base_url: str) -> None:
    """JSON mode reads the object from the content."""
    sdk = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    client = instructor.from_openai(sdk, mode=instructor.Mode.JSON)
    weather = client.chat.completions.create(
        model="sim-script",
        response_model=Weather,
        messages=ask(script(say(json.dumps(WEATHER_ARGS)))),
    )
    assert weather.model_dump() == WEATHER_ARGS


def test_streaming_partial_objects(client: instructor.Instructor) -> None:
    """create_partial over a stream ends with the whole object."""
    partials = list(
        client.chat.completions.create_partial(
            model="sim-script",
            response_model=Weather,
            messages=ask(script(call("get_weather", WEATHER_ARGS))),
        )
    )
    assert partials
    assert partials[-1].city == "Paris"


@pytest.mark.xfail(strict=True, reason="needs tool_validation report mode")
def test_repaired_bad_call_with_max_retries(client: instructor.Instructor) -> None:
    """{"city": 123} fails validation; Instructor's reask (the error as the tool's result)
    gets the model's second turn, which is right."""
    weather = client.chat.completions.create(
        model="sim-script",
        response_model=Weather,
        max_retries=2,
        messages=ask(
            turns(
                call("get_weather", BAD_WEATHER_ARGS, "call_1"),
                call("get_weather", WEATHER_ARGS, "call_2"),
            )
        ),
    )
    assert weather.model_dump() == WEATHER_ARGS


def test_mid_stream_error_is_raised(client: instructor.Instructor) -> None:
    """An error frame in a stream is raised (wrapped, like every API error, in Instructor's
    InstructorRetryException), not turned into a partial object."""

    def read() -> None:
        for _ in client.chat.completions.create_partial(
            model="sim-script",
            response_model=Weather,
            messages=ask(script(fail_midway('{"ci', "GPU fell over"))),
        ):
            pass

    with pytest.raises(InstructorRetryException) as caught:
        read()
    assert isinstance(caught.value.__cause__, openai.APIError)
    assert "GPU fell over" in str(caught.value.__cause__)


def test_unknown_model_is_404(client: instructor.Instructor) -> None:
    """The SDK's NotFoundError, wrapped by Instructor."""
    with pytest.raises(InstructorRetryException) as caught:
        client.chat.completions.create(
            model="no-such-model", response_model=Weather, messages=ask("hi")
        )
    assert isinstance(caught.value.__cause__, openai.NotFoundError)
