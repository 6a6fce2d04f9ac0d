"""Routed experts in a serving weight format: every expert's gate/up (w13) and down (w2)
projections stacked as the `fused_moe` op reads them (`kernels/moe.py` `dequantize_expert`),
block-FP8 or INT4. CPU runs the op's twin (each expert that received rows dequantized for its
matmuls), CUDA the Triton grouped kernel (`kernels/triton/fused_moe.py`).

Formats: fp8 (per-channel scales, or DeepSeek-V3's block scales with 128-column blocks), stored
as e4m3 [E, N, K] with one fp32 scale per (row, 128 columns), a per-channel scale repeated
along the row (exact); int4 (symmetric or with zero points) in groups that divide both the
hidden and the expert's intermediate size, codes two a byte along K, bf16 scales and uint8 zero
points [E, N, K/g] (unlike `Int4Linear`, no short last group: the kernel reads whole groups).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.moe import FP8_EXPERT_BLOCK, dequantize_expert, fused_moe
from kernels.ops import has_device_kernel
from runtime.errors import InvalidArgument
from runtime.formats import WeightFormat
from runtime.quant.fp8 import expand_block_rows, quantize_fp8_blockwise, quantize_fp8_per_channel
from runtime.quant.int4 import quantize_int4_groupwise


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_expert_stack(w: torch.Tensor, fmt: WeightFormat, name: str
                          ) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stacked experts w [E, N, K] float -> (kind, weight, scale, zeros) in `fmt` (fp8 or
    int4; module docstring). InvalidArgument when the format cannot hold these shapes."""
    e, n, k = w.shape
    if fmt.name == "fp8":
        if fmt.block is not None and fmt.block[1] != FP8_EXPERT_BLOCK:
            raise InvalidArgument(f"fp8 experts take 128-column scale blocks, not "
                                  f"{fmt.block[1]} ({name})", tensor=name)
        qs, scales = [], []
        for m in w:
            if fmt.block is None:
                q, s = quantize_fp8_per_channel(m)
                s = s[:, None].expand(n, -(-k // FP8_EXPERT_BLOCK))
            else:
                q, s = quantize_fp8_blockwise(m, fmt.block)
                s = expand_block_rows(s, n, fmt.block[0])
            qs.append(q)
            scales.append(s)
        return "fp8-block", torch.stack(qs), torch.stack(scales).contiguous(), None
    if fmt.name != "int4":
        raise InvalidArgument(f"experts are quantized to fp8 or int4, not {fmt.label}",
                              tensor=name)
    if k % fmt.group_size or k % 2:
        raise InvalidArgument(f"int4 group size {fmt.group_size} does not divide the input "
                              f"dimension {k} of experts {name}", tensor=name)
    codes, scale, zeros = quantize_int4_groupwise(w.reshape(e * n, k), fmt.group_size,
                                                  fmt.symmetric, name)
    return ("int4", _pack_codes(codes).view(e, n, k // 2),
            scale.to(torch.bfloat16).view(e, n, -1),
            None if zeros is None else zeros.view(e, n, -1))


class QuantizedExperts(nn.Module):
    """`runtime.models.moe.FusedExperts` with its two stacks in `kind` ("fp8-block" or
    "int4"): w13 [E, 2 * inter, hidden] and w2 [E, hidden, inter] as stored, with their scales
    (and zero points); forward is the `fused_moe` op. Block-FP8 experts run W8A8 (x and the
    SwiGLU activation quantized per (row, 128 columns), SGLang's form for DeepSeek-V3) where
    the device has a `fused_moe` kernel of its own, as `Fp8Linear` runs `fp8_block_linear`
    there, and W8A16 (dequantize, then matmul in x's dtype) elsewhere."""

    def __init__(self, kind: str, group_size: int,
                 w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
                 w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> None:
        super().__init__()
        self.kind, self.group_size = kind, group_size
        for prefix, (weight, scale, zeros) in (("w13", w13), ("w2", w2)):
            self.register_buffer(prefix, weight)
            self.register_buffer(f"{prefix}_scale", scale)
            self.register_buffer(f"{prefix}_zeros", zeros)
        self.prepare_for_device()

    def prepare_for_device(self) -> None:
        """Whether forward runs W8A8 (`fp8_activations`) on the device the experts are on now:
        block-FP8 experts where it has the grouped kernel (once, at load:
        `runtime.quant.prepare.prepare_weights`)."""
        self.fp8_activations = (self.kind == "fp8-block"
                                and has_device_kernel("fused_moe", self.w13.device))

    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor, fmt: WeightFormat,
                   name: str = "experts") -> QuantizedExperts:
        gate_up = quantize_expert_stack(w13.detach().float(), fmt, f"{name}.w13")
        down = quantize_expert_stack(w2.detach().float(), fmt, f"{name}.w2")
        return cls(gate_up[0], fmt.group_size if fmt.name == "int4" else 0, gate_up[1:],
                   down[1:])

    def dequantize(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (w13, w2) as float32 (the reference the kernels are tested against)."""
        return tuple(dequantize_expert(getattr(self, p), getattr(self, f"{p}_scale"),
                                       getattr(self, f"{p}_zeros"), self.kind,
                                       self.group_size, expert)
                     for p in ("w13", "w2"))  # type: ignore[return-value]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, self.w13, self.w2, weights, ids, self.w13_scale, self.w13_zeros,
                         self.w2_scale, self.w2_zeros, self.kind, self.group_size,
                         self.fp8_activations)

    def extra_repr(self) -> str:
        e, n, _ = self.w13.shape
        kind = self.kind if self.kind != "int4" else f"int4 g{self.group_size}"
        kind += " W8A8" if self.fp8_activations else ""
        return f"experts={e}, w13 rows={n}, {kind}"
