"""What both sides of the node contract agree on besides the generated code: the Run
RPC's path, as the generated service code spells it, and the message size limit.

Read once from the generated `NodeServiceBase` mapping (by request type), so
no path is written by hand: a renamed package or method in `protos/` renames
it here. Both sides need the path itself, because both handle Run at the
stream level (see `edge.node.grpc` and `edge.nodes.kit`); CancelRun and
Describe go through the generated stub and base whole.
"""

from __future__ import annotations

from edge.contract._proto.iop.node import v1 as pb

RUN_ROUTE: str = next(
    path
    for path, handler in pb.NodeServiceBase().__mapping__().items()
    if handler.request_type is pb.RunRequest
)

# gRPC's default limit on a received message, at the edge and at every node. A node
# never needs more (it splits long text into deltas); a larger message is refused.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
