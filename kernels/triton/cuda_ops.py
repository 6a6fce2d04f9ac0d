"""The Triton launchers as the CUDA implementations of the `tessera` ops they match.

Each adapter takes its op's arguments in schema order (`kernels/ops.py`) and returns what the
op's torch twin returns: `store_kv_rows` (one cache, in place), `paged_decode_attention`
(split-K by the batch's bucket), `paged_prefill_attention` (the causal-with-offset mask only,
which the kernel applies itself) and `verify_pages` (a cause per entry: each entry checked as a
one-page sequence). Registered once, and only where triton is installed; triton itself is
imported on the first launch, never here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.triton import launch, triton_available

_registered: dict[str, torch.library.Library] = {}  # dispatch key -> its library


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """`launch.decode_num_splits` for `batch` rounded up to its power-of-two bucket on
    `device` (one SM off CUDA), so the split count, and the grid, change only per bucket."""
    bucket = 1 << max(0, (batch - 1).bit_length())
    return launch.decode_num_splits(bucket, num_kv_heads, _num_sms(device))


def store_kv_rows(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                  scale: torch.Tensor | None, hadamard: bool = False,
                  shift: torch.Tensor | None = None, divisor: torch.Tensor | None = None) -> None:
    launch.store_rows(x, cache, slots, scale, hadamard, shift, divisor)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, hadamard: bool = False,
                           q_scale: torch.Tensor | None = None,
                           out_scale: torch.Tensor | None = None) -> torch.Tensor:
    splits = decode_splits(q.shape[0], k_cache.shape[0], q.device)
    return launch.paged_decode_attention(q, k_cache, v_cache, page_table.contiguous(),
                                         context_lens, scale, k_scale, v_scale, hadamard,
                                         q_scale, out_scale, num_splits=splits)


# the launcher takes the op's arguments as they are (the causal-with-offset mask only)
paged_prefill_attention = launch.paged_prefill_attention


def verify_pages(page_ids: torch.Tensor, expected_page_ids: torch.Tensor,
                 expected_tags: torch.Tensor, expected_owners: torch.Tensor,
                 pool_tags: torch.Tensor, pool_owners: torch.Tensor,
                 pool_refcounts: torch.Tensor) -> torch.Tensor:
    n = page_ids.shape[0]
    ones = torch.ones(n, dtype=torch.int32, device=page_ids.device)
    _, cause = launch.verify_pages(page_ids.view(n, 1), expected_page_ids.view(n, 1),
                                   expected_tags.view(n, 1), expected_owners.view(n, 1), ones,
                                   pool_tags, pool_owners, pool_refcounts, block=16)
    return cause.to(page_ids.dtype)


# op name -> its adapter, in the op's schema order
CUDA_KERNELS: dict[str, Callable[..., object]] = {
    "store_kv_rows": store_kv_rows,
    "paged_decode_attention": paged_decode_attention,
    "paged_prefill_attention": paged_prefill_attention,
    "verify_pages": verify_pages,
}


def register_cuda_kernels(dispatch_key: str = "CUDA") -> list[str]:
    """Register every adapter of `CUDA_KERNELS` as `tessera::<op>`'s kernel for
    `dispatch_key`, once per key (later calls register nothing). Returns the op names
    registered by this call; none where triton is not installed. `kernels.ops` calls it for
    CUDA on import."""
    if not triton_available() or dispatch_key in _registered:
        return []
    lib = torch.library.Library("tessera", "IMPL")
    for name, fn in CUDA_KERNELS.items():
        lib.impl(name, fn, dispatch_key)
    _registered[dispatch_key] = lib
    return list(CUDA_KERNELS)
