"""Building blocks shared by model families: RMSNorm, rotary embedding, SwiGLU, attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.norm import add_rms_norm
from runtime.attention import backend_of
from runtime.config import ModelConfig
from runtime.context import get_forward_context
from runtime.errors import ModelLoadError
from runtime.platform import platform_for


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: torch's own kernel: one op instead of six, bit-equal in float32 on CPU.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """x += delta in place (the residual stream; nothing when delta is None), then
        normalize x: one fused op on CPU (kernels.norm)."""
        return add_rms_norm(x, delta, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled).float()
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r}", field="rope_scaling")


class RotaryEmbedding(nn.Module):
    """HF-style (rotate-half) rotary embedding with a cos/sin table grown on demand."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.half = config.head_dim // 2
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        # Every layer rotates at the same positions: look them up once per step.
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # ... and the full-width (cat(cos, cos), cat(-sin, sin)) that `forward` multiplies by
        self._wide: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _table(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] < length or self._cos.device != device:
            size = max(length, self.config.max_position_embeddings)
            inv_freq = rope_inv_freq(self.config).to(device)
            freqs = torch.outer(torch.arange(size, device=device, dtype=torch.float32), inv_freq)
            self._cos, self._sin = freqs.cos(), freqs.sin()
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions`, [tokens, 1, head_dim / 2] in `dtype`, looked up once per
        step (every layer rotates at the same positions)."""
        step = self._step
        if step is None or step[0] is not positions or step[1].dtype != dtype:
            # NOTE: where a host read costs a sync (and no CUDA graph could capture it) the
            # table covers max_position_embeddings, the engine's limit, and positions.max()
            # is not read
            free = platform_for(positions.device).host_reads_are_free
            length = int(positions.max()) + 1 if free else 0
            cos_t, sin_t = self._table(length, positions.device)
            step = (positions, cos_t[positions].unsqueeze(1).to(dtype),
                    sin_t[positions].unsqueeze(1).to(dtype))
            self._step = step
        return step[1], step[2]

    def wide_cos_sin(self, positions: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cat(cos, cos), cat(-sin, sin)) at `positions`, [tokens, 1, head_dim], once a step."""
        cos, sin = self.cos_sin(positions, dtype)
        wide = self._wide
        if wide is None or wide[0] is not cos:
            wide = (cos, torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))
            self._wide = wide
        return wide[1], wide[2]

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        """x: [tokens, heads, head_dim], positions: [tokens] -> x rotated (rotate-half), out of
        place (an in-place rotation of strided halves ran 4-6x slower at 32+ tokens).
        x * cat(cos, cos) + cat(x2, x1) * cat(-sin, sin) is, element for element, the same
        rounded products and sum as cat(x1 cos - x2 sin, x2 cos + x1 sin) (a + (-b) is a - b in
        IEEE arithmetic): the same bits as the fused decode step's rotation, in 4 ops, not 7."""
        out = []
        for x in xs:
            cos, sin = self.wide_cos_sin(positions, x.dtype)
            rot = torch.cat((x[..., self.half :], x[..., : self.half]), dim=-1).mul_(sin)
            out.append((x * cos).add_(rot))
        return out


class PagedAttention(nn.Module):
    """Reads and writes this layer's paged KV through the step's forward context: its
    attention backend (runtime/attention/) stores K/V and attends."""

    def __init__(self, layer_index: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, heads, dim]; k, v: [T, kv_heads, dim] -> [T, heads * dim]
        ctx = get_forward_context()
        backend = backend_of(ctx)
        kv = ctx.kv_cache.layer(self.layer_index)  # type: ignore[attr-defined]
        backend.store_kv(ctx.attn, kv, k, v)
        return backend.attend(ctx.attn, kv, q, self.scale)
