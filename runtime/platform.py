"""What differs between device kinds, decided once: one small class per kind (vLLM's
`platforms/`), and `platform_for(device)`, the one place that looks at a device's type.

A platform gives the compute dtype that `dtype="auto"` means, whether the engine sets torch's
compute threads and pins them to cores of their own (`compute_cores` decides when), how zeroed
KV storage is allocated, the torch.distributed backend and how a rank binds its device, whether
the host may read device values for free, how host inputs are copied in, and CUDA-graph
capture. Kernels are not here: they are picked by the `tessera` ops' dispatch (kernels/ops.py)
and by the attention backend (runtime/attention/). Importing this module does not import torch (the
gateway and the command line read `DEVICES` to validate flags).
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from runtime.errors import InvalidArgument

if TYPE_CHECKING:
    import torch


# Hosts with fewer cores share every core between the workers' compute threads and the serving
# processes (gateway, REST shim, a benchmark client): pinning there would idle the cores left
# to the serving side between tokens, and a 2-core host cannot spare one.
PIN_MIN_CORES = 8
SERVING_CORES = 2  # kept off a pinned worker's compute cores: the gateway, REST shim, clients


def compute_cores(cores: Sequence[int], num_workers: int, num_threads: int | None = None, *,
                  min_cores: int = PIN_MIN_CORES,
                  serving_cores: int = SERVING_CORES) -> tuple[int, ...] | None:
    """The cores one worker's compute threads are pinned to (one thread each), so that the
    gateway, the REST shim and clients on the same host never take a core from a step; None
    leaves placement to the OS.

    `cores`: the CPUs this process may run on; `num_workers`: the compute processes sharing
    them (a pool's workers times their tensor-parallel ranks); `num_threads`: the threads asked
    for, None for every core past the serving ones. Pins only where there are at least
    `min_cores` cores, one compute process (several would each need a core set of their own:
    not decided here yet) and room for `num_threads` beside `serving_cores`: then the highest
    `num_threads` cores, the lowest `serving_cores` left to the serving processes."""
    if len(cores) < min_cores or num_workers != 1:
        return None
    free = sorted(cores)[serving_cores:]
    n = len(free) if num_threads is None else num_threads
    if not 1 <= n <= len(free):
        return None
    return tuple(free[len(free) - n:])


class Platform:
    """One device kind. Stateless: `PLATFORMS` holds one instance per kind."""

    kind: ClassVar[str]
    default_dtype: ClassVar[str]  # the torch dtype name `dtype="auto"` resolves to
    distributed_backend: ClassVar[str]  # torch.distributed backend of tensor parallelism
    # reading a device value on the host (`int(t.max())`) costs no synchronisation, and no
    # CUDA graph must capture the code that does it
    host_reads_are_free: ClassVar[bool]

    def visible_devices(self) -> int | None:
        """How many devices of this kind a process may use, None where unbounded (host)."""
        return None

    def bind(self, device: str) -> None:
        """Make `device` ("cuda:1") this process's current device, where the kind has one (a
        NCCL communicator binds to it)."""

    def copy_from_host(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        """dst <- host (a CPU tensor), without waiting for the copy where the device can."""
        dst.copy_(host)

    def capture_graph(self, run: Callable[[], torch.Tensor], pool: object | None,
                      ) -> tuple[object, torch.Tensor, object] | None:
        """Record `run` as a replayable graph (after two warm-up calls on a side stream, so
        every kernel is compiled first); returns (graph, its output, its memory pool, to share
        with the next capture), or None where the kind has no graphs."""
        return None

    def compute_threads(self, num_threads: int | None) -> int:
        """Apply the engine's compute thread count where the device computes on host threads;
        returns the intra-op thread count now in force."""
        import torch

        return torch.get_num_threads()

    def pin_compute_threads(self, cores: Sequence[int]) -> None:
        """Run this process's threads (the compute pool's among them) on `cores` only, where
        the device computes on host threads (`compute_cores` says when)."""

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
        """Zeroed storage of `shape` (KV pages and their scales)."""
        import torch

        return torch.zeros(shape, dtype=dtype, device=device)


class CPUPlatform(Platform):
    kind = "cpu"
    default_dtype = "float32"  # bf16 matmuls are slower than fp32 on most CPUs
    distributed_backend = "gloo"
    host_reads_are_free = True

    def compute_threads(self, num_threads: int | None) -> int:
        from runtime.threads import apply_num_threads

        return apply_num_threads(num_threads)

    def pin_compute_threads(self, cores: Sequence[int]) -> None:
        # NOTE: every thread, not only the caller (sched_setaffinity(0) sets one thread's):
        # the compute pool's threads exist already, and threads started later inherit it.
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except ProcessLookupError:  # the thread ended meanwhile
                pass

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
        """Zeros in a private anonymous mapping, whose pages the OS commits only when first
        written, so an idle engine's resident memory grows with the KV it uses, not its pool.
        Private: a forked process gets its own copy on write, never a pool shared with its
        parent (a worker forked from a template process that built this engine)."""
        import torch

        nbytes = math.prod(shape) * dtype.itemsize
        # NOTE: the tensor keeps the mapping alive; it is unmapped when the tensor is freed.
        pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(pages, dtype=dtype,
                                count=math.prod(shape)).view(shape)


class CUDAPlatform(Platform):
    kind = "cuda"
    default_dtype = "bfloat16"
    distributed_backend = "nccl"
    host_reads_are_free = False

    def visible_devices(self) -> int | None:
        import torch

        return torch.cuda.device_count()

    def bind(self, device: str) -> None:
        import torch

        if ":" in device:
            torch.cuda.set_device(device)

    def copy_from_host(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        dst.copy_(host.pin_memory(), non_blocking=True)

    def capture_graph(self, run: Callable[[], torch.Tensor], pool: object | None,
                      ) -> tuple[object, torch.Tensor, object] | None:
        import torch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: every kernel compiled before capture
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = run()
        torch.cuda.synchronize()
        return graph, out, graph.pool()


PLATFORMS: dict[str, Platform] = {p.kind: p for p in (CPUPlatform(), CUDAPlatform())}
DEVICES = ("auto", *PLATFORMS)  # EngineConfig.device and --device


def resolve_device(name: str) -> str:
    """`name` itself (a kind, or a kind with an index: "cuda:1"), or for "auto" CUDA when
    torch sees a CUDA device, else CPU. InvalidArgument for a device kind with no platform, and
    for CUDA where torch sees none (before any weight is loaded)."""
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if platform_for(name).kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InvalidArgument(f"device {name!r}: torch sees no CUDA device here (torch "
                                  f"{torch.__version__}); use --device cpu or auto",
                                  field="device")
    return name


def platform_for(device: torch.device | str) -> Platform:
    """The platform of `device` ("cpu", "cuda:0", a torch.device); InvalidArgument for a kind
    with none (the meta device included: nothing is served there)."""
    kind = getattr(device, "type", None) or str(device).split(":", 1)[0]
    platform = PLATFORMS.get(kind)
    if platform is None:
        raise InvalidArgument(f"device must be one of {', '.join(DEVICES)}, got {str(device)!r}",
                              field="device")
    return platform
