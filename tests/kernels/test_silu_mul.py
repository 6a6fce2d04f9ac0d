"""SwiGLU's activation (kernels/cpu/activation.cpp) against its torch twin: rows and widths
swept (odd widths, a part of the 16-lane vector), values from deep in the negative tail to
large positives; each element's result depends on its value alone, whatever the row count;
refusals typed and clear."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import ref_silu_mul, silu_mul
from kernels.cpu_ops import native

pytestmark = pytest.mark.skipif(native() is None, reason="no C++ toolchain: the twin runs alone")


def test_silu_mul_equals_its_twin_over_rows_widths_and_magnitudes():
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 2, 7, 33, 130):
        for n in (1, 15, 16, 577, 1536):
            scale = float(torch.rand((), generator=gen)) * 30 + 1e-3
            gate_up = torch.randn(rows, 2 * n, generator=gen) * scale
            ref = ref_silu_mul(gate_up)
            out = silu_mul(gate_up)
            assert out.shape == (rows, n)
            assert torch.allclose(out, ref, rtol=2e-6, atol=1e-30), (rows, n, scale)


def test_silu_mul_holds_at_the_ends_of_the_range():
    gate = torch.tensor([-200.0, -88.0, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 1e30])
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)]).unsqueeze(0)
    ref, out = ref_silu_mul(gate_up), silu_mul(gate_up)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref, rtol=2e-6, atol=1e-30)
    assert torch.isnan(silu_mul(torch.tensor([[float("nan"), 1.0]]))).all()


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    gen = torch.Generator().manual_seed(9)
    gate_up = torch.randn(64, 2 * 1536, generator=gen) * 4
    together = silu_mul(gate_up)
    for i in (0, 17, 63):
        assert torch.equal(silu_mul(gate_up[i : i + 1].contiguous())[0], together[i])


def test_silu_mul_refuses_an_odd_width_and_falls_back_off_float32():
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.tessera.silu_mul(torch.randn(2, 7))
    half = torch.randn(3, 64).bfloat16()
    assert torch.equal(silu_mul(half), ref_silu_mul(half))
