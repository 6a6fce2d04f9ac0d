"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over latent KV pages.

What a token caches per layer is its compressed latent: `kv_a_layernorm(c_kv)` (kv_lora_rank
elements) followed by its roped key part k_pe (qk_rope_head_dim), one vector shared by all
heads: 576 elements for DeepSeek-V3 instead of 2 * 128 heads * 128 (runtime/kv/cache.py).

Attention runs in the absorbed form, in decode *and* prefill (DeepSeek-V2 paper, section 2.1.2;
vLLM's and SGLang's MLA decode): kv_b_proj is split per head into W_UK [nope, kv_lora] and W_UV
[v, kv_lora]; each query's nope part is projected into the latent space (q_nope @ W_UK), so a
score is q_latent . c_kv + q_pe . k_pe, i.e. a dot product with the cached vector, and the
output is (probs @ c_kv) @ W_UV^T. The cache is never re-expanded per head. It is multi-query
attention with one "KV head" of dimension kv_lora_rank + qk_rope_head_dim, run by the step's
attention backend (`store_latent`, `attend_latent`): on `cpu` / `torch` through the paged
attention ops (`runtime/attention/latent.py`; the value read is the whole cached vector and its
last qk_rope_head_dim outputs are dropped), on `triton` through the MLA decode kernel
(`kernels/triton/mla_decode.py`, one query row per token, prefill included).

Prefill: absorbed too. It does more FLOPs per token than re-expanding K/V for the chunk's
context (vLLM and SGLang re-expand for long prompts, where prefill is compute-bound), but it is
one code path that reads the same pages decode reads, including pages that came from the prefix
cache; re-expanded prefill is a later optimisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.attention import backend_of
from runtime.config import ModelConfig
from runtime.context import get_forward_context
from runtime.errors import ModelLoadError
from runtime.models.layers import RMSNorm, RotaryEmbedding


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    attention_bias: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], num_heads: int) -> MLAConfig:
        try:
            q_lora = cfg.get("q_lora_rank")
            return cls(num_heads, None if q_lora is None else int(q_lora),
                       int(cfg["kv_lora_rank"]), int(cfg["qk_nope_head_dim"]),
                       int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"]),
                       bool(cfg.get("rope_interleave", True)),
                       bool(cfg.get("attention_bias", False)))
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}",
                                 field=e.args[0]) from e


class KVBProj(nn.Module):
    """kv_b_proj's weight [heads * (nope + v), kv_lora], read per head by the absorbed form
    (a plain holder, not an nn.Linear: the weight is never applied to activations whole)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))


class LatentPagedAttention(nn.Module):
    """Writes each token's latent into this layer's latent pages and attends over them as
    multi-query attention in the latent space. q: [T, heads, kv_lora + rope] ->
    [T, heads, kv_lora]."""

    def __init__(self, layer_index: int, kv_lora_rank: int, scale: float) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale

    def forward(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        backend = backend_of(ctx)
        kv = ctx.kv_cache.layer(self.layer_index)  # type: ignore[attr-defined]
        backend.store_latent(ctx.attn, kv, latent)
        return backend.attend_latent(ctx.attn, kv, q, self.scale, self.kv_lora_rank)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek checkpoints store RoPE pairs interleaved (x0, x1, x2, x3 ...): reorder to the
    rotate-half layout (x0, x2, ..., x1, x3, ...), as transformers' `rope_interleave` does."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class DeepseekV3Attention(nn.Module):
    def __init__(self, config: ModelConfig, mla: MLAConfig, layer_index: int,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.mla = mla
        hidden, heads, bias = config.hidden_size, mla.num_heads, mla.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim,
                                            bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = KVBProj(heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                 mla.kv_lora_rank)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=bias)
        self.rotary = rotary
        self.attn = LatentPagedAttention(layer_index, mla.kv_lora_rank, mla.qk_head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        m = self.mla
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(-1, m.num_heads, m.qk_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim],
                                                      dim=-1)
        k_pe = k_pe.unsqueeze(1)  # [T, 1, rope]
        if m.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        w_kv = self.kv_b_proj.weight.view(m.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        w_uk, w_uv = w_kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, kv_lora]
        latent = torch.cat((self.kv_a_layernorm(c_kv).unsqueeze(1), k_pe), dim=-1)
        out = self.attn(torch.cat((q_latent, q_pe), dim=-1).contiguous(), latent)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(-1, m.num_heads * m.v_head_dim))
