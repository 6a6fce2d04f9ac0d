"""Mixture-of-experts blocks: each family's router, the routed experts (grouped compute in
`kernels.moe`), and shared experts.

Routing follows the families' reference code (Hugging Face transformers, which follows the
model authors):
- softmax (Mixtral, Qwen3-MoE): softmax over all experts, top-k, optional renormalisation
  (`norm_topk_prob`; Mixtral always renormalises).
- sigmoid, noaux_tc (DeepSeek-V3, Kimi-K2, GLM-4.5): sigmoid scores; choice scores add the
  `e_score_correction_bias`; experts are split into `n_group` groups scored by the sum of their
  two best choice scores, only the `topk_group` best groups compete for the top-k; the weights are
  the *uncorrected* scores of the chosen experts, renormalised if `norm_topk_prob`, times
  `routed_scaling_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe import fused_moe
from runtime.errors import ModelLoadError


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    scoring: str  # "softmax" or "sigmoid"
    norm_topk_prob: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # e_score_correction_bias (noaux_tc)

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ModelLoadError(f"unsupported MoE scoring {self.scoring!r}", field="scoring_func")
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok ({self.top_k}) must be in "
                                 f"[1, {self.num_experts}]", field="num_experts_per_tok")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ModelLoadError(f"n_group ({self.n_group}) must divide the {self.num_experts} "
                                 f"experts and topk_group ({self.topk_group}) be in "
                                 f"[1, n_group]", field="n_group")
        if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ModelLoadError("topk_group groups hold fewer experts than num_experts_per_tok",
                                 field="topk_group")

    @classmethod
    def sigmoid_grouped(cls, cfg: dict[str, Any]) -> RoutingConfig:
        """DeepSeek-V3 / Kimi-K2 / GLM-4.5 routing from their config.json."""
        method = cfg.get("topk_method", "noaux_tc")
        if method != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise ModelLoadError(f"unsupported routing {method!r}/{cfg.get('scoring_func')!r}: "
                                 f"only sigmoid noaux_tc", field="topk_method")
        experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
        return cls(int(experts), int(cfg["num_experts_per_tok"]), "sigmoid",
                   bool(cfg.get("norm_topk_prob", True)), int(cfg.get("n_group") or 1),
                   int(cfg.get("topk_group") or 1),
                   float(cfg.get("routed_scaling_factor", 1.0)), correction_bias=True)


def select_experts(router_logits: torch.Tensor, cfg: RoutingConfig,
                   correction_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] float32 -> (weights [T, top_k] float32, ids [T, top_k] long)."""
    if cfg.scoring == "softmax":
        weights, ids = router_logits.softmax(dim=-1).topk(cfg.top_k, dim=-1)
    else:
        scores = router_logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias
        if cfg.topk_group < cfg.n_group:
            tokens, per_group = choice.shape[0], cfg.num_experts // cfg.n_group
            grouped = choice.view(tokens, cfg.n_group, per_group)
            group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
            best = group_scores.topk(cfg.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        ids = choice.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP (dense layers and shared experts); gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FusedExperts(nn.Module):
    """All routed experts of one layer as two stacked tensors (HF's `gate_up_proj` layout):
    w13 [E, 2 * inter, hidden] (gate rows then up rows) and w2 [E, hidden, inter]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, self.w13, self.w2, weights, ids)


class Router(nn.Module):
    """The gate: logits in float32 (as the references compute them), then `select_experts`."""

    def __init__(self, hidden_size: int, cfg: RoutingConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size))
        if cfg.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        bias = getattr(self, "e_score_correction_bias", None)
        return select_experts(logits, self.cfg, None if bias is None else bias.float())


class SparseMoeBlock(nn.Module):
    """gate -> routed experts (+ shared experts, which every token runs)."""

    def __init__(self, hidden_size: int, routing: RoutingConfig, moe_intermediate_size: int,
                 shared_intermediate_size: int = 0) -> None:
        super().__init__()
        self.gate = Router(hidden_size, routing)
        self.experts = FusedExperts(routing.num_experts, hidden_size, moe_intermediate_size)
        self.shared_experts = (SwiGLU(hidden_size, shared_intermediate_size)
                               if shared_intermediate_size else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
