"""A real worker computes on the threads its pool gives it: by default this host's cores split
among the pool's workers, with OpenMP and MKL sized the same before torch loads."""

from __future__ import annotations

import os

import pytest

from runtime.platform import compute_cores
from runtime.threads import available_cores, share_of_cores
from tests.gateway.conftest import MODEL, start_runner, worker_statuses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = (item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return {k.decode(): v.decode() for k, v in pairs}


def test_a_lone_worker_computes_on_every_core_it_may_use_by_default():
    # NOTE: every core on a small host; on one with cores to spare, those it is pinned to
    # (runtime/platform.py's compute_cores), the lowest left to the gateway
    pinned = compute_cores(sorted(os.sched_getaffinity(0)), num_workers=1)
    threads = available_cores() if pinned is None else len(pinned)
    runner = start_runner(min_workers=1, max_workers=1, worker_threads=None)
    try:
        [status] = worker_statuses(runner)
        assert status.num_threads == threads
        [worker] = runner.gateway.pools[MODEL].ready()
        env = _environ(worker.pid)
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            assert env[name] == str(threads), name
        if pinned is not None:
            assert os.sched_getaffinity(worker.pid) == set(pinned)
    finally:
        runner.stop()


def test_cores_are_split_among_a_pools_workers():
    assert share_of_cores(2, cores=16) == 8
    assert share_of_cores(3, cores=16) == 5
    assert share_of_cores(4, cores=2) == 1  # more workers than cores: one thread each
