"""The `tessera` torch ops: every kernel the engine calls, declared once, implemented per device.

Each op has a schema, a fake (meta) implementation, so that `torch.compile`, `torch.export`
and CUDA graphs trace through it without running it, and its torch twin (`ref_*`, the readable
reference) registered as the `CompositeExplicitAutograd` kernel: the implementation every
device runs until it registers its own. The CPU kernels are the C++ ops of `kernels/cpu/`,
registered under the `CPU` key by `kernels/cpu/ops.cpp` when `kernels.cpu_ops.native()` loads
them (a kernel registered for a device key wins over the composite twin there). Callers call
`torch.ops.tessera.<op>` or the typed wrapper in `kernels/<op>.py`; nobody branches on the
device. The schemas are device-neutral: tensors in their storage dtypes, no CPU-only argument.

Registering a device's kernel (as `kernels/triton/cuda_ops.py` does for CUDA)::

    lib = torch.library.Library("tessera", "IMPL")
    lib.impl("paged_decode_attention", triton_paged_decode_attention, "CUDA")

The function takes the op's arguments in schema order and returns (or writes) what the
twin does, within the op's stated tolerance; tests compare it with the twin on random inputs.
One op is declared in C++ instead: `llama_decode_step`, the fused decode step, whose first
argument is a C++ class that exists only where the CPU build does (`kernels/cpu/decode_llama.cpp`);
its fake is registered here when that build loads (`_register_native`), with
`paged_prefill_attention`'s CPU kernel, the twin over the C++ fp8 row gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kernels.activation import ref_silu_mul
from kernels.block_linear import ref_block_linear
from kernels.block_panels import ref_block_panels_linear
from kernels.cpu_ops import native, on_load
from kernels.fp8 import cpu_fp8_dequantize, ref_fp8_dequantize
from kernels.fp8_block import ref_fp8_block_linear
from kernels.int4pack import cpu_int4pack_mm, ref_int4pack_mm
from kernels.kv_fp8 import ref_gather_e4m3_rows
from kernels.moe import ref_fused_moe_op
from kernels.norm import ref_add_rms_norm
from kernels.paged_attention import (
    cpu_paged_prefill_attention,
    ref_paged_decode_attention,
    ref_paged_prefill_attention,
)
from kernels.qgemm_bf16 import ref_bf16_linear
from kernels.qgemv import ref_q4_dequantize, ref_q4_linear, ref_q8_dequantize, ref_q8_linear
from kernels.qgemv_i8 import ref_q4_linear_i8, ref_q8_linear_i8
from kernels.store_kv import ref_store_rows
from kernels.triton.cuda_ops import register_cuda_kernels
from kernels.verify_pages import ref_verify_pages
from kernels.w4a16 import ref_w4a16_linear

NAMESPACE = "tessera"


@dataclass(frozen=True)
class OpDecl:
    """One op: its schema (`name(args) -> returns`), its torch twin and its fake."""

    schema: str
    twin: Callable[..., object]
    fake: Callable[..., object]

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


def _rows_out(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


def _writes_out(fn: Callable[..., torch.Tensor]) -> Callable[..., None]:
    """An `_out` op's twin: the reference result written into `out` (the last argument)."""
    def twin(*args: object) -> None:
        out = args[-1]
        assert isinstance(out, torch.Tensor)
        out.copy_(fn(*args[:-1]).reshape(out.shape))
    return twin


def _nothing(*args: object) -> None:
    return None


def _attention_out(q: torch.Tensor, *args: object) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


_Q4 = "Tensor x, Tensor qs, Tensor d, Tensor? m, Tensor? zeros, int group_size"
_ATTN_TAIL = ("float scale, Tensor? k_scale=None, Tensor? v_scale=None, bool hadamard=False, "
              "Tensor? q_scale=None, Tensor? out_scale=None) -> Tensor")

