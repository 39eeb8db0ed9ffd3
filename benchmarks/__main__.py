"""Entry point of `python -m benchmarks` (and `make bench`)."""

from __future__ import annotations

import sys

from benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main())
