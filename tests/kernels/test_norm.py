"""Residual add + RMSNorm (kernels/cpu/norm.cpp) against its torch twin: rows and widths
swept (odd widths, a part of the 16-lane vector), with and without a residual delta, random
inputs at several magnitudes; the residual stream is updated in place exactly."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_ops import native
from kernels.norm import add_rms_norm, ref_add_rms_norm

pytestmark = pytest.mark.skipif(native() is None, reason="no C++ toolchain: the twin runs alone")


@pytest.mark.parametrize("with_delta", [True, False], ids=["add", "norm-only"])
def test_add_rms_norm_equals_its_twin_over_rows_and_widths(with_delta):
    gen = torch.Generator().manual_seed(11)
    for rows in (1, 2, 7, 33, 300):
        for n in (16, 64, 577, 576, 1000):
            scale = float(torch.rand((), generator=gen)) * 50 + 1e-3
            x = torch.randn(rows, n, generator=gen) * scale
            delta = torch.randn(rows, n, generator=gen) * scale if with_delta else None
            w = torch.randn(n, generator=gen)
            x_ref = x.clone()
            ref = ref_add_rms_norm(x_ref, delta, w, 1e-5)
            out = add_rms_norm(x, delta, w, 1e-5)
            assert torch.equal(x, x_ref)  # the residual add is the same float32 add
            assert torch.allclose(out, ref, rtol=2e-6, atol=2e-6 * float(ref.abs().max()))


def test_add_rms_norm_refuses_mismatched_shapes():
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="delta"):
        add_rms_norm(x, torch.randn(3, 32), torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        add_rms_norm(x, None, torch.ones(32), 1e-6)
