"""The Triton launchers as the CUDA implementations of the `tessera` ops they match.

Each adapter takes its op's arguments in schema order (`kernels/ops.py`) and returns what the
op's torch twin returns: `store_kv_rows` (one cache, in place), `paged_decode_attention`
(split-K by the batch's bucket), `paged_prefill_attention` (the causal-with-offset mask only,
which the kernel applies itself) and `verify_pages` (a cause per entry: each entry checked as a
one-page sequence); the weight ops `w4a16_linear` (INT4 tiles, split-K by shape),
`fp8_block_linear` (the activation quantizer, then the block-FP8 matmul) and `fused_moe` (two
grouped launches; W8A8 with the activation quantizer before each for block-FP8 experts).
Registered once, and only where triton is installed; triton itself is imported on the first
launch, never here.

`interpreted_weight_kernels()` registers the weight adapters as the CPU kernels for a while, so
the engine runs its Triton weight paths on CPU tensors in Triton's interpreter (tests, and
`ops/bench/gpu_check*.py` off a GPU); `twin_weight_kernels()` registers the twins the same way
(the same layouts and ops, the reference kernels).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch

from kernels.fp8_block import ref_fp8_block_linear
from kernels.moe import ref_fused_moe_op
from kernels.triton import launch, launch_gemm, launch_moe, triton_available
from kernels.triton.int4_layout import Int4Tiles
from kernels.w4a16 import ref_w4a16_linear, w4a16_activations

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


def w4a16_linear(x: torch.Tensor, qt: torch.Tensor, d: torch.Tensor,
                 offset: torch.Tensor | None, offset_kind: int, group_size: int) -> torch.Tensor:
    tiles = Int4Tiles(qt, d, offset, offset_kind, group_size)
    return launch_gemm.w4a16_linear(w4a16_activations(x.contiguous()), tiles, out_dtype=x.dtype)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor,
                     weight_scale: torch.Tensor) -> torch.Tensor:
    return launch_gemm.fp8_block_linear(x.contiguous(), weight, weight_scale, out_dtype=x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None,
              w13_zeros: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
              w2_zeros: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              kind: str = "float", group_size: int = 0,
              fp8_activations: bool = False) -> torch.Tensor:
    gate_up = launch_moe.ExpertWeights(w13, kind, w13_scale, w13_zeros, group_size)
    down = launch_moe.ExpertWeights(w2, kind, w2_scale, w2_zeros, group_size)
    return launch_moe.fused_moe(x.contiguous(), gate_up, down, topk_weights, topk_ids,
                                fp8_activations=fp8_activations)


# op name -> its adapter, in the op's schema order
CUDA_KERNELS: dict[str, Callable[..., object]] = {
    "store_kv_rows": store_kv_rows,
    "paged_decode_attention": paged_decode_attention,
    "paged_prefill_attention": paged_prefill_attention,
    "verify_pages": verify_pages,
}
# the weight ops (no CPU kernel of their own: the interpreter may stand in for one)
WEIGHT_KERNELS: dict[str, Callable[..., object]] = {
    "w4a16_linear": w4a16_linear,
    "fp8_block_linear": fp8_block_linear,
    "fused_moe": fused_moe,
}


def register_cuda_kernels(dispatch_key: str = "CUDA") -> list[str]:
    """Register every adapter of `CUDA_KERNELS` as `tessera::<op>`'s kernel for
    `dispatch_key`, once per key (later calls register nothing). Returns the op names
    registered by this call; none where triton is not installed. `kernels.ops` calls it for
    CUDA on import."""
    if not triton_available() or dispatch_key in _registered:
        return []
    kernels = {**CUDA_KERNELS, **WEIGHT_KERNELS}
    lib = torch.library.Library("tessera", "IMPL")
    for name, fn in kernels.items():
        lib.impl(name, fn, dispatch_key)
    _registered[dispatch_key] = lib
    return list(kernels)


@contextlib.contextmanager
def _cpu_weight_kernels(kernels: dict[str, Callable[..., object]]) -> Iterator[None]:
    if "CPU" in _registered:
        raise RuntimeError("CPU weight kernels are already registered (one switch at a time)")
    lib = torch.library.Library("tessera", "IMPL")
    for name, fn in kernels.items():
        lib.impl(name, fn, "CPU")
    _registered["CPU"] = lib
    try:
        yield
    finally:
        del _registered["CPU"]
        lib._destroy()


def interpreted_weight_kernels() -> contextlib.AbstractContextManager[None]:
    """Within it, the Triton weight adapters (`WEIGHT_KERNELS`) are the ops' CPU kernels, run
    in Triton's interpreter: `kernels.ops.has_device_kernel` then says yes on CPU, so modules
    built or prepared inside take their GPU layouts. Leaving it restores the twins (modules
    already laid out keep working: the twins read the same layouts). RuntimeError unless
    TRITON_INTERPRET=1 was set before triton was imported, or when a switch is already on."""
    if not triton_available() or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("the Triton weight kernels run on CPU only in Triton's interpreter: "
                           "set TRITON_INTERPRET=1 before triton is imported")
    return _cpu_weight_kernels(WEIGHT_KERNELS)


def twin_weight_kernels() -> contextlib.AbstractContextManager[None]:
    """`interpreted_weight_kernels` with the ops' torch twins as the CPU kernels: the same
    layouts and ops, the reference arithmetic."""
    return _cpu_weight_kernels({"w4a16_linear": ref_w4a16_linear,
                                "fp8_block_linear": ref_fp8_block_linear,
                                "fused_moe": ref_fused_moe_op})
