"""GPTQ for FP8 e4m3 weights: the scales are the round-to-nearest format's (per output channel,
or DeepSeek-V3's 128x128 blocks, both fixed from the original weights' amax), and only the
choice of each e4m3 code changes: columns are rounded one at a time and each column's rounding
error is pushed onto the columns not yet rounded, weighted by the inverse Hessian of the
layer's calibration inputs, so the layer's outputs on real activations move least (Frantar et
al., "GPTQ", 2022; the same error feedback over a floating-point grid as in Zhang et al.,
"Integer or Floating Point? New Outlooks for Low-Bit Quantization on Large Language Models",
2023). The checkpoint layout, the loader and the serving kernels do not change.

Columns go in act order (decreasing Hessian diagonal): with scales fixed up front this costs
nothing in the layout.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_MAX
from runtime.errors import InvalidArgument
from runtime.quant.fp8 import expand_block_rows, quantize_fp8_blockwise, quantize_fp8_per_channel
from runtime.quant.gptq import _upper_inverse_cholesky

_LAZY_COLUMNS = 128  # columns per lazy batch update (GPTQ's block size; not the scale block)


def gptq_fp8(w: torch.Tensor, hessian: torch.Tensor, block: tuple[int, int] | None = None,
             name: str = "weight", damp: float = 0.01
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in]; hessian: [in, in] (sum of x x^T over calibration inputs) -> (e4m3 [out, in],
    scales) with the scales of `quantize_fp8_per_channel` (fp32 [out]) or, with `block`, of
    `quantize_fp8_blockwise` (weight_scale_inv fp32 [ceil(out/bo), ceil(in/bi)]).
    Raises InvalidArgument for a Hessian of the wrong shape, not finite, or not positive
    definite even after damping."""
    out_dim, in_dim = w.shape
    if hessian.shape != (in_dim, in_dim):
        raise InvalidArgument(f"calibration Hessian {tuple(hessian.shape)} does not match the "
                              f"input dimension of tensor {name} {tuple(w.shape)}", tensor=name)
    if not torch.isfinite(hessian).all():
        raise InvalidArgument(f"calibration Hessian for tensor {name} is not finite", tensor=name)
    if block is None:
        _, scale = quantize_fp8_per_channel(w)
        col_scale = scale.double()[:, None].expand(out_dim, in_dim)
    else:
        _, scale = quantize_fp8_blockwise(w, block)
        rows = expand_block_rows(scale, out_dim, block[0]).double()
        col_scale = rows[:, torch.arange(in_dim) // block[1]]
    weight = w.detach().double().clone()
    h = hessian.detach().double().clone()
    dead = h.diagonal() == 0  # an input that was always zero: its column cannot matter
    h[dead, dead] = 1.0
    weight[:, dead] = 0.0
    h.diagonal().add_(damp * h.diagonal().mean())
    order = torch.argsort(h.diagonal(), descending=True)
    weight, col_scale = weight[:, order], col_scale[:, order].contiguous()
    h_inv = _upper_inverse_cholesky(h[order][:, order], name)
    codes = torch.empty(out_dim, in_dim, dtype=torch.float8_e4m3fn)
    for start in range(0, in_dim, _LAZY_COLUMNS):
        end = min(start + _LAZY_COLUMNS, in_dim)
        chunk = weight[:, start:end]  # a view: updates land in `weight`
        errors = torch.empty(out_dim, end - start, dtype=torch.float64)
        for i in range(end - start):
            j = start + i
            s = col_scale[:, j]
            q = (chunk[:, i] / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            codes[:, order[j]] = q
            err = (chunk[:, i] - q.double() * s) / h_inv[j, j]
            chunk[:, i:] -= err.unsqueeze(1) * h_inv[j, j:end].unsqueeze(0)
            errors[:, i] = err
        weight[:, end:] -= errors @ h_inv[start:end, end:]
    return codes, scale
