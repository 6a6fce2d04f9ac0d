"""Linear layers that keep their weights packed: FP8 e4m3 (fp32 scale per output row) and INT4
group-wise (bf16 scale per group, optional 4-bit zero per group). Nothing dequantized stays
resident: a forward either runs a kernel on the packed data or dequantizes into a temporary.

Measured on the 2-core dev box (AVX512, torch 2.13 CPU, one thread, 2026-11-30), µs per call,
fp32 x, g128 (g64 for in=576):

| out x in   | rows | fp32 mm | int4pack (bf16 x) | int4 deq+mm (compiled) | fp8 deq+mm (compiled) |
|------------|------|---------|-------------------|------------------------|-----------------------|
| 1536 x 576 | 1    | 144     | 62                | 1,119                  | 446                   |
| 1536 x 576 | 32   | 730     | 1,032             | 1,874                  | 1,330                 |
| 576 x 1536 | 1    | 142     | 61                | 1,143                  | 466                   |
| 576 x 1536 | 32   | 819     | 1,143             | 2,723                  | 1,415                 |
| 576 x 1536 | 256  | 4,016   | 8,622             | 5,390                  | 4,018                 |

Other candidates: int4pack mm with fp32 x: 1,900 µs at one row, 73-96 ms at 32 (never use);
a compiled fused GEMV (dequant inside the reduction): 906 µs at one row; eager int4 dequant
1.5-2.3 ms, eager fp8 cast 4.9-6.4 ms vs 0.27-0.29 ms for the compiled bit decode; compiling
with dynamic shapes made the dequant 5-40x slower. So: INT4 uses torch's CPU int4pack kernel
with bf16 activations up to `Int4Linear.kernel_max_rows` rows (2.3x faster than fp32 at decode,
32 µs a row after that; relative error ~3e-3 from bf16 activations and output, far under the
int4 rounding itself) and dequantize-then-matmul beyond it; FP8 dequantizes with integer bit
operations in a compiled function of the weight alone (static shapes, so no recompile per batch
size) and runs an fp32 matmul: 3x slower than fp32 at one row on CPU, a memory format only here.

Since issue 16, INT4 where the device has the block kernel (CPU with the C++ ops built; and
in % 32 == 0) is held in the q4 block layout instead (`layout="q4_blocks"`) and served by the one
block linear, `runtime.quant.blocks.BlockPlanes.linear` (the `block_linear_out` op, as GGUF
blocks are): fp32 activations, codes dequantized in registers exactly as `dequantize` forms
them, any group size with a short last group read with its own scale; faster than int4pack at
1, 8 and 32 rows on the model's shapes and as exact as the fp32 path
(ops/bench/RESULTS.md#weight-kernels). Past 16 rows the same op dequantizes tiles of the weight
into a cache-resident buffer and multiplies them by BLAS. Which layout a layer gets is asked of
the op library (`kernels.ops.has_device_kernel`), never of the device's type.

Where the device has the W4A16 kernel (`w4a16_linear`: CUDA with triton installed), INT4 is
held as the GPU tiles instead (`layout="int4_tiles"`, `kernels/triton/int4_layout.py`: codes
K-major, scales [groups, out]); block-FP8 layers with 128-column blocks run `fp8_block_linear`
(x quantized per 128 columns, W8A8, as SGLang serves DeepSeek-V3) where the device has it, and
dequantize-then-matmul (W8A16) elsewhere. A layer moved to another device after it was built
(a quantized checkpoint loads on the CPU) takes that device's layout in `prepare_for_device`,
once, at load (`runtime.quant.prepare.prepare_weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.int4pack import (
    KERNEL_BLOCK_N,
    int4pack_layout_is_known,
    pack_int4pack,
    unpack_int4pack,
)
from kernels.ops import has_device_kernel
from kernels.qgemv import BLOCK, pack_q4_blocks, unpack_q4_blocks
from kernels.triton.gemm_ref import FP8_GROUP
from kernels.triton.int4_layout import (
    GROUP_SIZES,
    OFFSET_SYMMETRIC,
    OFFSET_ZEROS,
    repack_int4_rows,
)
from runtime.errors import InvalidArgument
from runtime.quant.blocks import BlockPlanes
from runtime.quant.fp8 import (
    expand_block_rows,
    quantize_fp8_blockwise,
    quantize_fp8_per_channel,
)
from runtime.quant.int4 import best_group_params, quantize_int4_groupwise, quantize_to_codes


class Fp8Linear(nn.Module):
    """y = x @ (e4m3 weight * scale)^T + bias. `weight_scale` is fp32 [out] (one per output
    channel) or [out, ceil(in / block_cols)] (one per row and column block: DeepSeek-V3-style
    128x128 block scales expanded along rows, `runtime.quant.fp8.expand_block_rows`)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, block_cols: int | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block_cols = block_cols
        if (weight_scale.dim() == 2) != (block_cols is not None):
            raise ValueError("a 2-d weight_scale needs block_cols, a 1-d one none")
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        cols = None  # [in] column -> its block, for 2-d scales (derived, not saved)
        if block_cols is not None:
            cols = torch.arange(self.in_features, device=weight.device) // block_cols
        self.register_buffer("block_of_col", cols, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.prepare_for_device()

    def prepare_for_device(self) -> None:
        """Whether forward runs the block-FP8 kernel (`fp8_block_linear`) on this device."""
        self.block_kernel = (self.block_cols == FP8_GROUP
                             and has_device_kernel("fp8_block_linear", self.weight.device))

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   name: str = "weight", block: tuple[int, int] | None = None) -> Fp8Linear:
        """Per-channel scales, or with `block` DeepSeek-V3-style block scales."""
        if block is None:
            q, scale = quantize_fp8_per_channel(weight)
            return cls(q, scale, bias)
        q, scale_inv = quantize_fp8_blockwise(weight, block)
        return cls(q, expand_block_rows(scale_inv, weight.shape[0], block[0]), bias, block[1])

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "weight_scale": self.weight_scale}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # the `fp8_dequantize` op: on CPU its twin compiled for this weight (kernels/fp8.py)
        return torch.ops.tessera.fp8_dequantize(self.weight.view(torch.uint8), self.weight_scale,
                                                self.block_of_col).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.block_kernel:
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        y = torch.ops.tessera.fp8_block_linear(x.reshape(-1, self.in_features),
                                               self.weight.view(torch.uint8), self.weight_scale)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        blocks = "" if self.block_cols is None else f", block_cols={self.block_cols}"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3{blocks}"


