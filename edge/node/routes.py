"""The Run RPC's path, as the generated service code spells it.

Read once from the generated `NodeServiceBase` mapping (by request type), so
no path is written by hand: a renamed package or method in `protos/` renames
it here. Both sides need the path itself, because both handle Run at the
stream level (see `edge.node.grpc` and `edge.nodekit`); CancelRun and
Describe go through the generated stub and base whole.
"""

from __future__ import annotations

from edge.node._proto.iop.node import v1 as pb

RUN_ROUTE: str = next(
    path
    for path, handler in pb.NodeServiceBase().__mapping__().items()
    if handler.request_type is pb.RunRequest
)
