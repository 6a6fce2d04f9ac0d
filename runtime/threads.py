"""The CPU threads an engine computes on: by default every core this process may run on.

torch's intra-op pool (OpenMP here) runs the matmuls, MKL and the native ops (`at::parallel_for`)
alike; the inter-op pool is set to one thread, since one engine step is one chain of ops and a
second pool would only spin beside the first. `thread_env` gives a child process the same
settings before it imports torch (OpenMP and MKL read them at load time).
"""

from __future__ import annotations

import os

from runtime.errors import InvalidArgument

# Pools that would otherwise size themselves to every core at load time.
_POOL_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, so a container's or taskset's limit
    counts), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def resolve_num_threads(num_threads: int | None) -> int:
    """`num_threads` as given, or every available core when None; refuses anything below 1."""
    if num_threads is None:
        return available_cores()
    if num_threads < 1:
        raise InvalidArgument(f"num_threads must be at least 1, got {num_threads}",
                              field="num_threads")
    return num_threads


def share_of_cores(num_workers: int, cores: int | None = None) -> int:
    """Threads for each of `num_workers` processes on one host: the cores split evenly, at
    least one each (more workers than cores then share them)."""
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, num_workers))


def thread_env(num_threads: int) -> dict[str, str]:
    """Environment for a child process that will compute on `num_threads` threads."""
    return {name: str(num_threads) for name in _POOL_ENV}


def apply_num_threads(num_threads: int | None) -> int:
    """Set torch's intra-op pool to `num_threads` and its inter-op pool to one thread; None
    leaves both as the process has them (a library user's engine does not reset its host's
    threads; the command line and the worker resolve None to every core first). Returns the
    intra-op thread count now in force."""
    import torch

    if num_threads is None:
        return torch.get_num_threads()
    torch.set_num_threads(resolve_num_threads(num_threads))
    if torch.get_num_interop_threads() != 1:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already started (set once per process): it stays as it is
            pass
    return torch.get_num_threads()
