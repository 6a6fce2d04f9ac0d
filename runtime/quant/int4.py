"""INT4 weight-only, group-wise along the input dimension (group size 32/64/128).

Symmetric: q = round(w / s) in [-8, 7]. Asymmetric: q = round(w / s) + z in [0, 15], z a 4-bit
zero point. Codes are stored as unsigned nibbles (symmetric codes offset by 8) packed 8 per
int32 or 2 per uint8, low nibble first.

Scales are chosen per group by a small search, not by amax alone: for symmetric groups,
s = r * amax / 7 or s = r * m / -8 (m the signed value of largest magnitude, so all 16 codes
are used, as llama.cpp's Q4_0 does; s may be negative); for asymmetric, the range [min, max]
shrunk by r; r from CLIP_RATIOS. The candidate with the least squared error wins (scales
rounded to bf16, as stored, before they are judged). Clipping a few outliers buys a finer step
for the rest of the group; the search never does worse than plain round-to-nearest on any
group (tested), though on SmolLM2-135M int4-g128 stays lossy
(ops/bench/RESULTS.md#weight-format-quality).
"""

from __future__ import annotations

import torch

from runtime.errors import InvalidArgument
from runtime.formats import INT4_GROUP_SIZES


def quantize_int4_groupwise(w: torch.Tensor, group_size: int = 128, symmetric: bool = True,
                            name: str = "weight"
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w: [out, in] -> (codes uint8 [out, in] in 0..15, scales [out, in/g], zeros or None)."""
    if group_size not in INT4_GROUP_SIZES:
        raise InvalidArgument(f"group size must be one of {INT4_GROUP_SIZES}, got {group_size}",
                              field="group_size")
    if w.dim() != 2 or w.shape[1] % group_size:
        raise InvalidArgument(f"group size {group_size} does not divide the input dimension "
                              f"of tensor {name} {tuple(w.shape)}", tensor=name)
    out_dim, in_dim = w.shape
    g = w.float().reshape(out_dim, in_dim // group_size, group_size)
    scale, offset = best_group_params(g, symmetric)
    codes = quantize_to_codes(g, scale, offset).reshape(out_dim, in_dim).to(torch.uint8)
    return codes, scale, None if symmetric else offset.to(torch.uint8)


def quantize_to_codes(g: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """g: [..., n] values; scale, offset: [...] -> float codes in 0..15 (offset 8 = symmetric)."""
    return ((g / scale[..., None]).round() + offset[..., None]).clamp(0, 15)


def best_group_params(g: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """g: [..., n] groups -> (stored scale, offset) per group with the least squared error
    among the candidates; offset is 8 for symmetric groups, the zero point otherwise."""
    best_err = best_scale = best_offset = None
    for scale, zeros in _candidates(g, symmetric):
        scale = _as_stored(scale)
        offset = torch.full_like(scale, 8.0) if zeros is None else zeros
        codes = quantize_to_codes(g, scale, offset)
        err = ((codes - offset[..., None]) * scale[..., None] - g).square().sum(-1)
        if best_err is None:
            best_err, best_scale, best_offset = err, scale, offset
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_offset = torch.where(better, offset, best_offset)
    assert best_scale is not None and best_offset is not None
    return best_scale, best_offset


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def _candidates(g: torch.Tensor, symmetric: bool
                ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(scale, zero point or None) per group, one pair per candidate."""
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    if symmetric:
        amax = g.abs().amax(dim=-1)
        signed = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        for r in CLIP_RATIOS:
            out.append((r * amax / 7.0, None))
            out.append((r * signed / -8.0, None))
        return out
    lo, hi = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)
    for r in CLIP_RATIOS:
        scale = _as_stored(r * (hi - lo) / 15.0)
        out.append((scale, (-r * lo / _nonzero(scale)).round().clamp(0, 15)))
    return out


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    tiny = torch.full_like(scale, 1e-12)
    return torch.where(scale.abs() < 1e-12, torch.where(scale < 0, -tiny, tiny), scale)


def _as_stored(scale: torch.Tensor) -> torch.Tensor:
    """Scales are stored as bf16: judge (and return) exactly what dequantize will see."""
    return _nonzero(_nonzero(scale).to(torch.bfloat16).float())


def dequantize_int4_groupwise(codes: torch.Tensor, scale: torch.Tensor,
                              zeros: torch.Tensor | None,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out_dim, in_dim = codes.shape
    groups = scale.shape[1]
    c = codes.reshape(out_dim, groups, in_dim // groups).float()
    offset = 8.0 if zeros is None else zeros.float()[..., None]
    return ((c - offset) * scale.float()[..., None]).reshape(out_dim, in_dim).to(dtype)


def pack_int4(codes: torch.Tensor, container: torch.dtype = torch.int32) -> torch.Tensor:
    """Pack 0..15 codes along the last dim: 8 per int32 or 2 per uint8, low nibble first."""
    per = {torch.int32: 8, torch.uint8: 2}.get(container)
    if per is None:
        raise InvalidArgument(f"int4 packs into int32 or uint8, not {container}")
    if codes.shape[-1] % per:
        raise InvalidArgument(f"last dimension {codes.shape[-1]} is not a multiple of {per}")
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, per)
    shifts = torch.arange(per, dtype=torch.int64) * 4
    packed = (c << shifts).sum(dim=-1)
    if container is torch.int32:
        packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(container)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    per = 8 if packed.dtype == torch.int32 else 2
    p = packed.to(torch.int64) & (2**32 - 1)
    shifts = torch.arange(per, dtype=torch.int64) * 4
    codes = (p[..., None] >> shifts) & 0xF
    return codes.reshape(*packed.shape[:-1], -1).to(torch.uint8)
