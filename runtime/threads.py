"""The CPU threads an engine computes on: by default every core this process may run on.

torch's intra-op pool (OpenMP here) runs the matmuls, MKL and the native ops (`at::parallel_for`)
alike; the inter-op pool is set to one thread, since one engine step is one chain of ops and a
second pool would only spin beside the first. `release_openmp_pool` leaves one thread's pool the
only one a process runs (a worker's engine thread). `thread_env` gives a child process the same
settings before it imports torch (OpenMP and MKL read them at load time).
"""

from __future__ import annotations

import ctypes
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


def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime this process has loaded (torch's), None without one."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {parts[5].strip() for line in maps
                     if len(parts := line.split(maxsplit=5)) == 6 and "libgomp" in parts[5]}
    except OSError:  # no /proc: not Linux
        return None
    return ctypes.CDLL(sorted(paths)[0]) if paths else None


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP thread pool (its threads exit) and run this thread's
    later parallel regions on itself alone, so that the pool of the thread that goes on
    computing (an `AsyncLLM`'s engine thread) is the only one in the process.

    Why: GNU libgomp spins at a barrier only while the threads it manages are no more than the
    cores (libgomp/config/linux/wait.h, `do_spin`; past that it spins 100 times, then sleeps on a
    futex). A worker builds and warms its engine on the main thread (a pool of 2 threads on 2
    cores), then steps it on the engine thread with a second pool: every one of a step's ~300
    parallel regions then went through a futex, and one-sequence decode steps took 13.4 ms
    against 8.8 ms on the main thread (2-core EPYC; `ops/bench/RESULTS.md`, "OpenMP pools").
    Call it on the thread that stops computing, after it has. Never in a child forked while
    its parent's pool had threads (they do not exist in the child, and libgomp would wait for
    them): the template process forks with one thread (gateway/template_process.py).
    Returns False where nothing was done: no libgomp (another OpenMP runtime or none, which
    do not throttle this way), or one without `omp_pause_resource_all` (OpenMP 5.0, GCC 9)."""
    import torch  # noqa: F401  (loads torch's libgomp)

    lib = _libgomp()
    if lib is None or not hasattr(lib, "omp_pause_resource_all"):
        return False
    if lib.omp_pause_resource_all(1) != 0:  # omp_pause_soft; nonzero inside a parallel region
        return False
    lib.omp_set_num_threads(1)  # this thread's ICV only: other threads keep theirs
    return True
