"""The edge's signals: which ones stop it, which ones it ignores, and the hard stop's grace.

Shared by the single-process daemon and its workers (`edge.cli`) and the supervisor
(`edge.process.supervisor`), so neither imports the other for them. What each signal does is
told in `edge.cli`'s docstring.
"""

from __future__ import annotations

import signal

# After the drain deadline: time for the notices and the CancelRuns to go out.
HARD_STOP_GRACE_S = 15.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
IGNORED_SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
