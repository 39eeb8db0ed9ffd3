"""The process: how the edge runs as a daemon.

Owns the command's process model: `daemon` (one serving process: nodes, pool,
server, readiness, drain), `supervisor` (`--workers N`: worker processes on
shared sockets), `listeners` (binding, fd limits, the listen mode), `signals`
(stop and ignored signals, the hard stop) and `systemd` (sd_notify).

The top layer below the command line: it may import every layer of the edge
(`http`, `fleet`, `limits`, `nodes`, `node`, `config`, `observe`, ...); nothing
below imports it.
"""
