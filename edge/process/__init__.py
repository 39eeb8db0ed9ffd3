"""The process: how the edge runs as a daemon.

Owns the command's process model: `daemon` (one serving process: nodes, pool,
server, readiness, drain; it builds the fleet, the limiter and the app, and
wires them), `nodeset` (the node connections, opened and closed as `[[nodes]]`
changes), `discovery` (the nodes of `[[nodes]]` entries found by DNS, looked up again
and again) over `resolver` (the DNS look-ups, dnspython's on trio), `reload` (SIGHUP:
the configuration read, checked and applied while the edge serves), `supervisor`
(`--workers N`: worker processes on shared sockets, and the environment it gives them,
read back once here), `workers` (one worker
slot: its process started, watched and restarted), `listeners` (binding,
fd limits, the listen mode), `signals` (what each signal does, in one process
and in a worker; the drain, then the hard stop) and `systemd` (sd_notify).

The top layer below the command line: it may import every layer of the edge
(`http`, `fleet`, `limits`, `nodes`, `node`, `config`, `observe`, ...); nothing
below imports it.
"""
