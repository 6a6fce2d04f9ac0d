"""INT4 weight-only, group-wise along the input dimension (group size 32/64/128).

Symmetric: q = round(w / s) in [-8, 7], s = amax / 7 per group. Asymmetric: q = round(w / s) + z
in [0, 15], s = (max - min) / 15, z = round(-min / s). Codes are stored as unsigned nibbles
(symmetric codes offset by 8) packed 8 per int32 or 2 per uint8, low nibble first.
"""

from __future__ import annotations

import torch

from runtime.errors import InvalidArgument

GROUP_SIZES = (32, 64, 128)


def quantize_int4_groupwise(w: torch.Tensor, group_size: int = 128, symmetric: bool = True,
                            name: str = "weight"
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w: [out, in] -> (codes uint8 [out, in] in 0..15, scales [out, in/g], zeros or None)."""
    if group_size not in GROUP_SIZES:
        raise InvalidArgument(f"group size must be one of {GROUP_SIZES}, got {group_size}",
                              field="group_size")
    if w.dim() != 2 or w.shape[1] % group_size:
        raise InvalidArgument(f"group size {group_size} does not divide the input dimension "
                              f"of tensor {name} {tuple(w.shape)}", tensor=name)
    out_dim, in_dim = w.shape
    g = w.float().reshape(out_dim, in_dim // group_size, group_size)
    if symmetric:
        scale = (g.abs().amax(dim=-1) / 7.0).clamp(min=1e-12)
        codes = (g / scale[..., None]).round().clamp(-8, 7) + 8
        zeros = None
    else:
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        zeros = (-lo / scale).round().clamp(0, 15)
        codes = ((g / scale[..., None]).round() + zeros[..., None]).clamp(0, 15)
    codes = codes.reshape(out_dim, in_dim).to(torch.uint8)
    return codes, scale, None if zeros is None else zeros.to(torch.uint8)


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
