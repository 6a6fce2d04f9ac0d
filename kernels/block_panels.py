"""Block weights laid out once, at load, as the int8-activation kernels read them (issue 32).

`kernels/cpu/qgemv_i8.cpp` multiplies 16 weight rows at a time with each int32 lane holding
one row: lane r of a vector holds 4 consecutive weights of row r. From the file's row-major
planes (`kernels.qgemv`) every call transposed each 16-row panel (and its scales) into that
form first, which at one row of x (a decode step at concurrency 1) cost about as much as the
dot products. A `BlockPanels` stores the transposed form instead, so a call reads it as is
(Q8) or only splits the nibbles (Q4). The numbers are the same: every output takes the same
integer dots and the same float steps in the same order, so `block_panels_linear` gives the
bits of `kernels.block_linear.block_linear` over the row-major planes (tested bit for bit).

Layout, for N rows (a multiple of 16) in P = N / 16 panels of nb = K / 32 blocks:
  Q4: `pw` uint8 [P, nb, 256]; byte c*64 + r*4 + k of block b is byte 4c + k of row 16p + r's
      16 bytes of block b (c < 4; low nibble weight 4c + k, high nibble weight 16 + 4c + k).
  Q8: `pw` uint8 [P, nb, 512]; byte j*64 + r*4 + k is weight 4j + k of row 16p + r's block b,
      plus 128 (j < 8; the kernel's unsigned operand).
  `pd`, `pm` float32 [P, nb, 16]: the blocks' scale and (Q4) offset, lane r for row 16p + r.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.block_linear import ref_block_linear
from kernels.cpu_ops import native_ops
from kernels.qgemv_i8 import int8_kernels_available

LANES = 16  # weight rows a panel holds: one AVX-512 vector of int32 lanes


@dataclass(frozen=True)
class BlockPanels:
    """One [N, K] block weight in panel-major layout (module docstring); `pm` is None for Q8."""

    pw: torch.Tensor
    pd: torch.Tensor
    pm: torch.Tensor | None

    @property
    def q8(self) -> bool:
        return self.pm is None

    @property
    def out_features(self) -> int:
        return self.pw.shape[0] * LANES

    @property
    def in_features(self) -> int:
        return self.pw.shape[1] * 32

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pw, self.pd, self.pm)
                   if t is not None)


def panels_fit(out_features: int) -> bool:
    """Whether a weight with `out_features` rows can be held as panels (whole panels only)."""
    return out_features > 0 and out_features % LANES == 0


def _lanes(rows: torch.Tensor, per_block: int) -> torch.Tensor:
    """[N, nb * per_block] bytes -> [P, nb, per_block / 4 dwords, 16 lanes, 4 bytes]."""
    n = rows.shape[0]
    nb = rows.shape[1] // per_block
    return rows.reshape(n // LANES, LANES, nb, per_block // 4, 4).permute(0, 2, 3, 1, 4)


def pack_block_panels(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> BlockPanels:
    """Row-major planes (Q4: `qs` uint8 [N, K/2], `d`, `m` float16 [N, K/32]; Q8: `qs` int8
    [N, K], `d`, no `m`) -> panels. Raises ValueError when N is not a multiple of 16 or the
    planes are not GGUF's 32-weight blocks with offsets (Q4)."""
    n = qs.shape[0]
    if not panels_fit(n):
        raise ValueError(f"panels hold whole groups of {LANES} rows; this weight has {n}")
    q8 = qs.dtype == torch.int8
    if not q8 and (qs.dtype != torch.uint8 or m is None):
        raise ValueError("Q4 panels need uint8 codes and their offsets (m)")
    per_block = 32 if q8 else 16
    if qs.shape[1] % per_block or d.shape != (n, qs.shape[1] // per_block):
        raise ValueError(f"planes of shape {tuple(qs.shape)} with scales {tuple(d.shape)} are "
                         "not whole 32-weight blocks")
    raw = qs.view(torch.uint8) ^ 0x80 if q8 else qs
    p, nb = n // LANES, d.shape[1]
    pw = _lanes(raw, per_block).reshape(p, nb, per_block * LANES).contiguous()

    def lanes(s: torch.Tensor) -> torch.Tensor:
        return s.float().reshape(p, LANES, nb).permute(0, 2, 1).contiguous()

    return BlockPanels(pw, lanes(d), None if q8 else lanes(m))  # type: ignore[arg-type]


def ref_unpack_block_panels(pw: torch.Tensor, pd: torch.Tensor, pm: torch.Tensor | None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Panels -> the row-major planes (qs, d, m) they were packed from."""
    p, nb, width = pw.shape
    per_block = width // LANES
    rows = pw.reshape(p, nb, per_block // 4, LANES, 4).permute(0, 3, 1, 2, 4)
    qs = rows.reshape(p * LANES, nb * per_block)
    if pm is None:
        qs = (qs ^ 0x80).view(torch.int8)

    def rows_of(s: torch.Tensor) -> torch.Tensor:
        return s.permute(0, 2, 1).reshape(p * LANES, nb).half()

    return qs.contiguous(), rows_of(pd), None if pm is None else rows_of(pm)


def ref_block_panels_linear(x: torch.Tensor, pw: torch.Tensor, pd: torch.Tensor,
                            pm: torch.Tensor | None, limbs: int) -> torch.Tensor:
    """Twin of `block_panels_linear_out`: the row-major planes' block linear."""
    qs, d, m = ref_unpack_block_panels(pw, pd, pm)
    return ref_block_linear(x, qs, d, m, None, 32, limbs)


def block_panels_linear(x: torch.Tensor, panels: BlockPanels, limbs: int) -> torch.Tensor:
    """x float32 [..., K] -> float32 [..., N] with `limbs` (1 or 2) int8 limbs of x: the bits of
    `block_linear` over the planes `panels` was packed from. Where the CPU build has no int8
    kernels the twin runs. Raises ValueError for another number of limbs, RuntimeError on
    shapes the op refuses."""
    if limbs not in (1, 2):
        raise ValueError(f"panels take 1 or 2 int8 limbs of x, got {limbs}")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if not int8_kernels_available():
        y = ref_block_panels_linear(x2, panels.pw, panels.pd, panels.pm, limbs)
    else:
        y = x2.new_empty(x2.shape[0], panels.out_features)
        native_ops().block_panels_linear_out(x2, panels.pw, panels.pd, panels.pm, limbs, y)
    return y.view(*x.shape[:-1], panels.out_features)
