"""The chaos suite: seeded, bounded chaos against real edge and node processes.

`make chaos` (`python -m tests.chaos`) runs it at full size; a small run of
the same suite is `tests/integration/test_chaos_small.py` in `make test`.
Modules: `plan` (scenarios from the seed), `procs` (the processes),
`client` (the raw HTTP client), `witness` (what every party recorded,
joined), `checks` (the invariants), `report` (options, summary), `suite`
(one run). The invariants are listed in docs/chaos.md, "Invariants".
"""
