"""The tool_validation policy: each mode against each rule, checks and sessions.

`strict` ends the answer at the first violation, `report` returns readable
calls as written and reports what they break, `off` checks nothing against
the declared tools; a call that cannot be read is an error in every mode,
and a schema violation of a tool declared `"strict": true` is one in report
mode too. Sessions are fed the same answers as native calls and as text,
streamed (drained per event) and held whole (non-streaming).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from edge.stream.events import Complete, Delta
from edge.stream.output import ContentOut, ErrorOut, FinishOut, OutEvent, ToolCallsOut
from edge.stream.session import SessionSettings, StreamSession
from edge.stream.toolcall import (
    TOOL_VALIDATION_MODES,
    VIOLATION_RULES,
    ToolCall,
    ToolChoice,
    ToolPolicy,
    ToolSpec,
    ToolValidation,
    Violation,
)
from edge.stream.toolcheck import check_tool_calls, tool_validation_mode, validate_tool_calls

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
WEATHER = ToolSpec("get_weather", parameters=WEATHER_SCHEMA)
TIME = ToolSpec("get_time")
STRICT_WEATHER = replace(WEATHER, strict=True)
TOOLS = (WEATHER, TIME)


def call(name: str, arguments: str = "{}", n: int = 0) -> ToolCall:
    return ToolCall(id=f"call_r_{n}", name=name, arguments=arguments)


def policy(mode: ToolValidation, **kwargs: Any) -> ToolPolicy:
    return ToolPolicy(**{"tools": TOOLS, **kwargs}, validation=mode)


# (case, calls, policy fields, the rules broken in order)
CASES: list[tuple[str, list[ToolCall], dict[str, Any], list[str]]] = [
    ("unknown_tool", [call("get_wether", '{"city":"Paris"}')], {}, ["unknown_tool"]),
    ("schema-type", [call("get_weather", '{"city":123}')], {}, ["schema"]),
    ("schema-required", [call("get_weather", "{}")], {}, ["schema"]),
    ("schema-not-object", [call("get_weather", "[1,2]")], {}, ["schema"]),
    (
        "tool_choice-none",
        [call("get_weather", '{"city":"Paris"}')],
        {"choice": ToolChoice("none")},
        ["tool_choice"],
    ),
    ("tool_choice-required", [], {"choice": ToolChoice("required")}, ["tool_choice"]),
    (
        "tool_choice-named",
        [call("get_weather", '{"city":"Paris"}')],
        {"choice": ToolChoice("function", "get_time")},
        ["tool_choice"],
    ),
    (
        "parallel_tool_calls",
        [call("get_time"), call("get_time", n=1)],
        {"parallel_tool_calls": False},
        ["parallel_tool_calls"],
    ),
    (
        "several",
        [call("nope"), call("get_weather", '{"city":1}', n=1)],
        {"parallel_tool_calls": False},
        ["parallel_tool_calls", "unknown_tool", "schema"],
    ),
]
CASE_IDS = [c[0] for c in CASES]


def test_the_closed_sets() -> None:
    """The modes and the rules (the metric's label values) are small closed sets."""
    assert TOOL_VALIDATION_MODES == ("strict", "report", "off")
    assert VIOLATION_RULES == ("unknown_tool", "schema", "tool_choice", "parallel_tool_calls")


@pytest.mark.parametrize(("case", "calls", "fields", "rules"), CASES, ids=CASE_IDS)
def test_strict_ends_at_the_first_violation(
    case: str, calls: list[ToolCall], fields: dict[str, Any], rules: list[str]
) -> None:
    """strict: the first violation is the error, with today's message; nothing reported."""
    check = check_tool_calls(calls, policy("strict", **fields))
    assert check.error is not None
    assert check.error == validate_tool_calls(calls, policy("report", **fields))
    assert check.violations == ()


@pytest.mark.parametrize(("case", "calls", "fields", "rules"), CASES, ids=CASE_IDS)
def test_report_returns_and_reports_every_violation(
    case: str, calls: list[ToolCall], fields: dict[str, Any], rules: list[str]
) -> None:
    """report: no error; every rule broken is reported, in order, naming the tool; the
    first message is strict's error."""
    check = check_tool_calls(calls, policy("report", **fields))
    assert check.error is None
    assert [v.rule for v in check.violations] == rules
    assert check.violations[0].message == validate_tool_calls(calls, policy("strict", **fields))
    for violation in check.violations:
        assert violation.tool in {c.name for c in calls} | {"get_time", ""}


@pytest.mark.parametrize(("case", "calls", "fields", "rules"), CASES, ids=CASE_IDS)
def test_off_checks_nothing(
    case: str, calls: list[ToolCall], fields: dict[str, Any], rules: list[str]
) -> None:
    """off: no error, nothing reported."""
    assert check_tool_calls(calls, policy("off", **fields)) == check_tool_calls([], policy("off"))
    assert check_tool_calls(calls, policy("off", **fields)).error is None
    assert check_tool_calls(calls, policy("off", **fields)).violations == ()


@pytest.mark.parametrize("mode", TOOL_VALIDATION_MODES)
@pytest.mark.parametrize("name", ["get_weather", "get_wether"])
def test_unreadable_arguments_are_an_error_in_every_mode(mode: ToolValidation, name: str) -> None:
    """Arguments that are not JSON (a native call's raw string) cannot be read: an error in
    every mode, for a declared tool or not."""
    check = check_tool_calls([call(name, '{"city": ')], policy(mode))
    assert check.error is not None
    # strict ends at the first violation: an undeclared name comes before the arguments.
    first = "no declared tool" if (mode, name) == ("strict", "get_wether") else "not valid JSON"
    assert first in check.error


def test_report_holds_a_strict_tool_to_its_schema() -> None:
    """report: a schema violation of a tool declared strict ends the answer; the same tool's
    other rules, and the other tools, are reported."""
    strict_tools = ToolPolicy(tools=(STRICT_WEATHER, TIME), validation="report")
    bad = check_tool_calls([call("get_weather", '{"city":1}')], strict_tools)
    assert bad.error is not None
    assert "'type'" in bad.error
    named = replace(strict_tools, choice=ToolChoice("function", "get_time"))
    ok = check_tool_calls([call("get_weather", '{"city":"Paris"}')], named)
    assert (ok.error, [v.rule for v in ok.violations]) == (None, ["tool_choice"])
    off = replace(strict_tools, validation="off")
    assert check_tool_calls([call("get_weather", '{"city":1}')], off).error is None


def test_report_asked_by_the_request_covers_strict_tools() -> None:
    """A request that chose report itself gets it for a tool declared strict too: the
    call is returned, its schema violation reported."""
    chosen = ToolPolicy(tools=(STRICT_WEATHER, TIME), validation="report", strict_tools=False)
    check = check_tool_calls([call("get_weather", '{"city":1}')], chosen)
    assert check.error is None
    assert [(v.rule, v.tool) for v in check.violations] == [("schema", "get_weather")]


# --- which mode a request gets ---------------------------------------------------------

PRECEDENCE: list[tuple[str | None, str | None, bool | None, bool, str]] = [
    # (request tool_validation, model tool_validation, request strict_output, model strict)
    (None, None, None, False, "report"),
    (None, None, None, True, "strict"),
    (None, None, True, False, "strict"),
    (None, None, False, True, "report"),
    (None, "off", None, False, "off"),
    (None, "report", None, True, "report"),
    (None, "report", True, False, "strict"),
    (None, "off", False, True, "off"),
    ("report", None, True, True, "report"),
    ("off", "strict", None, False, "off"),
    ("strict", "off", False, False, "strict"),
]


@pytest.mark.parametrize(
    ("request_mode", "model_mode", "strict_output", "model_strict", "want"), PRECEDENCE
)
def test_precedence(
    request_mode: Any, model_mode: Any, strict_output: bool | None, model_strict: bool, want: str
) -> None:
    """The request decides first (tool_validation, then strict_output: true), then the
    model (tool_validation, then strict = true unless the request turned it off); else
    report."""
    assert (
        tool_validation_mode(
            request_mode,
            model_mode,
            request_strict_output=strict_output,
            model_strict=model_strict,
        )
        == want
    )


# --- sessions: native and text calls, streamed and held whole ---------------------------


def hermes(c: ToolCall) -> str:
    return f'<tool_call>{{"name": "{c.name}", "arguments": {c.arguments}}}</tool_call>'


def run_session(
    calls: list[ToolCall], tool_policy: ToolPolicy, *, native: bool, whole: bool
) -> tuple[list[OutEvent], StreamSession]:
    settings = SessionSettings(run_id="r", tools=tool_policy, whole_output=whole)
    session = StreamSession(settings)
    out = session.drain()
    if native:
        events: list[Any] = [Delta("Checking."), Complete(tool_calls=tuple(calls))]
    else:
        text = "Checking.\n" + "\n".join(hermes(c) for c in calls)
        events = [*map(Delta, text), Complete()]  # one character per delta
    for event in events:
        session.feed(event)
        if not whole:
            out += session.drain()
    return out + session.drain(), session


def shown(out: list[OutEvent]) -> str:
    return "".join(e.text for e in out if isinstance(e, ContentOut))


@pytest.mark.parametrize("whole", [False, True], ids=["stream", "whole"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "text"])
@pytest.mark.parametrize("mode", TOOL_VALIDATION_MODES)
@pytest.mark.parametrize(("case", "calls", "fields", "rules"), CASES, ids=CASE_IDS)
def test_session_modes(
    case: str,
    calls: list[ToolCall],
    fields: dict[str, Any],
    rules: list[str],
    mode: ToolValidation,
    native: bool,
    whole: bool,
) -> None:
    """strict: a tool_validation_error terminal, no call; report and off: the calls as the
    model wrote them and finish_reason tool_calls (stop when there was no call), the
    violations on the outcome in report mode only; never markup in content."""
    out, session = run_session(calls, policy(mode, **fields), native=native, whole=whole)
    outcome = session.outcome
    assert outcome is not None
    terminal = out[-1]
    assert "<tool_call>" not in shown(out)
    if mode == "strict":
        assert isinstance(terminal, ErrorOut)
        assert terminal.type == "tool_validation_error"
        assert not any(isinstance(e, ToolCallsOut) for e in out)
        assert outcome.tool_violations == ()
        return
    returned = [e.calls for e in out if isinstance(e, ToolCallsOut)]
    if calls:
        assert returned == [tuple(calls)]
        assert terminal == FinishOut("tool_calls", None)
    else:
        assert returned == []
        assert terminal == FinishOut("stop", None)
    assert shown(out).strip() == "Checking."
    assert outcome.status == "success"
    expected = rules if mode == "report" else []
    assert [v.rule for v in outcome.tool_violations] == expected
    assert all(isinstance(v, Violation) for v in outcome.tool_violations)


@pytest.mark.parametrize("whole", [False, True], ids=["stream", "whole"])
@pytest.mark.parametrize("mode", TOOL_VALIDATION_MODES)
def test_session_unreadable_text_call_is_an_error_in_every_mode(
    mode: ToolValidation, whole: bool
) -> None:
    """Markup that cannot be read is a tool_validation_error in every mode: never dropped,
    never shown as content."""
    settings = SessionSettings(run_id="r", tools=policy(mode), whole_output=whole)
    session = StreamSession(settings)
    session.feed(Delta('Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": '))
    session.feed(Complete())
    out = session.drain()
    assert isinstance(out[-1], ErrorOut)
    assert out[-1].type == "tool_validation_error"
    assert "<tool_call>" not in shown(out)
