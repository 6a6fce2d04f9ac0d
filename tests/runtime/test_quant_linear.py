"""Packed linear modules: forward equals F.linear over the dequantized weight, on every INT4 path
(the q4 block kernel, torch's CPU int4pack kernel, dequantize-then-matmul) and for FP8; only
packed data is resident; the checkpoint form does not depend on the in-memory layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_ops import native
from runtime.errors import InvalidArgument
from runtime.quant import (
    Fp8Linear,
    Int4Linear,
    dequantize_fp8_per_channel,
    dequantize_int4_groupwise,
    pack_int4,
    quantize_fp8_per_channel,
    quantize_int4_groupwise,
)

# The kernel path rounds activations and outputs to bf16 (relative error ~3e-3 measured).
KERNEL_REL_TOL = 1e-2
FP32_REL_TOL = 1e-5
SHAPES = [(960, 576), (576, 1536), (7, 100), (128, 96)]  # (out, in): kernel and odd/ragged ones


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Micro-sized matmuls: one thread is faster and quieter on a shared box."""


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).abs().max() / ref.abs().max())


def layouts_for(shape: tuple[int, int]) -> list[str | None]:
    """The default choice and every layout that can hold this shape."""
    out: list[str | None] = [None, "rows"]
    if shape[1] % 32 == 0 and native() is not None:
        out.append("q4_blocks")
    if shape[0] % 64 == 0 and shape[1] % 32 == 0:
        out.append("cpu_int4pack")
    return out


# Every INT4 path (each layout's kernel, each row-count regime, each group size, a short last
# group where 576 or 100 inputs make 4.5 or 0.8 groups) against the dequantized twin.
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_forward_equals_linear_over_dequantized_weight(shape, group_size, symmetric):
    gen = torch.Generator().manual_seed(hash((shape, group_size, symmetric)) % 2**31)
    w = torch.randn(shape, generator=gen) * 0.05
    bias = torch.randn(shape[0], generator=gen)
    base = Int4Linear.from_float(w, bias, group_size, symmetric, layout="rows")
    weight = base.dequantize()
    # Within a few steps even where the scale search clipped an outlier (runtime/quant/int4.py).
    assert (weight - w).abs().max() <= 4 * base.weight_scale.float().abs().max()
    for layout in layouts_for(shape):
        layer = Int4Linear.from_float(w, bias, group_size, symmetric, layout=layout)
        assert torch.equal(layer.dequantize(), weight), layer.layout
        for rows in (1, 5, 32, 33, Int4Linear.kernel_max_rows + 1):
            x = torch.randn(rows, shape[1], generator=gen)
            bf16 = layer.layout == "cpu_int4pack" and rows <= Int4Linear.kernel_max_rows
            y = layer(x)
            assert y.dtype == torch.float32 and y.shape == (rows, shape[0])
            err = rel_err(y, F.linear(x, weight, bias))
            assert err < (KERNEL_REL_TOL if bf16 else FP32_REL_TOL), (layer.layout, rows, err)


def test_int4_block_kernel_layout_is_the_default_where_the_cpu_ops_run():
    want = "q4_blocks" if native() is not None else "cpu_int4pack"
    assert Int4Linear.from_float(torch.randn(960, 576), group_size=128).layout == want
    assert Int4Linear.from_float(torch.randn(7, 100), group_size=32).layout == "rows"
    with pytest.raises(InvalidArgument, match="layout"):
        Int4Linear.from_float(torch.randn(7, 96), group_size=32, layout="tiles")


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_dequantize_matches_the_tensor_functions_when_groups_divide(symmetric):
    w = torch.randn(128, 256)
    codes, scale, zeros = quantize_int4_groupwise(w, 64, symmetric)
    layer = Int4Linear.from_float(w, group_size=64, symmetric=symmetric)
    ref = dequantize_int4_groupwise(codes, scale.to(torch.bfloat16), zeros)
    assert torch.equal(layer.dequantize(), ref)
    assert torch.equal(layer.packed_tensors()["weight_packed"], pack_int4(codes, torch.uint8))


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("layout", ["q4_blocks", "cpu_int4pack"])
def test_int4_checkpoint_form_does_not_depend_on_the_memory_layout(symmetric, layout):
    w = torch.randn(192, 576)
    kernel = Int4Linear.from_float(w, group_size=128, symmetric=symmetric, layout=layout)
    rows = Int4Linear.from_float(w, group_size=128, symmetric=symmetric, layout="rows")
    assert kernel.layout == layout != rows.layout
    a, b = kernel.packed_tensors(), rows.packed_tensors()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(kernel.dequantize(), rows.dequantize())


def test_int4_short_last_group_has_its_own_scale():
    w = torch.cat([torch.full((64, 512), 0.01), torch.full((64, 64), 3.0)], dim=1)  # 576 inputs
    layer = Int4Linear.from_float(w, group_size=128)
    assert layer.weight_scale.shape == (64, 5)
    assert torch.allclose(layer.dequantize(), w, rtol=1e-2)


def test_int4_keeps_only_packed_tensors_resident():
    layer = Int4Linear.from_float(torch.randn(576, 1536), group_size=128, symmetric=False)
    held = {name: t.dtype for name, t in layer.named_buffers()}
    assert held == {"weight_packed": torch.uint8, "weight_scale": torch.bfloat16,
                    "weight_zero_point": torch.uint8}
    assert layer.weight_packed.numel() == 576 * 1536 // 2


def test_int4_bfloat16_input_gives_bfloat16_output():
    layer = Int4Linear.from_float(torch.randn(128, 256), group_size=64)
    x = torch.randn(3, 256)
    y = layer(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert rel_err(y.float(), layer(x)) < KERNEL_REL_TOL


@pytest.mark.parametrize("shape", [(192, 64), (7, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp8_forward_equals_linear_over_dequantized_weight(shape):
    w = torch.randn(shape) * 0.1
    bias = torch.randn(shape[0])
    layer = Fp8Linear.from_float(w, bias)
    q, scale = quantize_fp8_per_channel(w)
    ref_weight = dequantize_fp8_per_channel(q, scale)
    assert torch.equal(layer.dequantize(), ref_weight)  # the compiled bit decode is exact
    assert {n: t.dtype for n, t in layer.named_buffers()} == {
        "weight": torch.float8_e4m3fn, "weight_scale": torch.float32}
    for rows in (1, 33):
        x = torch.randn(rows, shape[1])
        assert rel_err(layer(x), F.linear(x, ref_weight, bias)) < FP32_REL_TOL


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_short_last_group_is_searched_on_its_own_columns_only(symmetric):
    # 576 inputs at g128: the last group holds 64 columns. Its codes and scale are exactly what
    # quantizing those 64 columns as one full group gives (no padded column weighs in).
    w = torch.randn(96, 576, generator=torch.Generator().manual_seed(5)) * 0.05
    w[:, -1] *= 6  # an outlier in the last column, which the old padding counted 65 times
    packed = Int4Linear.from_float(w, group_size=128, symmetric=symmetric, layout="rows")
    codes, scale, zeros = quantize_int4_groupwise(w[:, 512:], 64, symmetric)
    assert torch.equal(packed.codes()[:, 512:], codes)
    assert torch.equal(packed.weight_scale[:, 4:].float(), scale.to(torch.bfloat16).float())
    if zeros is not None:
        assert torch.equal(packed.zeros()[:, 4:], zeros.to(torch.uint8))
