"""End to end: the tool_validation policy through a real edge to `iop-sim-node`.

The model (a sim-script) makes the slips agents repair: wrong-typed arguments
(`{"city": 123}` for `city: str`), a misspelt tool name. Under `report` (the
default unless the tools or the output are strict) the caller gets the call as
written with `finish_reason: "tool_calls"`, streamed (accumulated by the
openai SDK) and not, and the edge counts it on /metrics and logs it; under
`strict` it is a tool_validation_error; under `off` nothing is checked or
counted. Which mode applies follows the request, then the model's config.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from edge.config import ModelConfig
from tests.integration.conftest import (
    RunningEdge,
    SimProcess,
    chat_body,
    edge_config,
    start_edge,
    stop_edge,
)
from tests.integration.edgeproc import edge_process
from tests.integration.test_chat_e2e import parse_sse
from tests.integration.test_tools_e2e import (
    TOOLS,
    WEATHER,
    calls_of,
    check_streamed_calls,
    create,
    create_error,
    hermes,
    model_output,
    stream,
    stream_error,
    streamed_content,
)

CHAT = "/v1/chat/completions"
BAD_TYPE = hermes("get_weather", {"city": 123})
MISSPELT = hermes("get_wether", {"city": "Paris"})
METRIC = re.compile(
    r'^iop_edge_tool_call_violations_total\{model="(?P<model>[^"]*)",rule="(?P<rule>[^"]*)"\} '
    r"(?P<value>\S+)$",
    re.MULTILINE,
)


async def violations(url: str) -> dict[tuple[str, str], float]:
    """iop_edge_tool_call_violations_total by (model, rule), from /metrics."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        text = (await http.get("/metrics")).text
    return {(m["model"], m["rule"]): float(m["value"]) for m in METRIC.finditer(text)}


def extra(**fields: Any) -> dict[str, Any]:
    return {"extra_body": fields}


# --- report: the call as written -----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected", "rule"),
    [
        (BAD_TYPE, [("get_weather", {"city": 123})], "schema"),
        (MISSPELT, [("get_wether", {"city": "Paris"})], "unknown_tool"),
    ],
    ids=["wrong-type", "misspelt-name"],
)
async def test_report_is_the_default_streaming(
    edge: RunningEdge, text: str, expected: list[Any], rule: str
) -> None:
    """Streamed, by default: the bad call arrives whole in one tool_calls delta as the model
    wrote it, finish_reason tool_calls; it is counted on /metrics under its rule and kept on
    the run's outcome."""
    before = await violations(edge.url)
    chunks, final = await stream(edge, model_output("Let me check.\n" + text))
    check_streamed_calls(chunks, final, expected)
    assert streamed_content(chunks) == "Let me check."
    outcome = await edge.wait_outcome(chunks[0].id.removeprefix("chatcmpl-"))
    assert [v.rule for v in outcome.tool_violations] == [rule]
    after = await violations(edge.url)
    key = ("sim-script", rule)
    assert after[key] == before.get(key, 0) + 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [(BAD_TYPE, [("get_weather", {"city": 123})]), (MISSPELT, [("get_wether", {"city": "Paris"})])],
    ids=["wrong-type", "misspelt-name"],
)
async def test_report_is_the_default_non_streaming(
    edge: RunningEdge, text: str, expected: list[Any]
) -> None:
    """Not streamed, by default: a 200 with message.tool_calls as written."""
    completion = await create(edge, model_output(text))
    assert completion.choices[0].finish_reason == "tool_calls"
    message = completion.choices[0].message
    assert message.content is None
    assert calls_of(message.tool_calls) == expected
    assert all(c.id and c.type == "function" for c in message.tool_calls)


async def test_report_native_call(edge: RunningEdge) -> None:
    """A native call that breaks the schema is returned as the node reported it."""
    native = json.dumps([{"id": "n1", "function": {"name": "get_weather", "arguments": "{}"}}])
    chunks, final = await stream(edge, model_output("", tool_calls=native))
    check_streamed_calls(chunks, final, [("get_weather", {})])
    assert final.choices[0].message.tool_calls[0].id == "n1"


async def test_report_tool_choice_required_without_a_call(edge: RunningEdge) -> None:
    """tool_choice "required" and an answer without a call: the answer as written,
    finish_reason stop, the violation counted under tool_choice."""
    before = await violations(edge.url)
    completion = await create(edge, model_output("It is sunny."), tool_choice="required")
    assert completion.choices[0].message.content == "It is sunny."
    assert completion.choices[0].finish_reason == "stop"
    key = ("sim-script", "tool_choice")
    assert (await violations(edge.url))[key] == before.get(key, 0) + 1


async def test_report_still_refuses_unreadable_calls(edge: RunningEdge) -> None:
    """Markup that cannot be read is an error under report too: never dropped, never shown."""
    text = 'Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    error = await stream_error(edge, model_output(text))
    assert error.type == "tool_validation_error"
    status = await create_error(edge, model_output(text))
    assert status.status_code == 422


