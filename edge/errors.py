"""The edge's one error tree.

Every failure the edge reports to a caller is an `EdgeError`: it carries the
HTTP status, the OpenAI error `type`, and optionally `param` and `code`.
Library errors (grpclib, OS, JSON) are translated into this tree exactly once,
where they enter: `edge.node` for the node side, `edge.api` for requests.
`edge.http` renders these, and only these, into HTTP bodies and SSE frames.

The tree is also the one map from an error `type` to its HTTP status: an
error found after the first byte (an SSE error frame) and the same error
found before it (a JSON answer) name the same type, and `status_of(type)`
gives the status the non-streaming answer carries. `error_object` is the one
renderer of OpenAI's error object, for bodies and frames alike.
"""

from __future__ import annotations

from typing import Any, ClassVar


def error_object(
    error_type: str, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {message, type, param, code}}`."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class EdgeError(Exception):
    """Root of every error the edge reports to a caller."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error object: `{"error": {message, type, param, code}}`."""
        return error_object(self.type, self.message, param=self.param, code=self.code)


# --- the caller's mistakes (4xx): the caller should fix the request -----------


class RequestError(EdgeError):
    """The request is malformed or invalid."""

    status = 400
    type = "invalid_request_error"


class AuthenticationError(EdgeError):
    """A missing or wrong API key (OpenAI: invalid_request_error, code invalid_api_key)."""

    status = 401
    type = "invalid_request_error"


class NotFoundError(RequestError):
    """An unknown model or route."""

    status = 404


class MethodNotAllowedError(RequestError):
    status = 405


class PayloadTooLargeError(RequestError):
    status = 413


# --- the node side (5xx): the operator should act ------------------------------


class NodeError(EdgeError):
    """A node could not serve the run."""

    status = 502
    type = "node_error"
    # Whether the run's RunRequest was written to the node's connection first (False:
    # no process of the node saw the run; `edge.node` says so where it knows).
    sent = True


class NodeUnavailableError(NodeError):
    """No node could be reached for the model: retry later."""

    status = 503
    type = "node_unavailable"


class NodeTimeoutError(NodeError):
    """The node did not answer in time."""

    status = 504
    type = "timeout"


class NodeFailedError(NodeError):
    """The node answered with a failure, or its stream broke mid-run."""

    status = 502
    type = "run_error"


class OverloadedError(EdgeError):
    """Every node slot is taken and the wait for one is over (queue full, or too long):
    the caller should retry after `retry_after_s` (the Retry-After header)."""

    status = 503
    type = "overloaded"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, code="overloaded")
        self.retry_after_s = retry_after_s


class FlexUnavailableError(OverloadedError):
    """A flex request shed for want of capacity: 429 `rate_limit_exceeded` with
    Retry-After, as OpenAI answers flex processing when capacity is short."""

    status = 429
    type = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.code = "rate_limit_exceeded"


class NodeRateLimitedError(EdgeError):
    """Every node tried for the run was overloaded (its model server answered 429): the
    caller should retry after a moment (the Retry-After header)."""

    status = 429
    type = "rate_limit_exceeded"


class ShuttingDownError(EdgeError):
    """The edge is draining and takes no new requests."""

    status = 503
    type = "service_unavailable"


class StoreUnavailableError(EdgeError):
    """The response store could not be read (disk, Redis): retry, or send the items."""

    status = 503
    type = "service_unavailable"


class ToolValidationError(EdgeError):
    """The model produced a tool call that breaks the declared tools or tool_choice."""

    status = 422
    type = "tool_validation_error"


class OutputValidationError(EdgeError):
    """The model's output breaks the requested response_format (strict output)."""

    status = 422
    type = "output_validation_error"


def _statuses() -> dict[str, int]:
    """Each error type's HTTP status, read from the tree (the first class of a type wins)."""
    found: dict[str, int] = {}
    pending: list[type[EdgeError]] = [EdgeError]
    while pending:
        cls = pending.pop(0)
        found.setdefault(cls.type, cls.status)
        pending.extend(cls.__subclasses__())
    return found


def status_of(error_type: str) -> int:
    """The HTTP status of an error `type` found mid-run (502 for a type the tree lacks).

    Read from the tree on each call (classes defined in other modules count
    too); it runs once per failed non-streaming answer, never per event.
    """
    return _statuses().get(error_type, NodeError.status)
