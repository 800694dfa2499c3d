"""The analysis tools' worker processes (tools/jobs.py): each job is one process, and its BLAS
runs on one thread, or the jobs' dot products wait for cores the other jobs hold."""
from __future__ import annotations

import sys

import pytest

from harness import clean_env, run

# Starts a pool in a fresh process (the fork server, which every worker comes from, is started
# once per process and keeps the environment it started with) and prints what a worker and the
# parent see.
SCRIPT = """
import os
from atb_probe.tools.jobs import worker_pool
with worker_pool(2) as pool:
    print("worker", pool.submit(os.getenv, "OPENBLAS_NUM_THREADS").result())
print("parent", os.getenv("OPENBLAS_NUM_THREADS"))
"""


@pytest.mark.parametrize("given, worker, parent", [(None, "1", "None"), ("3", "3", "3")])
def test_a_worker_runs_blas_on_one_thread_unless_the_user_said_otherwise(given, worker, parent):
    env = clean_env()
    env.pop("OPENBLAS_NUM_THREADS", None)
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    result = run([sys.executable, "-c", SCRIPT], env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == [f"worker {worker}", f"parent {parent}"]
