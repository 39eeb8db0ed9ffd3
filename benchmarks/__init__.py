"""iop-edge benchmarks (`make bench`): the edge against its own baselines, in one run.

`python -m benchmarks [--quick] [--rounds N] [--litellm] ...` starts `iop-sim-node` and
`iop-edge` on 127.0.0.1, drives them from load-generator processes, prints a table and
writes `benchmarks/results/latest.json`. How to run it and the figures: BENCHMARKS.md;
the method: docs/benchmarks.md.
Benchmarks, not tests: nothing here asserts a duration.
"""
