"""Weight formats as tensor functions: round trips within stated bounds, exact packing, and
clear errors naming the tensor (FP8 KV: tests/kernels/test_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from runtime.errors import InvalidArgument
from runtime.quant import (
    dequantize_fp8_per_channel,
    dequantize_int4_groupwise,
    pack_int4,
    quantize_fp8_per_channel,
    quantize_int4_groupwise,
    unpack_int4,
)


def weights(out_dim=96, in_dim=256, seed=0):
    return torch.randn(out_dim, in_dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_round_trip_error_is_within_half_a_step_inside_the_chosen_range(group_size,
                                                                            symmetric):
    w = weights()
    codes, scale, zeros = quantize_int4_groupwise(w, group_size, symmetric)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert (zeros is None) == symmetric
    back = dequantize_int4_groupwise(codes, scale, zeros)
    err = (back - w).abs().reshape(w.shape[0], -1, group_size)
    step = scale.abs()[..., None]
    offset = 8.0 if zeros is None else zeros.float()[..., None]
    lo, hi = (0 - offset) * scale[..., None], (15 - offset) * scale[..., None]
    wg = w.reshape_as(err)
    inside = (wg >= torch.minimum(lo, hi)) & (wg <= torch.maximum(lo, hi))
    assert bool((err[inside] <= (step * 0.5 + 1e-6).expand_as(err)[inside]).all())
    assert float(inside.float().mean()) > 0.9  # clipping touches only the tails
    assert float(err.mean()) < float(step.mean()) * 0.3


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_scale_search_never_loses_to_plain_round_to_nearest(symmetric):
    w = weights(64, 256, seed=3) * torch.linspace(0.1, 3.0, 256)  # uneven columns
    codes, scale, zeros = quantize_int4_groupwise(w, 128, symmetric)
    searched = (dequantize_int4_groupwise(codes, scale, zeros) - w).square()
    g = w.reshape(64, 2, 128)
    if symmetric:
        s = (g.abs().amax(-1) / 7).to(torch.bfloat16).float()
        rtn = ((g / s[..., None]).round().clamp(-8, 7) * s[..., None]).reshape_as(w)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).to(torch.bfloat16).float()
        z = (-lo / s).round().clamp(0, 15)
        rtn = (((g / s[..., None]).round() + z[..., None]).clamp(0, 15) - z[..., None]) \
            * s[..., None]
        rtn = rtn.reshape_as(w)
    plain = (rtn - w).square()
    per_group = searched.reshape(64, 2, 128).sum(-1) <= plain.reshape(64, 2, 128).sum(-1) + 1e-9
    assert bool(per_group.all())
    assert float(searched.mean()) < 0.95 * float(plain.mean())


def test_int4_asymmetric_beats_symmetric_on_one_sided_weights():
    w = weights().abs()
    sym = dequantize_int4_groupwise(*quantize_int4_groupwise(w, 64, True))
    asym = dequantize_int4_groupwise(*quantize_int4_groupwise(w, 64, False))
    assert (asym - w).pow(2).mean() < (sym - w).pow(2).mean()


@pytest.mark.parametrize("container", [torch.int32, torch.uint8])
def test_int4_packing_round_trips_exactly(container):
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = pack_int4(codes, container)
    assert packed.dtype == container
    assert packed.shape == (7, 64 // (8 if container is torch.int32 else 2))
    assert torch.equal(unpack_int4(packed), codes)


def test_int4_bytes_are_under_a_third_of_bf16_with_g128_scales():
    w = weights(576, 1536)
    codes, scale, _ = quantize_int4_groupwise(w, 128)
    packed = pack_int4(codes)
    int4_bytes = packed.numel() * 4 + scale.numel() * 2  # bf16 scales, as runtime/formats.py
    assert int4_bytes <= 0.32 * w.numel() * 2


def test_group_size_that_does_not_divide_names_the_tensor():
    with pytest.raises(InvalidArgument, match=r"model\.layers\.3\.mlp\.down_proj\.weight"):
        quantize_int4_groupwise(weights(8, 96), 64, name="model.layers.3.mlp.down_proj.weight")
    with pytest.raises(InvalidArgument, match="group size"):
        quantize_int4_groupwise(weights(8, 96), 48)


def test_fp8_per_channel_round_trip_is_within_e4m3_precision():
    w = weights()
    q, scale = quantize_fp8_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0],)
    back = dequantize_fp8_per_channel(q, scale)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for normal values
    assert bool(((back - w).abs() <= w.abs() * 2**-4 + scale[:, None] * 2**-6).all())
