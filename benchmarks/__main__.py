"""Entry point of `python -m benchmarks` (and `make bench`); a SIGTERM or SIGINT stops
every process it started and removes its temporary directories (`benchmarks.cleanup`)."""

from __future__ import annotations

import sys

from benchmarks.cleanup import run_program
from benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(run_program(main, "benchmarks"))
