"""What both sides of the node contract agree on besides the generated code: the Run
and Watch RPCs' paths, as the generated service code spells them, and the message
size limit.

Read once from the generated `NodeServiceBase` mapping (by request type), so
no path is written by hand: a renamed package or method in `protos/` renames
it here. Both sides need the paths themselves, because both handle Run and
Watch at the stream level (see `edge.node.grpc` and `edge.nodes.kit`);
CancelRun and Describe go through the generated stub and base whole.
"""

from __future__ import annotations

from edge.contract._proto.iop.node import v1 as pb


def _route(request_type: type) -> str:
    return next(
        str(path)
        for path, handler in pb.NodeServiceBase().__mapping__().items()
        if handler.request_type is request_type
    )


RUN_ROUTE: str = _route(pb.RunRequest)
WATCH_ROUTE: str = _route(pb.WatchRequest)

# The Run call's initial metadata (the node's accept) names the life of the node's
# process that took the run: DescribeResponse.instance_id, under this key.
INSTANCE_METADATA = "iop-instance"

# gRPC's default limit on a received message, at the edge and at every node. A node
# never needs more (it splits long text into deltas); a larger message is refused.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
