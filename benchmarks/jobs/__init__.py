"""The load-generator jobs, by name: what `benchmarks.loadgen.Pool` runs in its processes.

Each job module imports only `benchmarks.jobs.base`, `benchmarks.httpclient` and (the trio
jobs) the edge's node client; nothing here knows the orchestrator.
"""

from __future__ import annotations

from benchmarks.jobs.aio import AIO_JOBS
from benchmarks.jobs.base import JobFn
from benchmarks.jobs.direct import DIRECT_JOBS
from benchmarks.jobs.fleet import FLEET_JOBS
from benchmarks.jobs.overload import OVERLOAD_JOBS
from benchmarks.jobs.paced import PACED_JOBS

JOBS: dict[str, JobFn] = {**AIO_JOBS, **DIRECT_JOBS, **PACED_JOBS, **OVERLOAD_JOBS, **FLEET_JOBS}
