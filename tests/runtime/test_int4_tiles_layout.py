"""INT4 and block-FP8 layers on a device with the GPU weight kernels (runtime/quant/linear.py):
INT4 is held as the W4A16 tiles ("int4_tiles") and read back as the very checkpoint tensors,
block-FP8 runs `fp8_block_linear`, and a layer built elsewhere takes that layout in the
per-device prepare hook (runtime/quant/prepare.py). The device here is the CPU with the ops'
twins registered as its kernels (`twin_weight_kernels`), which is all the choice asks."""

from __future__ import annotations

import pytest
import torch

from kernels.triton.cuda_ops import twin_weight_kernels
from kernels.w4a16 import ref_w4a16_linear
from runtime.quant.fp8 import dequantize_fp8_row_blocks
from runtime.quant.linear import Fp8Linear, Int4Linear, quantize_int4_packed
from runtime.quant.prepare import prepare_weights


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_tiles_hold_the_checkpoint_tensors_bit_for_bit(symmetric):
    w = torch.randn(48, 160, generator=torch.Generator().manual_seed(0))  # short last g128 group
    packed = quantize_int4_packed(w, 128, symmetric)
    rows = Int4Linear.from_float(w, group_size=128, symmetric=symmetric, layout="rows")
    tiles = Int4Linear.from_float(w, group_size=128, symmetric=symmetric, layout="int4_tiles")
    assert tiles.weight_packed.shape == (80, 48)  # K-major codes
    for name, t in tiles.packed_tensors().items():
        assert torch.equal(t, packed[name]), name
    assert torch.equal(tiles.dequantize(), rows.dequantize())
    x = torch.randn(3, 160)
    want = ref_w4a16_linear(x, tiles.weight_packed, tiles.weight_scale,
                            tiles.weight_zero_point, 0 if symmetric else 1, 128)
    torch.testing.assert_close(tiles(x), want, atol=0, rtol=0)
    ref = rows(x)  # fp32 activations; the tiles read x rounded to bf16 (2**-9 relative)
    assert (tiles(x) - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_the_prepare_hook_gives_moved_layers_the_devices_layout_once():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    model = torch.nn.Sequential(Int4Linear.from_float(w, group_size=32),
                                Fp8Linear.from_float(w, block=(128, 128)))
    before = model[0].layout
    assert before != "int4_tiles" and not model[1].block_kernel
    x = torch.randn(2, 128)
    with twin_weight_kernels():  # the CPU now "has" the GPU weight kernels
        assert prepare_weights(model) == 2
        assert model[0].layout == "int4_tiles" and model[1].block_kernel
        codes = model[0].codes().clone()
        prepare_weights(model)  # already laid out: nothing changes
        assert torch.equal(model[0].codes(), codes)
        y = model[1](x)
    assert torch.equal(codes, Int4Linear.from_float(w, group_size=32).codes())
    # W8A8: x quantized per 128 columns, so not the W8A16 product of the same weights
    w8a16 = x @ dequantize_fp8_row_blocks(model[1].weight, model[1].weight_scale, 128).t()
    assert 0 < (y - w8a16).abs().max() < 0.1 * w8a16.abs().max()
