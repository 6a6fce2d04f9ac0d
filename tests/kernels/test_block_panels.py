"""Panel-major block weights (kernels/block_panels.py): packed from the row-major planes and
back exactly, and their int8 kernel (`block_panels_linear_out`) bit for bit the row-major
planes' (`block_linear_out`) at every row count, for Q4_1, Q4_0 (m = -8 d) and Q8_0, one and
two limbs, at one thread and two; refusals typed and clear."""

from __future__ import annotations

import pytest
import torch

from kernels.block_linear import block_linear
from kernels.block_panels import (
    BlockPanels,
    block_panels_linear,
    pack_block_panels,
    panels_fit,
    ref_block_panels_linear,
    ref_unpack_block_panels,
)
from kernels.qgemv import pack_q4_blocks
from kernels.qgemv_i8 import int8_kernels_available

needs_kernels = pytest.mark.skipif(not int8_kernels_available(),
                                   reason="no AVX-512 VNNI here: only the twin runs")

ROWS = (1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 129)  # every tile height and its remainders
SHAPES = ((16, 32), (32, 96), (48, 544), (960, 576), (576, 1536))  # 1..48 blocks, 1..60 panels


def _planes(kind: str, n: int, k: int, gen: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    d = (torch.rand(n, k // 32, generator=gen) / 16 + 1e-3).half()
    if kind == "q8":
        return torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), d, None
    qs = pack_q4_blocks(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8))
    m = (-8.0 * d.float()).half() if kind == "q4_0" else (-torch.rand(n, k // 32, generator=gen)
                                                         / 4).half()
    return qs, d, m


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_panels_unpack_to_the_planes_they_were_packed_from(kind, shape):
    qs, d, m = _planes(kind, *shape, torch.Generator().manual_seed(1))
    panels = pack_block_panels(qs, d, m)
    assert (panels.out_features, panels.in_features) == shape
    back = ref_unpack_block_panels(panels.pw, panels.pd, panels.pm)
    assert torch.equal(back[0], qs) and torch.equal(back[1], d)
    assert (back[2] is None) if m is None else torch.equal(back[2], m)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("limbs", [1, 2])
@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8"])
def test_panel_kernel_gives_the_row_major_kernels_bits(kind, limbs, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(2)
        for n, k in SHAPES:
            qs, d, m = _planes(kind, n, k, gen)
            panels = pack_block_panels(qs, d, m)
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen) * 4
                x[0, :32] = 0.0  # an all-zero block: dx = 0
                want = block_linear(x, qs, d, m, None, 32, limbs)
                got = block_panels_linear(x, panels, limbs)
                assert torch.equal(got, want), (kind, n, k, rows)
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_panel_kernel_writes_every_output_and_matches_its_twin():
    gen = torch.Generator().manual_seed(3)
    qs, d, m = _planes("q4_1", 48, 544, gen)
    panels = pack_block_panels(qs, d, m)
    x = torch.randn(5, 544, generator=gen)
    out = torch.full((5, 48), float("nan"))
    torch.ops.tessera.block_panels_linear_out(x, panels.pw, panels.pd, panels.pm, 2, out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_block_panels_linear(x, panels.pw, panels.pd, panels.pm,
                                                            2), rtol=1e-4, atol=1e-4)


def test_packing_refuses_what_panels_cannot_hold():
    gen = torch.Generator().manual_seed(4)
    qs, d, m = _planes("q4_1", 24, 64, gen)
    assert not panels_fit(24) and panels_fit(32)
    with pytest.raises(ValueError, match="whole groups of 16 rows"):
        pack_block_panels(qs, d, m)
    qs, d, m = _planes("q4_1", 32, 64, gen)
    with pytest.raises(ValueError, match="offsets"):
        pack_block_panels(qs, d, None)
    with pytest.raises(ValueError, match="whole 32-weight blocks"):
        pack_block_panels(qs, d[:, :1].contiguous(), m)


@needs_kernels
def test_panel_kernel_refuses_bad_shapes_and_limbs():
    gen = torch.Generator().manual_seed(5)
    panels = pack_block_panels(*_planes("q4_1", 32, 64, gen))
    with pytest.raises(ValueError, match="1 or 2"):
        block_panels_linear(torch.randn(2, 64), panels, 0)
    with pytest.raises(RuntimeError, match="x must be"):
        block_panels_linear(torch.randn(2, 96), panels, 2)
    no_offsets = BlockPanels(panels.pw, panels.pd, None)
    with pytest.raises(RuntimeError, match="offsets"):
        torch.ops.tessera.block_panels_linear_out(torch.randn(2, 64), no_offsets.pw,
                                                  no_offsets.pd, None, 2, torch.empty(2, 32))
