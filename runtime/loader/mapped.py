"""A loading-optimised copy of a checkpoint's served tensors, mapped read-only and shared.

Made once per (source file, format, code version) from the GGUF or safetensors the user gave:
each tensor's bytes, exactly as a model serves them (GGUF blocks already imported, permuted
and fused), at a page-aligned offset, behind one JSON index, as ServerlessLLM's checkpoint
format and llama.cpp's aligned mmap do. Readers map the file `MAP_SHARED`, `PROT_READ` and take
tensors in place (`torch.frombuffer`): no copy, no dequantize, and every process on the host
shares one copy in the page cache. A write to one of these tensors faults (fail closed).

Layout: magic (8 bytes), index length (8 bytes little-endian), the index (JSON: key, tensors
{name: dtype, shape, offset, nbytes}, meta, total bytes), padding, then the tensors. The file
is written beside its key under a temporary name, fsynced and renamed into place, so a reader
sees the old file, the new file or none, never a torn one (replacing a mapped file in place
would SIGBUS its readers).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.errors import ModelLoadError

MAGIC = b"TSRMAP01"
# NOTE: bump when what a format writes changes (import, permutation, fusion): it is in the key.
CODE_VERSION = 1
PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Python 3.11's mmap lacks it
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
    torch.int64)}


def cache_dir() -> Path:
    """`$TESSERA_MAPPED_DIR`, else `$XDG_CACHE_HOME/tessera/mapped` (~/.cache by default)."""
    env = os.environ.get("TESSERA_MAPPED_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tessera" / "mapped"


def source_key(source: Path, fmt: str, st: os.stat_result | None = None) -> dict[str, Any]:
    """What the mapped file was made from: the source's real path, size and mtime (ns) (of
    `st`, the file actually read, else of what the path names), the format it serves and this
    code's version. A replaced source changes the key."""
    st = source.stat() if st is None else st
    return {"source": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "format": fmt, "version": CODE_VERSION}


def cache_path(key: dict[str, Any], folder: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return (cache_dir() if folder is None else folder) / f"{digest}.tsm"


def _align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def write_mapped(path: Path, key: dict[str, Any], tensors: Iterable[tuple[str, torch.Tensor]],
                 meta: dict[str, Any] | None = None) -> Path:
    """Write `tensors` (CPU, any of the dtypes above) to `path` under `key`, atomically
    (temporary file in the same folder, fsync, rename). Returns `path`."""
    items = [(name, t.detach().contiguous()) for name, t in tensors]
    index: dict[str, Any] = {"key": key, "meta": meta or {}, "tensors": {}}
    offset = 0
    for name, t in items:
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES or t.device.type != "cpu":
            raise ModelLoadError(f"cannot map tensor {name} of {t.dtype} on {t.device}",
                                 tensor=name)
        nbytes = t.numel() * t.element_size()
        index["tensors"][name] = {"dtype": dtype, "shape": list(t.shape), "offset": offset,
                                  "nbytes": nbytes}
        offset = _align(offset + nbytes)
    # the data offset depends on the index's length, which holds the total: fixed point in two
    body = json.dumps(index).encode()
    data_start = _align(16 + len(body) + 64)
    index["data_start"], index["total"] = data_start, data_start + offset
    body = json.dumps(index).encode()
    if 16 + len(body) > data_start:
        raise AssertionError("mapped index outgrew its padding")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(body)) + body)
            for name, t in items:
                f.seek(data_start + index["tensors"][name]["offset"])
                f.write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
            f.truncate(index["total"])
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # read by every worker of the host, written by none
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


@dataclass
class MappedWeights:
    """One mapped file: its index and the shared read-only mapping the tensors view."""

    path: Path
    index: dict[str, Any]
    mapping: mmap.mmap

    @classmethod
    def open(cls, path: Path, key: dict[str, Any] | None = None) -> MappedWeights:
        """Map `path`; with `key`, refuse a file made from anything else. Raises
        ModelLoadError for a missing, foreign, truncated or malformed file."""
        try:
            with open(path, "rb") as f:
                head = f.read(16)
                if len(head) != 16 or head[:8] != MAGIC:
                    raise ModelLoadError(f"{path} is not a tessera mapped-weights file",
                                         path=path)
                (length,) = struct.unpack("<Q", head[8:])
                index = json.loads(f.read(length))
                size = os.fstat(f.fileno()).st_size
                if size != index.get("total"):
                    raise ModelLoadError(f"{path} holds {size} bytes, its index says "
                                         f"{index.get('total')}", path=path)
                if key is not None and index.get("key") != key:
                    raise ModelLoadError(f"{path} was made from another source or version",
                                         path=path)
                mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError, struct.error) as e:
            raise ModelLoadError(f"cannot map {path}: {e}", path=path) from e
        return cls(path, index, mapping)

    @property
    def names(self) -> list[str]:
        return list(self.index["tensors"])

    @property
    def meta(self) -> dict[str, Any]:
        return self.index["meta"]

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name`, a read-only view of the mapping (no copy)."""
        entry = self.index["tensors"].get(name)
        if entry is None:
            raise ModelLoadError(f"{self.path} holds no tensor {name}", tensor=name)
        dtype = _DTYPES[entry["dtype"]]
        count = entry["nbytes"] // dtype.itemsize
        if count == 0:
            return torch.empty(entry["shape"], dtype=dtype)
        with warnings.catch_warnings():  # read-only by design: a write faults
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self.mapping, dtype=dtype, count=count,
                                    offset=self.index["data_start"] + entry["offset"])
        return flat.view(entry["shape"])

    def populate(self) -> None:
        """Map every page of the file into this process's page table now (MADV_POPULATE_READ,
        Linux 5.14+; a no-op where it is missing): a forked worker's first step then takes no
        page fault on the weights."""
        _populate_read(self.mapping)

    def prefault(self) -> None:
        """Ask the kernel to read the whole file into the page cache now (a template does
        this so that forked workers find every page resident)."""
        with contextlib.suppress(OSError, AttributeError):
            self.mapping.madvise(mmap.MADV_WILLNEED)


def _populate_read(mapping: mmap.mmap) -> None:
    with contextlib.suppress(OSError, ValueError):
        mapping.madvise(_MADV_POPULATE_READ)


def open_or_make(source: Path, fmt: str, make: Any, folder: Path | None = None,
                 stat: Callable[[], os.stat_result] | None = None) -> MappedWeights:
    """The mapped file for (`source`, `fmt`), made by `make() -> (tensors, meta)` and written
    first if no valid one exists (a stale or torn one is never used: it is remade). `stat`:
    the stat of the file `make` reads (an open checkpoint's), when the path may since name
    another; the key is its, so old weights never sit under a new file's key."""
    stat = stat or source.stat
    key = source_key(source, fmt, stat())
    path = cache_path(key, folder)
    if path.exists():
        try:
            return MappedWeights.open(path, key)
        except ModelLoadError:
            pass  # made by another version or damaged: remade below, atomically
    tensors, meta = make()
    if source_key(source, fmt, stat()) != key:  # written while it was read: it may mix
        raise ModelLoadError(f"{source} changed while it was converted; load it again",
                             path=source)
    write_mapped(path, key, tensors, meta)
    return MappedWeights.open(path, key)
