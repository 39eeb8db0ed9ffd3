"""A node's refusal as each API shows it (`edge.api.surfaces`, the renderers), and the
contract's table of what an ended run's status says (`edge.stream.events.failure_class`).

Pure: output events in, status and bodies (or SSE frames) out.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from edge.api.request import ChatRequest
from edge.api.surfaces import CHAT, MESSAGES, RESPONSES, Api, ApiRequest, Heading
from edge.stream.events import failure_class
from edge.stream.output import ContentOut, ErrorOut, RoleOut

ANSWER = Heading("r1", 0, "m")
REQUEST = ApiRequest(ChatRequest(model="m", messages=()))
TOO_LONG = ErrorOut("invalid_request_error", "prompt too long", 400, "context_length_exceeded")


def _frames(raw: bytes) -> list[dict[str, Any]]:
    return [
        json.loads(line.removeprefix(b"data: "))
        for line in raw.split(b"\n")
        if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "refused"), (404, "refused"), (413, "refused"), (422, "refused"), (499, "refused"),
        (429, "overloaded"),
        (0, "failed"), (200, "failed"), (399, "failed"), (408, "failed"), (500, "failed"),
        (503, "failed"),
    ],
)  # fmt: skip
def test_the_contracts_table(status: int, kind: str) -> None:
    """4xx but 408 and 429 is a refusal, 429 an overload, anything else a node failure;
    a cancelled run is a failure whatever its status."""
    assert failure_class("error", status) == kind
    assert failure_class("cancelled", status) == "failed"


@pytest.mark.parametrize("api", [CHAT, RESPONSES])
@pytest.mark.parametrize(
    ("error", "code"),
    [
        (TOO_LONG, "context_length_exceeded"),
        (ErrorOut("invalid_request_error", "The model `x` does not exist", 404, None), None),
        (ErrorOut("rate_limit_exceeded", "busy", 429, None), None),
    ],
)
def test_openai_apis_answer_a_refusal_with_the_nodes_status_and_code(
    api: Api, error: ErrorOut, code: str | None
) -> None:
    """Chat completions and responses answer a refusal before any byte with the node's
    status and OpenAI's error object: its type, the node's words, param null, the node's
    code (or null)."""
    assert api.run_error(error) == (
        error.status,
        {"error": {"message": error.message, "type": error.type, "param": None, "code": code}},
    )


@pytest.mark.parametrize(
    ("error", "status", "kind", "message"),
    [
        (TOO_LONG, 400, "invalid_request_error", "prompt too long"),
        (ErrorOut("invalid_request_error", "no model", 404), 404, "not_found_error", "no model"),
        (ErrorOut("invalid_request_error", "big", 413), 413, "request_too_large", "big"),
        (ErrorOut("invalid_request_error", "bad", 422), 422, "invalid_request_error", "bad"),
        (ErrorOut("invalid_request_error", "odd", 409), 409, "invalid_request_error", "odd"),
        (ErrorOut("rate_limit_exceeded", "busy", 429), 429, "rate_limit_error",
         "rate_limit_exceeded: busy"),
        (ErrorOut("run_error", "boom"), 502, "api_error", "run_error: boom"),
    ],
)  # fmt: skip
def test_messages_answers_a_refusal_in_anthropics_shape(
    error: ErrorOut, status: int, kind: str, message: str
) -> None:
    """/v1/messages answers a refusal with the node's status and Anthropic's error types
    (not_found_error for 404, request_too_large for 413, invalid_request_error for other
    4xx) and the node's words; a node failure stays a 502 api_error."""
    assert MESSAGES.run_error(error) == (
        status,
        {"type": "error", "error": {"type": kind, "message": message}},
    )


def test_a_refusal_after_output_is_each_apis_error_frame() -> None:
    """After output, a refusal is the stream's error terminal in each API's shape, with
    the node's words and code: chat's error object (no [DONE]), responses'
    response.failed, messages' error event."""
    events = [RoleOut(), ContentOut("par"), TOO_LONG]
    chat = _frames(CHAT.streamer(REQUEST, ANSWER).encode(events))
    assert chat[-1] == {"error": {"message": "prompt too long", "type": "invalid_request_error",
                                  "param": None, "code": "context_length_exceeded"}}  # fmt: skip
    responses = _frames(RESPONSES.streamer(REQUEST, ANSWER).encode(events))
    assert responses[-1]["type"] == "response.failed"
    assert responses[-1]["response"]["error"] == {
        "code": "context_length_exceeded", "message": "prompt too long",
    }  # fmt: skip
    messages = _frames(MESSAGES.streamer(REQUEST, ANSWER).encode(events))
    assert messages[-1] == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "prompt too long"},
    }  # fmt: skip