OPS: tuple[OpDecl, ...] = (
    # KV pages: x [tokens, heads, dim] into cache [heads, pages, page_size, dim] at slots
    # (quantized pages: codes and a bf16 scale per (token, head); kernels/store_kv.py).
    OpDecl("store_kv_rows(Tensor x, Tensor(a!) cache, Tensor slots, Tensor(b!)? scale, "
           "bool hadamard=False, Tensor? shift=None, Tensor? divisor=None) -> ()",
           lambda x, cache, slots, scale, hadamard=False, shift=None, divisor=None:
           ref_store_rows(x, cache, scale, slots, hadamard, shift, divisor), _nothing),
    # Attention over pages: q [batch, heads, dim] (one token per sequence) -> [batch, heads*dim]
    OpDecl("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
           "Tensor context_lens, " + _ATTN_TAIL, ref_paged_decode_attention, _attention_out),
    # one sequence's chunk q [chunk, heads, dim] against its first context_len cached tokens
    OpDecl("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_ids, "
           "int context_len, Tensor? mask, " + _ATTN_TAIL, ref_paged_prefill_attention,
           _attention_out),
    # fp8 pages' rows decoded: flat [rows_total, n] uint8, rows [R] -> [R, n] float32
    OpDecl("gather_e4m3_rows(Tensor flat, Tensor rows) -> Tensor", ref_gather_e4m3_rows,
           lambda flat, rows: flat.new_empty(rows.shape[0], flat.shape[1],
                                             dtype=torch.float32)),
    OpDecl("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor",
           ref_add_rms_norm, lambda x, delta, weight, eps: torch.empty_like(x)),
    # SwiGLU: gate_up [T, 2 I] -> silu(gate) * up [T, I] (kernels/activation.py)
    OpDecl("silu_mul(Tensor gate_up) -> Tensor", ref_silu_mul,
           lambda gu: gu.new_empty(*gu.shape[:-1], gu.shape[-1] // 2)),
    # Block-quantized linears (layout: kernels/qgemv.py): x [M, K] float32 -> out [M, N]
    OpDecl(f"q4_linear_out({_Q4}, Tensor(a!) out) -> ()",
           _writes_out(lambda x, qs, d, m, zeros, g: ref_q4_linear(x, qs, d, m, g, zeros)),
           _nothing),
    OpDecl("q8_linear_out(Tensor x, Tensor qs, Tensor d, Tensor(a!) out) -> ()",
           _writes_out(ref_q8_linear), _nothing),
    OpDecl("q4_dequantize(Tensor qs, Tensor d, Tensor? m, Tensor? zeros, int group_size) "
           "-> Tensor",
           lambda qs, d, m, zeros, g: ref_q4_dequantize(qs, d, m, g, zeros),
           lambda qs, d, m, zeros, g: _rows_out(qs, qs.shape[1] * 2)),
    OpDecl("q8_dequantize(Tensor qs, Tensor d) -> Tensor", ref_q8_dequantize,
           lambda qs, d: _rows_out(qs, qs.shape[1])),
    # int8 activations in `limbs` limbs (kernels/qgemv_i8.py)
    OpDecl("q4_linear_i8_out(Tensor x, Tensor qs, Tensor d, Tensor m, Tensor(a!) out, "
           "int limbs=1) -> ()",
           lambda x, qs, d, m, out, limbs=1: out.copy_(ref_q4_linear_i8(x, qs, d, m, limbs)),
           _nothing),
    OpDecl("q8_linear_i8_out(Tensor x, Tensor qs, Tensor d, Tensor(a!) out, int limbs=1) -> ()",
           lambda x, qs, d, out, limbs=1: out.copy_(ref_q8_linear_i8(x, qs, d, limbs)),
           _nothing),
    # the block linear's one choice of kernel (kernels/block_linear.py)
    OpDecl(f"block_linear_out({_Q4}, int limbs, Tensor(a!) out) -> ()",
           _writes_out(ref_block_linear), _nothing),
    # the same over panel-major planes (kernels/block_panels.py): out [M, 16 P]
    OpDecl("block_panels_linear_out(Tensor x, Tensor pw, Tensor pd, Tensor? pm, int limbs, "
           "Tensor(a!) out) -> ()", _writes_out(ref_block_panels_linear), _nothing),
    # bf16 x over a bf16 copy of block weights, float32 sums (kernels/qgemm_bf16.py)
    OpDecl("bf16_linear_out(Tensor x, Tensor w, Tensor(a!) out) -> ()",
           _writes_out(ref_bf16_linear), _nothing),
    # FP8 e4m3 weights as their bytes, uint8 [out, in] -> float32 (kernels/fp8.py)
    OpDecl("fp8_dequantize(Tensor q, Tensor scale, Tensor? block_of_col) -> Tensor",
           ref_fp8_dequantize,
           lambda q, scale, cols: q.new_empty(q.shape, dtype=torch.float32)),
    # torch's CPU int4pack layout: x bf16 [M, K] -> bf16 [M, N] (kernels/int4pack.py)
    OpDecl("int4pack_mm(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros) "
           "-> Tensor", ref_int4pack_mm,
           lambda x, packed, g, sz: x.new_empty(x.shape[0], packed.shape[0])),
    # INT4 in the GPU tile layout (kernels/w4a16.py): x [M, K] -> [M, N] in x's dtype
    OpDecl("w4a16_linear(Tensor x, Tensor qt, Tensor d, Tensor? offset, int offset_kind, "
           "int group_size) -> Tensor", ref_w4a16_linear,
           lambda x, qt, d, offset, kind, g: x.new_empty(x.shape[0], qt.shape[1])),
    # block-FP8 W8A8 (kernels/fp8_block.py): x [M, K], e4m3 bytes [N, K] -> [M, N] in x's dtype
    OpDecl("fp8_block_linear(Tensor x, Tensor weight, Tensor weight_scale) -> Tensor",
           ref_fp8_block_linear, lambda x, w, s: x.new_empty(x.shape[0], w.shape[0])),
    # routed SwiGLU experts stored as `kind` (kernels/moe.py): x [T, hidden] -> [T, hidden];
    # fp8_activations: W8A8 over block-FP8 experts
    OpDecl("fused_moe(Tensor x, Tensor w13, Tensor? w13_scale, Tensor? w13_zeros, Tensor w2, "
           "Tensor? w2_scale, Tensor? w2_zeros, Tensor topk_weights, Tensor topk_ids, "
           "str kind=\"float\", int group_size=0, bool fp8_activations=False) -> Tensor",
           ref_fused_moe_op,
           lambda x, *rest: torch.empty_like(x)),
    # page integrity: a cause code per recorded (page, tag, owner) (kernels/verify_pages.py)
    OpDecl("verify_pages(Tensor page_ids, Tensor expected_page_ids, Tensor expected_tags, "
           "Tensor expected_owners, Tensor pool_tags, Tensor pool_owners, "
           "Tensor pool_refcounts) -> Tensor", ref_verify_pages,
           lambda page_ids, *rest: torch.empty_like(page_ids)),
)

_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
for _op in OPS:
    _LIB.define(_op.schema)
    _LIB.impl(_op.name, _op.twin, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{_op.name}", _op.fake, lib=_LIB)
# CPU kernels written in Python over torch's own CPU ops (no C++ build needed)
_LIB.impl("fp8_dequantize", cpu_fp8_dequantize, "CPU")
_LIB.impl("int4pack_mm", cpu_int4pack_mm, "CPU")


def _register_native() -> None:
    """Called once the C++ build is loaded: the fakes of the ops it declares itself, and the CPU
    kernels written in Python over its ops."""
    torch.library.register_fake(f"{NAMESPACE}::llama_decode_step",
                                lambda step, x, *rest: x, lib=_LIB)
    _LIB.impl("paged_prefill_attention", cpu_paged_prefill_attention, "CPU")


on_load(_register_native)


# The Triton kernels as CUDA's (kernels/triton/cuda_ops.py), where triton is installed; nothing
# imports triton until a CUDA tensor reaches one of them.
register_cuda_kernels()


def has_device_kernel(name: str, device: torch.device) -> bool:
    """Whether `tessera::<name>` has a kernel of its own for `device`'s kind (registered for
    its dispatch key, the CPU build loaded first), rather than the twin every device runs."""
    native()
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}",
                                                          device.type.upper())


def twin_ops() -> SimpleNamespace:
    """Every op's torch twin under the op's name, called as `torch.ops.tessera` is: the
    reference a device's kernels are tested against, and what tests put in its place to run a
    path on the twins alone."""
    return SimpleNamespace(**{op.name: op.twin for op in OPS})
