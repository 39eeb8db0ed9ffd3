"""Shared pytest configuration: hypothesis profiles.

`HYPOTHESIS_PROFILE=ci` is derandomized and runs more examples; `dev` (the
default) is quicker. Tests lower `max_examples` only when they are slow.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=200, derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
