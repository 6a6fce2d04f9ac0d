"""The command line and environment a pool starts its workers with (`python -m gateway.worker`),
spawned or forked from its template."""

from __future__ import annotations

import os
import sys

from gateway.pool_config import PoolConfig
from runtime.platform import compute_cores
from runtime.threads import share_of_cores, thread_env

# The checkout holding runtime/ and gateway/: workers import from it whatever their cwd.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pinned_cores(config: PoolConfig) -> tuple[int, ...] | None:
    """The cores a worker of this pool pins its compute threads to (runtime/platform.py's
    `compute_cores`: a host with cores to spare, one worker), or None. Only where the pool
    chose no thread count: a configured one (several pools sharing a host, disaggregated
    serving) keeps the OS's placement."""
    if config.worker_threads is not None or not hasattr(os, "sched_getaffinity"):
        return None
    return compute_cores(sorted(os.sched_getaffinity(0)),
                         config.max_workers * config.tensor_parallel_size)


def threads_per_worker(config: PoolConfig) -> int:
    """CPU threads each worker computes on: the configured count, else one per pinned core,
    else this host's cores split evenly among the pool's most workers (a tensor-parallel
    worker splits them again between its ranks, gateway/tp_group.py)."""
    if config.worker_threads:
        return config.worker_threads
    pinned = pinned_cores(config)
    return len(pinned) if pinned is not None else share_of_cores(config.max_workers)


def worker_command(config: PoolConfig, worker_id: str, socket_path: str,
                   ready_socket: str | None) -> list[str]:
    """gateway.worker's command line for one worker of the pool; `ready_socket`: where it
    pushes its readiness (gateway/readiness.py)."""
    cmd = [sys.executable, "-m", "gateway.worker", "--socket", socket_path,
           "--worker-id", worker_id, "--served-model-name", config.model_id,
           "--max-num-seqs", str(config.max_inflight),
           "--worker-threads", str(threads_per_worker(config))]
    if (pinned := pinned_cores(config)) is not None:
        cmd += ["--compute-cores", ",".join(map(str, pinned))]
    if ready_socket is not None:
        cmd += ["--ready-socket", ready_socket]
    if config.kv_cache_bytes is not None:
        cmd += ["--kv-cache-bytes", str(config.kv_cache_bytes)]
    if config.model_path is not None:
        cmd += ["--model", config.model_path]
    if config.role != "both":
        cmd += ["--role", config.role]
    if config.tensor_parallel_size > 1:
        cmd += ["--tp", str(config.tensor_parallel_size)]
    return cmd + list(config.worker_args)


def worker_env(config: PoolConfig) -> dict[str, str]:
    """This process's environment, with the workers' thread settings, the pool's own variables
    and this checkout first on PYTHONPATH."""
    env = {**os.environ, **thread_env(threads_per_worker(config)), **dict(config.worker_env)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    return env
