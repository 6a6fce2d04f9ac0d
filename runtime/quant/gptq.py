"""GPTQ for INT4 group-wise weights: round columns one at a time and push each column's
rounding error onto the columns not yet rounded, weighted by the inverse Hessian of the layer's
inputs (H = X^T X over calibration tokens), so the layer's *outputs* on real activations move
least (Frantar et al., 2022). Same output as `quantize_int4_groupwise` (codes, bf16-rounded
scales, zero points), so the packing, the checkpoint and the loader do not change.

Group parameters are chosen by `best_group_params` (the clip-ratio search) on the group's
columns as they stand when the group is reached, i.e. after earlier groups' errors were pushed
onto them, as GPTQ implementations do without static groups. With `act_order`, columns are
taken in order of decreasing Hessian diagonal (the inputs with the most energy first, while
the most columns are left to absorb their error); group parameters are then fixed up front
from the original weights ("static groups"), so groups stay contiguous in the packed layout.
"""

from __future__ import annotations

import torch

from runtime.errors import InvalidArgument
from runtime.formats import INT4_GROUP_SIZES
from runtime.quant.int4 import best_group_params, quantize_to_codes


def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, group_size: int = 128,
              symmetric: bool = True, name: str = "weight", damp: float = 0.01,
              act_order: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w: [out, in]; hessian: [in, in] (sum of x x^T over calibration inputs) ->
    (codes uint8 [out, in] in 0..15, scales [out, ceil(in/g)], zeros or None). A last group
    shorter than `group_size` is quantized on its own."""
    if group_size not in INT4_GROUP_SIZES:
        raise InvalidArgument(f"group size must be one of {INT4_GROUP_SIZES}, got {group_size}",
                              field="group_size")
    out_dim, in_dim = w.shape
    if hessian.shape != (in_dim, in_dim):
        raise InvalidArgument(f"calibration Hessian {tuple(hessian.shape)} does not match the "
                              f"input dimension of tensor {name} {tuple(w.shape)}", tensor=name)
    if not torch.isfinite(hessian).all():
        raise InvalidArgument(f"calibration Hessian for tensor {name} is not finite", tensor=name)
    weight = w.detach().double().clone()
    h = hessian.detach().double().clone()
    dead = h.diagonal() == 0  # an input that was always zero: its column cannot matter
    h[dead, dead] = 1.0
    weight[:, dead] = 0.0
    h.diagonal().add_(damp * h.diagonal().mean())
    order = (torch.argsort(h.diagonal(), descending=True) if act_order
             else torch.arange(in_dim))
    groups = range(0, in_dim, group_size)
    if act_order:  # static groups: fixed from the original weights before any error moves
        params = [best_group_params(weight[:, a : a + group_size].float().unsqueeze(1),
                                    symmetric) for a in groups]
        scale = torch.cat([p[0] for p in params], dim=1)  # [out, groups]
        offset = torch.cat([p[1] for p in params], dim=1)
    else:
        scale = torch.empty(out_dim, len(groups))
        offset = torch.empty(out_dim, len(groups))
    weight = weight[:, order]
    h_inv = _upper_inverse_cholesky(h[order][:, order], name)
    codes = torch.empty(out_dim, in_dim, dtype=torch.uint8)
    pivots = h_inv.diagonal().tolist()
    # NOTE: blocks of group_size columns in processing order; in natural order each block is
    # one group, whose parameters are chosen as the block is reached. The column loop runs
    # ~in_dim times per tensor, so it keeps to few torch calls (what it computes is the
    # textbook update: quantize column i, push its error onto the block's later columns).
    for start in groups:
        end = min(start + group_size, in_dim)
        block = weight[:, start:end]  # a view: updates land in `weight`
        if not act_order:
            g_scale, g_offset = best_group_params(block.float().unsqueeze(1), symmetric)
            scale[:, start // group_size] = g_scale.squeeze(1)
            offset[:, start // group_size] = g_offset.squeeze(1)
        col_group = order[start:end] // group_size
        col_scale, col_offset = scale.double()[:, col_group], offset.double()[:, col_group]
        q_block = torch.empty(out_dim, end - start, dtype=torch.float64)
        errors = torch.empty(out_dim, end - start, dtype=torch.float64)
        for i in range(end - start):
            j = start + i
            s, o, column = col_scale[:, i], col_offset[:, i], block[:, i]
            q = quantize_to_codes(column[:, None], s, o)[:, 0]
            q_block[:, i] = q
            err = (column - (q - o) * s) / pivots[j]
            errors[:, i] = err
            block[:, i + 1:] -= err.unsqueeze(1) * h_inv[j, j + 1:end].unsqueeze(0)
        codes[:, order[start:end]] = q_block.to(torch.uint8)
        weight[:, end:] -= errors @ h_inv[start:end, end:]
    return codes, scale, None if symmetric else offset.to(torch.uint8)


def _upper_inverse_cholesky(h: torch.Tensor, name: str) -> torch.Tensor:
    """Upper Cholesky factor of H^-1: row i holds the weights for pushing column i's error."""
    for extra in (0.0, 0.1, 1.0):  # more damping when the calibration data is rank-poor
        damped = h + extra * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
        lower, info = torch.linalg.cholesky_ex(damped)
        if info == 0:
            inverse = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if info == 0:
                return upper
    raise InvalidArgument(f"calibration Hessian for tensor {name} is not positive definite "
                          f"even after damping", tensor=name)
