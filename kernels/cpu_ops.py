"""The C++ CPU ops (`kernels/cpu/*.cpp`), built once per machine with torch's cpp_extension.

They are the CPU path's kernels (the GPU's are Triton, in `kernels/triton/`): paged attention
read straight from pages in their storage format, the fp8 quantize-and-store, and the e4m3
row gather that prefill uses. Each has a torch twin (`ref_*`) that is its test oracle and the
fallback where no C++ compiler exists. Built with `-march=native` for the machine it runs on
(on x86-64) and OpenMP, so `at::parallel_for` uses torch's threads; the build is named
after the CPU's feature flags, the torch it builds against and the sources' contents.
`TESSERA_NATIVE=0` turns them off. `python -m kernels` builds them ahead of time
(`ops/install.sh` does).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tessera.kernels")

_SOURCES = ("ops.cpp", "paged_decode.cpp", "store_kv.cpp", "e4m3_gather.cpp", "qgemv.cpp",
            "qgemv_i8.cpp", "norm.cpp", "activation.cpp", "decode_llama.cpp")


_ROOT = Path(__file__).parent / "cpu"


def build_tag() -> str:
    """Names the build after the CPU's features, the torch installation and the op sources: a
    cached `-march=native` build from another machine (a shared home directory) would die with
    an illegal instruction here, two checkouts with different sources must not load each
    other's, and two virtual environments with the same sources must not share one build
    folder (each one's build files name its own torch headers, so they rebuilt it in turn:
    a minute a start, and a library rewritten under a process loading it)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    digest = hashlib.sha256(f"{platform.machine()} {flags} {torch.__version__} "
                            f"{Path(torch.__file__).resolve().parent}".encode())
    for path in sorted(_ROOT.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _arch_flags() -> list[str]:
    return ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else []


@functools.cache
def native() -> Any | None:
    """`torch.ops.tessera` once the C++ build is loaded (its kernels then serve CPU tensors), or
    None (turned off, or no toolchain: the ops run their torch twins)."""
    if os.environ.get("TESSERA_NATIVE") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = f"tessera_cpu_ops_{build_tag()}"
        build_dir = Path(_get_build_directory(name, verbose=False))
        with build_lock(build_dir):
            sources = stage_sources(build_dir)
            load(name, [str(sources / s) for s in _SOURCES],
                 extra_cflags=["-O3", *_arch_flags(), "-fopenmp"],
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # no C++ toolchain here: stay correct on the slower path
        log.warning("C++ CPU ops unavailable (%s); using the torch twins", e)
        return None
    for hook in _ON_LOAD:
        hook()
    return torch.ops.tessera


# Run once the build is loaded: kernels.ops registers the fakes of the ops the build declares
# and the CPU kernels written over them (a hook: kernels.ops imports the modules that import
# this one).
_ON_LOAD: list[Callable[[], None]] = []


def on_load(hook: Callable[[], None]) -> None:
    """Run `hook` once the C++ build is loaded (now, if it already is)."""
    _ON_LOAD.append(hook)
    if native.cache_info().currsize and native() is not None:
        hook()


@functools.cache
def native_ops() -> Any:
    """`torch.ops.tessera`, with the C++ CPU kernels registered where they can be built: what
    every wrapper in `kernels/` calls (the op picks the kernel for its tensors' device)."""
    native()
    return torch.ops.tessera


def stage_sources(build_dir: Path) -> Path:
    """Copies the op sources into the build directory and returns where they are. The build is
    named after the sources' contents, so two checkouts with the same sources share it; compiled
    from their own paths they would rewrite each other's `build.ninja` and rebuild in turn."""
    staged = build_dir / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for path in sorted(_ROOT.iterdir()):
        if path.suffix not in (".cpp", ".h"):
            continue
        target = staged / path.name
        data = path.read_bytes()
        if not target.is_file() or target.read_bytes() != data:
            tmp = target.with_suffix(target.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
    return staged


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Holds an exclusive `flock` on the build directory while building or loading. The kernel
    drops it when its holder dies, so whoever holds it knows that torch's own build lock, if one
    is there, belongs to a builder that died mid-build: it is removed at once, where torch would
    wait for it forever (and every worker started after it)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock here: fall back to judging torch's lock by its age
        clear_stale_lock(build_dir)
        yield
        return
    with open(build_dir / "tessera.flock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            clear_stale_lock(build_dir, max_age_s=0.0)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# Without flock, a build takes about a minute on 2 cores; a lock this old was left by a process
# killed mid-build.
STALE_LOCK_S = 600.0


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove torch's build lock if it is at least `max_age_s` old (left by a process that died
    mid-build: torch's cpp_extension would wait on it forever). Whether one was removed."""
    lock = build_dir / "lock"
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age_s < max_age_s:
        return False
    log.warning("removing a stale build lock (%.0f s old): %s", age_s, lock)
    lock.unlink(missing_ok=True)
    return True


def build_pending() -> bool:
    """Whether the first `native()` call will compile (no build of these sources for this CPU
    yet): a minute or so on 2 cores, worth showing progress for."""
    if os.environ.get("TESSERA_NATIVE") == "0" or native.cache_info().currsize:
        return False
    from torch.utils.cpp_extension import _get_build_directory

    name = f"tessera_cpu_ops_{build_tag()}"
    return not (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").is_file()


def native_status() -> str:
    """`loaded`, `off` (TESSERA_NATIVE=0) or `unavailable` (no toolchain: torch twins run)."""
    if os.environ.get("TESSERA_NATIVE") == "0":
        return "off"
    return "loaded" if native() is not None else "unavailable"
