"""`make clients-js`: the JavaScript clients against a real edge and sim node.

Starts an `iop-sim-node` and an `iop-edge` in front of it (the Python suite's
helpers, `tests.clients.conftest`), runs `node --test` in `tests/clients/js`
with EDGE_BASE_URL set, stops both, and exits with node's exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.clients.conftest import start_edge_process, stop_edge_process
from tests.integration.conftest import start_sim, stop_process

JS_DIR = Path(__file__).parent / "js"


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="clients-js-") as tmp:
        sim = start_sim(Path(tmp), "sim", "--kv-tokens", "65536")  # cached prompts, counted
        try:
            edge = start_edge_process(Path(tmp), sim)
            try:
                env = {**os.environ, "EDGE_BASE_URL": edge.base_url}
                return subprocess.run(["node", "--test"], cwd=JS_DIR, env=env).returncode
            finally:
                stop_edge_process(edge)
        finally:
            stop_process(sim.process)


if __name__ == "__main__":
    sys.exit(main())
