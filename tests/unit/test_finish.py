"""The finish-reason table: nodes' values in, only OpenAI's values (or "unfinished") out."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.stream.events import Complete, Delta, Usage
from edge.stream.finish import (
    FINISH_REASONS,
    MAX_NODE_REASON_CHARS,
    OPENAI_FINISH_REASONS,
    UNFINISHED,
    Finish,
    finish_of,
)
from edge.stream.output import ErrorOut, FinishOut
from edge.stream.session import SessionSettings, StreamSession
from edge.stream.toolcall import ToolPolicy, ToolSpec

# (what the node sent, what the caller gets; None = an error terminal instead of a finish)
TABLE: list[tuple[str | None, str | None]] = [
    (None, "stop"),
    ("", "stop"),
    ("  ", "stop"),
    ("stop", "stop"),
    ("length", "length"),
    ("tool_calls", "tool_calls"),
    ("content_filter", "content_filter"),
    ("function_call", "function_call"),
    ("STOP", "stop"),
    (" length\n", "length"),
    ("eos", "stop"),
    ("eos_token", "stop"),
    ("stop_sequence", "stop"),
    ("end_turn", "stop"),
    ("max_tokens", "length"),
    ("MAX_TOKENS", "length"),
    ("tool_use", "tool_calls"),
    ("SAFETY", "content_filter"),
    ("recitation", "content_filter"),
    ("abort", None),
    ("ABORT", None),
    ("aborted", None),
    ("cancelled", None),
    ("canceled", None),
    ("error", None),
    ("something_new", "stop"),
    ("load", "stop"),
    ("x" * 10_000, "stop"),
]


@pytest.mark.parametrize(("node", "expected"), TABLE)
def test_table(node: str | None, expected: str | None) -> None:
    """Each node value maps to its OpenAI value, an unfinished run (None), or else stop;
    the node's value is kept as sent (bounded)."""
    finish = finish_of(node)
    assert finish == Finish(expected, (node or "")[:MAX_NODE_REASON_CHARS])
    assert finish.unfinished == (expected is None)


def test_the_table_speaks_only_openai() -> None:
    """Every value the table gives is one of OpenAI's; its keys are lower case."""
    assert {v for v in FINISH_REASONS.values() if v is not None} <= OPENAI_FINISH_REASONS
    assert all(key == key.strip().lower() for key in FINISH_REASONS)
    assert {"abort", "cancelled", "error"} <= UNFINISHED


@given(st.text(max_size=20))
def test_any_value_gives_openai_or_unfinished(node: str) -> None:
    """Whatever a node sends, the caller gets one of OpenAI's values or an error terminal."""
    finish = finish_of(node)
    assert finish.reason is None or finish.reason in OPENAI_FINISH_REASONS
    assert finish.unfinished == (node.strip().lower() in UNFINISHED)


CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(("node", "expected"), TABLE)
@pytest.mark.parametrize("whole_output", [False, True])
@pytest.mark.parametrize("tools", [False, True])
def test_session_applies_the_table(
    node: str | None, expected: str | None, whole_output: bool, tools: bool
) -> None:
    """The session's terminal follows the table: a finish with the OpenAI value, or, for an
    unfinished run, one run_error terminal naming the node's value and no finish (with text
    and a tool call already in, which are not returned). The outcome keeps the node's value."""
    policy = ToolPolicy(tools=(ToolSpec("f"),)) if tools else ToolPolicy()
    settings = SessionSettings(run_id="r", tools=policy, whole_output=whole_output)
    session = StreamSession(settings)
    metadata = {} if node is None else {"finish_reason": node}
    session.feed(Delta("Hello"))
    session.feed(Complete(Usage(1, 2), metadata))
    out = session.drain()
    terminals = [e for e in out if isinstance(e, FinishOut | ErrorOut)]
    assert len(terminals) == 1
    assert terminals[0] is out[-1]
    outcome = session.outcome
    assert outcome is not None
    assert outcome.node_finish_reason == (node or "")[:MAX_NODE_REASON_CHARS]
    if expected is None:
        assert isinstance(out[-1], ErrorOut)
        assert out[-1].type == "run_error"
        assert f'finish_reason "{node}"' in out[-1].message
        assert (outcome.status, outcome.error_type) == ("error", "run_error")
    else:
        # A node's "tool_calls" without a call returned is "stop".
        sent = "stop" if expected == "tool_calls" else expected
        assert out[-1] == FinishOut(sent, Usage(1, 2))
        assert (outcome.status, outcome.finish_reason) == ("success", sent)


@pytest.mark.parametrize("node", ["stop", "length", "something_new", "tool_calls"])
def test_calls_make_tool_calls(node: str) -> None:
    """A completion that returns calls finishes with tool_calls whatever the node said
    (unless it said the run did not finish)."""
    settings = SessionSettings(run_id="r", tools=ToolPolicy(tools=(ToolSpec("f"),)))
    session = StreamSession(settings)
    session.feed(Delta(CALL))
    session.feed(Complete(metadata={"finish_reason": node}))
    assert session.drain()[-1] == FinishOut("tool_calls", None)


def test_unfinished_run_with_calls_returns_none() -> None:
    """An aborted run that had written a call returns no call: one run_error terminal."""
    settings = SessionSettings(run_id="r", tools=ToolPolicy(tools=(ToolSpec("f"),)))
    session = StreamSession(settings)
    session.feed(Delta("Sure. " + CALL))
    session.feed(Complete(metadata={"finish_reason": "abort"}))
    out = session.drain()
    assert [type(e).__name__ for e in out] == ["RoleOut", "ContentOut", "ErrorOut"]
    assert "<tool_call>" not in "".join(getattr(e, "text", "") for e in out)
