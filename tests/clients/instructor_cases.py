"""Instructor's cases, run by `test_instructor.py` in Instructor's own venv.

    .venv-instructor/bin/python -m tests.clients.instructor_cases BASE_URL

Instructor 1.17.0 (the newest) caps jiter below 0.15, which caps openai at
3.3.0; the main venv tests the newest openai SDK, so Instructor and the
openai release it allows live in `.venv-instructor` (pins:
`tests/clients/instructor-requirements.txt`, built by `make setup`/`make
test`). This module imports only those and `tests.clients.scripts`. It runs
every case and prints one JSON line: case name -> "ok" or the failure's
traceback.

Instructor answers with pydantic objects, so its cases are structured ones:
a forced tool call (TOOLS mode, the default), a JSON answer (JSON mode),
partial objects from a stream, usage from the raw completion, the reask
that repairs a bad call (`max_retries=2`), a mid-stream error and a 404.
The script is the first user message: JSON mode writes its own
instructions into the system message, and a reask adds messages after it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import instructor
import openai
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
from tests.clients.venvcases import main


class Weather(BaseModel):
    """The city to get the weather for."""

    model_config = ConfigDict(title="get_weather")
    city: str


def make_client(
    base_url: str, mode: instructor.Mode = instructor.Mode.TOOLS
) -> instructor.Instructor:
    sdk = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    return instructor.from_openai(sdk, mode=mode)


def raised(fn: Callable[[], object]) -> Exception:
    """The exception `fn()` raised (this module runs without pytest)."""
    try:
        fn()
    except Exception as exc:  # the case asserts what it is
        return exc
    raise AssertionError("no exception was raised")


def ask(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def tools_mode_with_usage(base_url: str) -> None:
    """The forced call becomes the object; the raw completion carries the node's usage."""
    client = make_client(base_url)
    weather, completion = client.chat.completions.create_with_completion(
        model="sim-script",
        response_model=Weather,
        messages=ask(script(call("get_weather", WEATHER_ARGS))),
    )
    assert weather.model_dump() == WEATHER_ARGS
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (11, 7)


def json_mode(base_url: str) -> None:
    """JSON mode reads the object from the content."""
    client = make_client(base_url, instructor.Mode.JSON)
    weather = client.chat.completions.create(
        model="sim-script",
        response_model=Weather,
        messages=ask(script(say(json.dumps(WEATHER_ARGS)))),
    )
    assert weather.model_dump() == WEATHER_ARGS


def streaming_partial_objects(base_url: str) -> None:
    """create_partial over a stream ends with the whole object."""
    client = make_client(base_url)
    partials = list(
        client.chat.completions.create_partial(
            model="sim-script",
            response_model=Weather,
            messages=ask(script(call("get_weather", WEATHER_ARGS))),
        )
    )
    assert partials
    assert partials[-1].city == "Paris"


def repaired_bad_call_with_max_retries(base_url: str) -> None:
    """{"city": 123} fails validation; Instructor's reask (the error as the tool's result)
    gets the model's second turn, which is right."""
    client = make_client(base_url)
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


def mid_stream_error_is_raised(base_url: str) -> None:
    """An error frame in a stream is raised (wrapped, like every API error, in Instructor's
    InstructorRetryException), not turned into a partial object."""
    client = make_client(base_url)

    def read() -> None:
        for _ in client.chat.completions.create_partial(
            model="sim-script",
            response_model=Weather,
            messages=ask(script(fail_midway('{"ci', "GPU fell over"))),
        ):
            pass

    exc = raised(read)
    assert isinstance(exc, InstructorRetryException)
    assert isinstance(exc.__cause__, openai.APIError)
    assert "GPU fell over" in str(exc.__cause__)


def unknown_model_is_404(base_url: str) -> None:
    """The SDK's NotFoundError, wrapped by Instructor."""
    client = make_client(base_url)
    exc = raised(
        lambda: client.chat.completions.create(
            model="no-such-model", response_model=Weather, messages=ask("hi")
        )
    )
    assert isinstance(exc, InstructorRetryException)
    assert isinstance(exc.__cause__, openai.NotFoundError)


CASES: dict[str, Callable[[str], None]] = {
    "tools_mode_with_usage": tools_mode_with_usage,
    "json_mode": json_mode,
    "streaming_partial_objects": streaming_partial_objects,
    "repaired_bad_call_with_max_retries": repaired_bad_call_with_max_retries,
    "mid_stream_error_is_raised": mid_stream_error_is_raised,
    "unknown_model_is_404": unknown_model_is_404,
}


if __name__ == "__main__":
    main(CASES)
