"""The Triton weight launchers as the CUDA kernels of the weight ops (kernels/triton/cuda_ops.py
`WEIGHT_KERNELS`): each adapter takes its op's schema arguments, and run on CPU tensors in
Triton's interpreter returns what the op's twin does: `w4a16_linear` and `fp8_block_linear`
within 1e-5 relative of the largest output (the same bf16 / e4m3 operands on both sides, fp32
sums in another order; bf16 outputs one bf16 rounding apart), `fused_moe` within 1e-5 for
every stored kind with fp32 activations. And the switch that makes them the CPU kernels for a
while (`interpreted_weight_kernels`)."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.kernels.triton_pools import DEVICE, NATIVE  # sets TRITON_INTERPRET=1 on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kernels.ops import OPS, has_device_kernel, twin_ops
from kernels.triton import cuda_ops
from kernels.triton.int4_layout import repack_int4_rows, repack_q4_blocks
from runtime.quant.fp8 import expand_block_rows, quantize_fp8_blockwise
from runtime.quant.int4 import pack_int4, quantize_int4_groupwise
from runtime.quant.linear import quantize_int4_packed
from tests.kernels.test_triton_cuda_ops import _schema_args

SCHEMAS = {op.name: op.schema for op in OPS}


def assert_rel_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    # bf16 outputs: one rounding apart (the interpreter truncates fp32 -> bf16)
    rel = 2**-7 if got.dtype == torch.bfloat16 else 1e-5
    err = (got.float() - want.float()).abs().max()
    assert err <= rel * want.float().abs().max(), f"max |err| {err:.3g}"


def test_every_weight_adapter_takes_its_ops_schema_arguments_and_is_the_cuda_kernel():
    assert set(cuda_ops.WEIGHT_KERNELS) == {"w4a16_linear", "fp8_block_linear", "fused_moe"}
    for name, fn in cuda_ops.WEIGHT_KERNELS.items():
        assert list(inspect.signature(fn).parameters) == _schema_args(SCHEMAS[name]), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tessera::{name}", "CUDA"), name


@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize("offsets", ["symmetric", "zeros", "m plane"])
def test_w4a16_adapter_matches_the_twin(rows, offsets):
    gen = torch.Generator().manual_seed(rows)
    n, k = 72, 320  # ragged N tail, a short last g128 group
    w = torch.randn(n, k, generator=gen)
    if offsets == "m plane":
        t = repack_q4_blocks(torch.randint(0, 256, (n, k // 2), generator=gen,
                                           dtype=torch.uint8),
                             torch.rand(n, k // 32, generator=gen).half() / 8,
                             -torch.rand(n, k // 32, generator=gen).half(), 32)
    else:
        p = quantize_int4_packed(w, 128, offsets == "symmetric")
        t = repack_int4_rows(p["weight_packed"], p["weight_scale"],
                             p.get("weight_zero_point"), k, 128)
    args = (t.qt, t.d, t.offset, t.offset_kind, t.group_size)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
        got = cuda_ops.w4a16_linear(x, *(a.to(DEVICE) if isinstance(a, torch.Tensor) else a
                                         for a in args))
        assert_rel_close(got.cpu(), twin_ops().w4a16_linear(x.cpu(), *args))


@pytest.mark.parametrize("scale_rows", [1, 128])
def test_fp8_block_adapter_matches_the_twin_on_ragged_shapes(scale_rows):
    gen = torch.Generator().manual_seed(scale_rows)
    n, k = 130, 200
    q, scale_inv = quantize_fp8_blockwise(torch.randn(n, k, generator=gen))
    scale = scale_inv if scale_rows == 128 else expand_block_rows(scale_inv, n, 128)
    w = q.view(torch.uint8)
    for rows in (1, 5):
        x = torch.randn(rows, k, generator=gen) * 3
        got = cuda_ops.fp8_block_linear(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE))
        assert_rel_close(got.cpu(), twin_ops().fp8_block_linear(x, w, scale))


def _experts(kind: str, gen: torch.Generator, e: int = 4, hidden: int = 64, inter: int = 32):
    """w13 [e, 2 inter, hidden] and w2 [e, hidden, inter] stored as `kind`."""
    dense = [torch.randn(e, 2 * inter, hidden, generator=gen) * hidden**-0.5,
             torch.randn(e, hidden, inter, generator=gen) * inter**-0.5]
    if kind == "float":
        return [(w, None, None) for w in dense]
    out = []
    for w in dense:
        rows = w.reshape(-1, w.shape[-1])
        if kind == "int4":
            codes, scale, zeros = quantize_int4_groupwise(rows, 32, symmetric=False)
            out.append((pack_int4(codes, torch.uint8).view(e, w.shape[1], -1),
                        scale.bfloat16().view(e, w.shape[1], -1),
                        zeros.view(e, w.shape[1], -1)))
        else:
            parts = [quantize_fp8_blockwise(m) for m in w]
            out.append((torch.stack([q for q, _ in parts]),
                        torch.stack([expand_block_rows(s, w.shape[1], 128) for _, s in parts]),
                        None))
    return out


@pytest.mark.parametrize("kind", ["float", "fp8-block", "int4"])
def test_fused_moe_adapter_matches_the_twin_with_an_idle_expert(kind):
    gen = torch.Generator().manual_seed(7)
    (w13, s13, z13), (w2, s2, z2) = _experts(kind, gen)
    x = torch.randn(6, 64, generator=gen)
    ids = torch.tensor([[0, 1], [1, 0], [2, 0], [0, 2], [1, 2], [2, 1]])  # expert 3: no row
    weights = torch.rand(6, 2, generator=gen)
    args = (w13, s13, z13, w2, s2, z2, weights, ids, kind, 32 if kind == "int4" else 0)
    moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in (x, *args)]
    got = cuda_ops.fused_moe(*moved)
    assert_rel_close(got.cpu(), twin_ops().fused_moe(x, *args))


@pytest.mark.skipif(NATIVE, reason="the switch is the interpreter's (CPU) kernels")
def test_the_interpreter_switch_makes_the_weight_adapters_the_cpu_kernels_for_a_while():
    cpu = torch.device("cpu")
    assert not has_device_kernel("w4a16_linear", cpu)
    with cuda_ops.interpreted_weight_kernels():
        assert all(has_device_kernel(name, cpu) for name in cuda_ops.WEIGHT_KERNELS)
        with pytest.raises(RuntimeError, match="already registered"), \
                cuda_ops.twin_weight_kernels():
            pass
    assert not any(has_device_kernel(name, cpu) for name in cuda_ops.WEIGHT_KERNELS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_adapter_runs_w8a8_block_fp8_experts_as_the_twin_does(dtype):
    """fp8_activations: both projections' inputs quantized per (row, 128 columns) by the
    activation quantizer; the twin rounds the same inputs (a code may flip where the SwiGLU
    activation, summed in another order, sits at a rounding tie: 1e-3 of the largest output;
    bf16: the interpreter truncates fp32 -> bf16 at each of the three stores, the activation,
    the weighted rows and the sum, 2**-5; fp32 on a GPU, whose fp8 tensor cores accumulate
    with fewer bits than fp32: 2e-2, measured 4.7e-3 on an H200). The flag is not ignored:
    W8A16 is further away."""
    gen = torch.Generator().manual_seed(11)
    (w13, s13, _), (w2, s2, _) = _experts("fp8-block", gen, e=4, hidden=192, inter=96)
    x = torch.randn(9, 192, generator=gen).to(dtype)
    ids = torch.randint(0, 3, (9, 2), generator=gen)  # expert 3: no row
    weights = torch.rand(9, 2, generator=gen)
    args = (w13, s13, None, w2, s2, None, weights, ids, "fp8-block", 0)
    moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in (x, *args)]
    got = cuda_ops.fused_moe(*moved, fp8_activations=True).cpu()
    want = twin_ops().fused_moe(x, *args, fp8_activations=True)
    w8a16 = twin_ops().fused_moe(x, *args)
    assert got.dtype == want.dtype == dtype
    rel = 2**-5 if dtype == torch.bfloat16 else 2e-2 if NATIVE else 1e-3
    bound = rel * float(want.float().abs().max())
    err = float((got.float() - want.float()).abs().max())
    assert err <= bound, f"max |err| {err:.3g} > {bound:.3g}"
    assert float((w8a16.float() - want.float()).abs().max()) > 2 * max(err, 1e-6)


def test_the_twin_refuses_w8a8_for_experts_that_are_not_block_fp8():
    gen = torch.Generator().manual_seed(12)
    (w13, s13, z13), (w2, s2, z2) = _experts("int4", gen)
    x, ids = torch.randn(2, 64, generator=gen), torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="fp8-block"):
        twin_ops().fused_moe(x, w13, s13, z13, w2, s2, z2, torch.rand(2, 2), ids, "int4", 32,
                             fp8_activations=True)
