"""The error tree is the one map from an error type to its HTTP status, and the one
renderer of OpenAI's error object, before and after the first byte alike."""

from __future__ import annotations

import msgspec

from edge.api.render import error_frame
from edge.errors import (
    EdgeError,
    NodeFailedError,
    NodeTimeoutError,
    NodeUnavailableError,
    OutputValidationError,
    RequestError,
    ShuttingDownError,
    ToolValidationError,
    error_object,
    status_of,
)


def test_a_type_found_mid_run_has_the_status_of_its_class() -> None:
    """An error frame's type maps to the status a JSON answer of the same error carries."""
    for cls in (
        RequestError,
        NodeFailedError,
        NodeTimeoutError,
        NodeUnavailableError,
        OutputValidationError,
        ShuttingDownError,
        ToolValidationError,
    ):
        assert status_of(cls.type) == cls.status, cls
    assert status_of("internal_error") == 500
    assert status_of("a-type-no-class-has") == 502


def test_one_renderer_for_bodies_and_frames() -> None:
    """A JSON error body and an SSE error frame carry the same object."""
    error = NodeTimeoutError("timed out waiting for the first token")
    assert error.to_dict() == error_object("timeout", "timed out waiting for the first token")
    frame = error_frame(error.type, error.message)
    assert frame.startswith(b"data: ")
    assert frame.endswith(b"\n\n")
    assert msgspec.json.decode(frame[6:-2]) == error.to_dict()
    assert set(EdgeError("x", param="p", code="c").to_dict()["error"]) == {
        "message", "type", "param", "code",
    }  # fmt: skip