class Int4Linear(nn.Module):
    """y = x @ ((codes - zero) * group scale)^T + bias; zero = 8 when symmetric.

    Stored: `weight_packed` uint8 [out, in/2] (two codes a byte, low nibble first; or, by
    `layout`, "q4_blocks": `kernels.qgemv`'s 32-code blocks, served as `BlockPlanes` (the one
    block linear, `BlockPlanes.linear`), the default where the device has the block kernel and
    in % 32 == 0; "cpu_int4pack": torch's CPU int4pack layout, rows interleaved in blocks,
    the `int4pack_mm` op),
    `weight_scale` bf16 [out, ceil(in/g)] (the last group may be shorter), and when asymmetric
    `weight_zero_point` uint8 [ceil(out*groups/2)], the row-major zeros packed two a byte.
    In the "int4_tiles" layout (the `w4a16_linear` op's, where the device has it) the three
    are `Int4Tiles`' `qt` [in/2, out], `d` [groups, out] and zero points uint8 [groups, out].
    """

    kernel_max_rows = 128  # past this the dequantize-then-matmul path wins (table above)

    def __init__(self, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_zero_point: torch.Tensor | None, in_features: int, group_size: int,
                 bias: torch.Tensor | None = None, layout: str | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_packed.shape[0], in_features
        self.group_size, self.symmetric = group_size, weight_zero_point is None
        self.num_groups = weight_scale.shape[1]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        layout = layout or _default_layout(self.out_features, in_features, group_size,
                                           weight_packed.device)
        self._store(weight_packed, weight_scale, weight_zero_point, layout)

    def _store(self, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
               weight_zero_point: torch.Tensor | None, layout: str) -> None:
        """Hold the checkpoint tensors (row layout) in `layout`."""
        if layout not in INT4_LAYOUTS:
            raise InvalidArgument(f"int4 layout must be one of {INT4_LAYOUTS}, got {layout!r}",
                                  field="layout")
        self.layout = layout
        if layout == "q4_blocks":
            weight_packed = pack_q4_blocks(_unpack_rows(weight_packed)[:, :self.in_features])
        elif layout == "cpu_int4pack":
            weight_packed = pack_int4pack(_unpack_rows(weight_packed))
        elif layout == "int4_tiles":
            tiles = repack_int4_rows(weight_packed, weight_scale, weight_zero_point,
                                     self.in_features, self.group_size)
            weight_packed, weight_scale, weight_zero_point = tiles.qt, tiles.d, tiles.offset
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_zero_point", weight_zero_point)

    def prepare_for_device(self) -> None:
        """Re-lay the weights out for the device they are on now, if it serves another layout
        best (once, at load: a checkpoint's layers are built on the CPU and moved)."""
        layout = _default_layout(self.out_features, self.in_features, self.group_size,
                                 self.weight_packed.device)
        if layout != self.layout:
            t = self.packed_tensors()
            self._store(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                        layout)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   group_size: int = 128, symmetric: bool = True, name: str = "weight",
                   layout: str | None = None) -> Int4Linear:
        t = quantize_int4_packed(weight, group_size, symmetric, name)
        return cls(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                   weight.shape[1], group_size, bias, layout)

    def codes(self) -> torch.Tensor:
        """uint8 [out, in] in 0..15, whatever the storage layout."""
        if self.layout == "cpu_int4pack":
            return unpack_int4pack(self.weight_packed)
        if self.layout == "q4_blocks":
            return unpack_q4_blocks(self.weight_packed)
        if self.layout == "int4_tiles":
            return unpack_q4_blocks(self.weight_packed.t())
        return _unpack_rows(self.weight_packed)[:, : self.in_features]

    def zeros(self) -> torch.Tensor | None:
        """uint8 [out, groups] zero points, or None when symmetric."""
        if self.weight_zero_point is None:
            return None
        if self.layout == "int4_tiles":
            return self.weight_zero_point.t()
        n = self.out_features * self.num_groups
        return _unpack_rows(self.weight_zero_point)[:n].view(self.out_features, self.num_groups)

    def row_scales(self) -> torch.Tensor:
        """bf16 [out, groups] group scales, whatever the layout."""
        return self.weight_scale.t() if self.layout == "int4_tiles" else self.weight_scale

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint form (row layout), bit-identical to `quantize_int4_packed`."""
        codes = self.codes()
        if self.in_features % 2:
            codes = F.pad(codes, (0, 1))
        out = {"weight_packed": self.weight_packed if self.layout == "rows"
               else _pack_rows(codes), "weight_scale": self.row_scales().contiguous()}
        if self.weight_zero_point is not None:
            zeros = self.weight_zero_point
            if self.layout == "int4_tiles":
                flat = self.weight_zero_point.t().flatten()
                zeros = _pack_rows(F.pad(flat, (0, flat.numel() % 2)))
            out["weight_zero_point"] = zeros
        return out

    def planes(self) -> BlockPlanes:
        """The "q4_blocks" layout's tensors as block planes (d the group scales, offsets from
        the zero points or -8 d)."""
        return BlockPlanes("q4", self.weight_packed, self.weight_scale, None,
                           self.weight_zero_point, self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.layout == "q4_blocks":  # w = (q - zero) * scale, bit for bit (kernels.qgemv)
            return self.planes().to_dense(dtype)
        g, k = self.group_size, self.in_features
        codes = self.codes().to(torch.float32)
        scale = self.row_scales().to(torch.float32).repeat_interleave(g, dim=1)[:, :k]
        zeros = self.zeros()
        offset = 8.0 if zeros is None else zeros.to(torch.float32).repeat_interleave(g, 1)[:, :k]
        return ((codes - offset) * scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "q4_blocks":
            return self.planes().linear(x, self.bias)
        if self.layout == "int4_tiles":
            kind = OFFSET_SYMMETRIC if self.weight_zero_point is None else OFFSET_ZEROS
            y = torch.ops.tessera.w4a16_linear(x.reshape(-1, self.in_features),
                                               self.weight_packed, self.weight_scale,
                                               self.weight_zero_point, kind, self.group_size)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        rows = x.numel() // self.in_features
        if self.layout != "cpu_int4pack" or rows > self.kernel_max_rows:
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        kernel_group = _kernel_group_size(self.in_features, self.group_size)
        y = torch.ops.tessera.int4pack_mm(
            x.reshape(rows, self.in_features).to(torch.bfloat16), self.weight_packed,
            kernel_group, self._scales_and_zeros(kernel_group))
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _scales_and_zeros(self, kernel_group: int) -> torch.Tensor:
        # The kernel computes (q - 8) * scale + zero: zero = (8 - z) * scale for our zero point z.
        scale = self.weight_scale
        zeros = self.zeros()
        if zeros is not None:
            zf = ((8.0 - zeros.to(torch.float32)) * scale.to(torch.float32)).to(torch.bfloat16)
            sz = torch.stack((scale, zf), dim=-1).transpose(0, 1)
        else:
            sz = F.pad(scale.t().unsqueeze(-1), (0, 1))
        if kernel_group != self.group_size:  # a short last group: split groups for the kernel
            sz = sz.repeat_interleave(self.group_size // kernel_group, dim=0)
            sz = sz[: self.in_features // kernel_group]
        return sz.contiguous()

    def extra_repr(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 g{self.group_size} {kind}, layout={self.layout}")


def quantize_int4_packed(weight: torch.Tensor, group_size: int, symmetric: bool,
                         name: str = "weight", hessian: torch.Tensor | None = None,
                         act_order: bool = False) -> dict[str, torch.Tensor]:
    """[out, in] float -> checkpoint tensors (see `Int4Linear`). A last group shorter than
    `group_size` is quantized on its own columns (`_quantize_with_short_group`). With a calibration
    `hessian` ([in, in], sum of x x^T), the codes come from GPTQ (`runtime.quant.gptq`,
    optionally in act order)."""
    in_dim = weight.shape[1]
    if hessian is not None:
        from runtime.quant.gptq import gptq_int4

        codes, scale, zeros = gptq_int4(weight, hessian, group_size, symmetric, name,
                                        act_order=act_order)
    else:
        codes, scale, zeros = _quantize_with_short_group(weight, group_size, symmetric, name)
    codes = codes[:, :in_dim]
    if in_dim % 2:
        codes = F.pad(codes, (0, 1))
    tensors = {"weight_packed": _pack_rows(codes),
               "weight_scale": scale.to(torch.bfloat16)}
    if zeros is not None:
        flat = zeros.flatten()
        tensors["weight_zero_point"] = _pack_rows(F.pad(flat, (0, flat.numel() % 2)))
    return tensors


def _quantize_with_short_group(weight: torch.Tensor, group_size: int, symmetric: bool, name: str
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest codes with a last group shorter than `group_size` searched on its own
    columns only. (It was padded with copies of its last column, which left amax and min/max
    alone but made the scale search weigh that one column ~65 times over the rest.)"""
    full = weight.shape[1] - weight.shape[1] % group_size
    parts = []
    if full:
        parts.append(quantize_int4_groupwise(weight[:, :full], group_size, symmetric, name))
    if full < weight.shape[1]:
        tail = weight[:, full:].float().unsqueeze(1)  # [out, 1 group, short width]
        scale, offset = best_group_params(tail, symmetric)
        codes = quantize_to_codes(tail, scale, offset).squeeze(1).to(torch.uint8)
        parts.append((codes, scale, None if symmetric else offset.to(torch.uint8)))
    codes = torch.cat([p[0] for p in parts], dim=1)
    scale = torch.cat([p[1] for p in parts], dim=1)
    zeros = None if symmetric else torch.cat([p[2] for p in parts], dim=1)  # type: ignore[misc]
    return codes, scale, zeros


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """`pack_int4(codes, torch.uint8)` in two uint8 ops instead of int64 arithmetic."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


INT4_LAYOUTS = ("int4_tiles", "q4_blocks", "cpu_int4pack", "rows")


def _default_layout(out_features: int, in_features: int, group_size: int,
                    device: torch.device) -> str:
    """The W4A16 tiles where the device has that kernel (in % 32 == 0, groups of 32 / 64 /
    128); else the q4 block kernel where the device has one (in % 32 == 0; on CPU faster than
    torch's int4pack at every row count, ops/bench/RESULTS.md#weight-kernels), else torch's
    int4pack kernel where the device has it and this build's layout is known, else rows."""
    if (in_features % BLOCK == 0 and group_size in GROUP_SIZES
            and has_device_kernel("w4a16_linear", device)):
        return "int4_tiles"
    if in_features % BLOCK == 0 and has_device_kernel("block_linear_out", device):
        return "q4_blocks"
    if (out_features % KERNEL_BLOCK_N == 0 and in_features % 32 == 0
            and has_device_kernel("int4pack_mm", device) and int4pack_layout_is_known()):
        return "cpu_int4pack"
    return "rows"


def _kernel_group_size(in_features: int, group_size: int) -> int:
    g = group_size
    while in_features % g:
        g //= 2
    return g
