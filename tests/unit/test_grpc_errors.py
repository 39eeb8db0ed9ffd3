"""grpclib's and the OS's errors as the edge's: `edge.node.grpc.translate_error`."""

from __future__ import annotations

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from edge.errors import NodeFailedError, NodeTimeoutError, NodeUnavailableError
from edge.node.grpc import translate_error

ADDRESS = "127.0.0.1:1"


def test_a_stream_opened_on_a_connection_that_closed_is_the_nodes_failure_before_the_run() -> None:
    """grpclib's AttributeError opening a stream on a closed connection (grpclib#110) is
    node_unavailable and the run was not sent: failover may send it elsewhere."""
    exc = AttributeError("'Connection' object has no attribute '_transport'")
    error = translate_error(exc, accepted=False, address=ADDRESS, sent=False)
    assert isinstance(error, NodeUnavailableError)
    assert error.sent is False
    assert "closed the connection" in error.message


def test_refused_before_accept_is_unavailable_and_a_broken_stream_after_it_failed() -> None:
    """A connect error before the node accepted is node_unavailable; the same after it is a
    broken run (node_failed); a deadline is a timeout."""
    before = translate_error(ConnectionRefusedError(), accepted=False, address=ADDRESS, sent=False)
    after = translate_error(ConnectionResetError(), accepted=True, address=ADDRESS)
    late = translate_error(GRPCError(Status.DEADLINE_EXCEEDED), accepted=True, address=ADDRESS)
    assert isinstance(before, NodeUnavailableError)
    assert isinstance(after, NodeFailedError)
    assert not isinstance(after, NodeUnavailableError)
    assert after.sent is True
    assert isinstance(late, NodeTimeoutError)
