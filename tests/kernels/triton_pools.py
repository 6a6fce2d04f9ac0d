"""Where the Triton kernel tests run, and paged KV pools for them: big enough that page
offsets pass 2**31 elements, on CPU in anonymous mappings so only the pages a test writes take
memory.

Importing this sets TRITON_INTERPRET=1 (import it before triton), unless
TESSERA_TRITON_NATIVE=1 (ops/bench/gpu_check.sh): then the same tests run natively on CUDA.
"""

from __future__ import annotations

import math
import mmap
import os
import sys

import torch

NATIVE = os.environ.get("TESSERA_TRITON_NATIVE") == "1"
if not NATIVE and os.environ.get("TRITON_INTERPRET") != "1":
    # NOTE: triton.language's own jit functions (tl.max, ...) take the mode at triton's import
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before the kernel tests could set "
                           "TRITON_INTERPRET=1: set it in the environment (or tests/conftest.py)")
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = torch.device("cuda" if NATIVE else "cpu")

INT32_LIMIT = 2**31
MIN_POOL_PAGES = 32768


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros on DEVICE; on CPU the OS commits their memory only where written (like
    runtime/kv/cache.py)."""
    if NATIVE:
        return torch.zeros(shape, dtype=dtype, device=DEVICE)
    count = math.prod(shape)
    buf = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


def pool_pages(kv_heads: int, page_size: int, dim: int) -> int:
    """Pages for a pool whose last pages lie past 2**31 elements (and >= 32k pages)."""
    per_page = kv_heads * page_size * dim
    return max(MIN_POOL_PAGES, -(-(INT32_LIMIT + 2**22) // per_page))


def draw_pages(num_pages: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """`count` distinct random pages, half from the pool's top 4096 (past the int32 limit in
    the last KV head), in random order: a non-contiguous table."""
    top = num_pages - 4096 + torch.randperm(4096, generator=gen)[: count // 2]
    rest = torch.randperm(num_pages - 4096, generator=gen)[: count - top.numel()]
    pages = torch.cat([top, rest])
    return pages[torch.randperm(count, generator=gen)]
