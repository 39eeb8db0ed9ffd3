"""Shared pytest configuration: hypothesis profiles, and `edge.node` imported first.

`HYPOTHESIS_PROFILE=ci` is derandomized and runs more examples; `dev` (the
default) is quicker. Tests lower `max_examples` only when they are slow.

The tests run grpclib on the edge's trio-asyncio bridge, which needs trio_asyncio
imported before grpclib (`edge.node` says why): this file is loaded before any test
module, one of which may import the contract's generated code or a node's server first.
The venvs of their own (tests/clients, Instructor and LlamaIndex) run their cases
without pytest and never load it.
"""

from __future__ import annotations

import os

from hypothesis import settings

import edge.node  # noqa: F401

settings.register_profile("ci", max_examples=200, derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