async def test_report_holds_strict_tools_to_their_schema(edge: RunningEdge) -> None:
    """A tool declared "strict": true is validated strictly even under report: 422."""
    strict_weather = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    error = await create_error(edge, model_output(BAD_TYPE), tools=[strict_weather])
    assert error.status_code == 422
    assert error.type == "tool_validation_error"
    # Its misspelt name is no call to the strict tool: reported, returned.
    completion = await create(edge, model_output(MISSPELT), tools=[strict_weather])
    assert calls_of(completion.choices[0].message.tool_calls) == [("get_wether", {"city": "Paris"})]


# --- strict and off, and who decides ---------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [extra(tool_validation="strict"), extra(strict_output=True)],
    ids=["tool_validation", "strict_output"],
)
async def test_the_request_asks_for_strict(edge: RunningEdge, kwargs: dict[str, Any]) -> None:
    """tool_validation "strict" (or strict output) in the request: the same call is a
    tool_validation_error, 422 not streamed; nothing is counted."""
    before = await violations(edge.url)
    error = await stream_error(edge, model_output(BAD_TYPE), **kwargs)
    assert error.type == "tool_validation_error"
    assert "'type'" in error.message
    status = await create_error(edge, model_output(BAD_TYPE), **kwargs)
    assert status.status_code == 422
    assert await violations(edge.url) == before


async def test_off_checks_and_counts_nothing(edge: RunningEdge) -> None:
    """tool_validation "off": the calls are returned, nothing is counted."""
    before = await violations(edge.url)
    completion = await create(
        edge, model_output(BAD_TYPE + "\n" + MISSPELT), **extra(tool_validation="off")
    )
    assert calls_of(completion.choices[0].message.tool_calls) == [
        ("get_weather", {"city": 123}),
        ("get_wether", {"city": "Paris"}),
    ]
    assert await violations(edge.url) == before


@pytest.fixture
async def strict_model_edge(nursery: trio.Nursery, sim: SimProcess) -> AsyncIterator[RunningEdge]:
    """sim-script configured with tool_validation = "strict"."""
    model = ModelConfig(reasoning_parser="think", tool_validation="strict")
    running = await start_edge(nursery, replace(edge_config(sim), models={"sim-script": model}))
    yield running
    await stop_edge(running)


async def test_model_config_then_the_request_decides(strict_model_edge: RunningEdge) -> None:
    """[models.NAME] tool_validation = "strict" makes the call an error; the request's own
    tool_validation wins over it."""
    error = await create_error(strict_model_edge, model_output(BAD_TYPE))
    assert error.status_code == 422
    completion = await create(
        strict_model_edge, model_output(BAD_TYPE), **extra(tool_validation="report")
    )
    assert calls_of(completion.choices[0].message.tool_calls) == [("get_weather", {"city": 123})]


@pytest.mark.parametrize("value", ["lenient", 1, ["strict"]])
async def test_a_bad_request_value_is_400(
    edge: RunningEdge, http: httpx.AsyncClient, value: Any
) -> None:
    """A bad tool_validation is a 400 invalid_request_error naming it, before any run."""
    body = chat_body("sim-script", model_output("hi"), tools=TOOLS, tool_validation=value)
    response = await http.post(CHAT, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "tool_validation")
    assert edge.outcomes == []


# --- the log line ------------------------------------------------------------------------


async def test_a_reported_violation_is_logged_without_argument_values(
    sim: SimProcess, tmp_path: Path
) -> None:
    """One JSON log line per reported violation: request id, run id, model, rule and tool;
    the arguments' values appear in no line."""
    secret = "Zanzibar-4711"
    text = hermes("get_weather", {"city": 123, "note": secret}) + "\n" + MISSPELT
    toml = f'[server]\nlisten = "127.0.0.1:0"\n[[nodes]]\nname = "sim"\naddress = "{sim.address}"\n'
    async with edge_process(tmp_path, toml, log_format="json") as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as http:
            body = chat_body("sim-script", model_output(text), tools=TOOLS, stream=True)
            response = await http.post(CHAT, json=body, headers={"X-Request-Id": "req-tv-1"})
            assert parse_sse(response.content)[-1] == "[DONE]"
            run_id = json.loads(parse_sse(response.content)[0])["id"].removeprefix("chatcmpl-")
            assert (await violations(edge.url)) == {
                ("sim-script", "schema"): 1.0,
                ("sim-script", "unknown_tool"): 1.0,
            }
        edge.signal(signal.SIGTERM)
        assert await edge.wait_exit() == 0
    records = edge.json_lines()
    lines = [r for r in records if r.get("rule")]
    assert [(r["rule"], r["tool"]) for r in lines] == [
        ("schema", "get_weather"),
        ("unknown_tool", "get_wether"),
    ]
    for record in lines:
        assert (record["request_id"], record["run_id"]) == ("req-tv-1", run_id)
        assert record["model"] == "sim-script"
        assert record["level"] == "WARNING"
    assert not any(secret in json.dumps(r) for r in records), "no argument value is logged"
