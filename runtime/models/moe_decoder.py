"""The decoder shared by the mixture-of-experts families: GQA (or, for DeepSeek-V3, MLA)
attention over paged KV, then per layer either a dense SwiGLU MLP or a sparse MoE block.

A family (`mixtral.py`, `qwen3_moe.py`, `glm4_moe.py`, `deepseek_v3.py`) subclasses
`MoECausalLM` and says which layers are sparse, how its attention is built, and its checkpoint
name table; names mirror Hugging Face's.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from runtime.config import ModelConfig
from runtime.errors import ModelLoadError
from runtime.formats import WeightFormat
from runtime.models.layers import PagedAttention, RMSNorm, RotaryEmbedding
from runtime.models.moe import SparseMoeBlock, SwiGLU
from runtime.models.weights import Rule, load_checkpoint


class GQAAttention(nn.Module):
    """q/k/v fused; optional per-head RMSNorm of q and k before RoPE (Qwen3, GLM `use_qk_norm`);
    RoPE on the first `rotary.config.head_dim` dims of each head (GLM's partial rotary)."""

    def __init__(self, config: ModelConfig, layer_index: int, rotary: RotaryEmbedding, *,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = rotary.config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.rotary = rotary
        self.attn = PagedAttention(layer_index, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        r = self.rotary_dim
        if r == self.head_dim:
            q, k = self.rotary(positions, q, k)
        else:
            q_rot, k_rot = self.rotary(positions, q[..., :r], k[..., :r])
            q = torch.cat((q_rot, q[..., r:]), dim=-1)
            k = torch.cat((k_rot, k[..., r:]), dim=-1)
        return self.o_proj(self.attn(q, k, v))


class MoEDecoderLayer(nn.Module):
    def __init__(self, attention: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 mlp_name: str = "mlp") -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + getattr(self, self.mlp_name)(self.post_attention_layernorm(x))


class MoEModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return x


class MoECausalLM(nn.Module, abc.ABC):
    """A family's model: `build_attention`, `build_mlp` and `CHECKPOINT_RULES` are its own."""

    CHECKPOINT_RULES: tuple[Rule, ...] = ()
    MLP_NAME = "mlp"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.hf = config.hf_config or {}
        rotary = RotaryEmbedding(dataclasses.replace(config, head_dim=self.rotary_dim()))
        self.model = MoEModel(config, (
            MoEDecoderLayer(self.build_attention(i, rotary), self.build_mlp(i),
                            config.hidden_size, config.rms_norm_eps, self.MLP_NAME)
            for i in range(config.num_hidden_layers)))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def rotary_dim(self) -> int:
        return self.config.head_dim

    @abc.abstractmethod
    def build_attention(self, layer_index: int, rotary: RotaryEmbedding) -> nn.Module:
        """Layer `layer_index`'s attention (GQA, or DeepSeek's latent attention)."""

    @abc.abstractmethod
    def build_mlp(self, layer_index: int) -> SparseMoeBlock | SwiGLU:
        """Layer `layer_index`'s MLP: the family's routed experts, or a dense SwiGLU."""

    def hf_int(self, *names: str, default: int | None = None) -> int:
        """The first of `names` config.json sets, as an int (families renamed fields)."""
        for name in names:
            if self.hf.get(name) is not None:
                return int(self.hf[name])
        if default is None:
            raise ModelLoadError(f"config.json is missing required field {names[0]!r}",
                                 field=names[0])
        return default

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states for every token: [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     quantization: WeightFormat | None = None) -> None:
        """Assign checkpoint tensors (HF names) through the family's table. Pre-quantized
        (fp8/int4) checkpoints of these families are not read yet: a clear error."""
        if quantization is not None and quantization.name in ("fp8", "int4"):
            raise ModelLoadError(f"{self.config.architecture} checkpoints quantized as "
                                 f"{quantization.label} are not supported yet",
                                 field="quantization_config")
        load_checkpoint(self, tensors, dtype, self.CHECKPOINT_RULES,
                        self.config.num_hidden_layers, self.config.tie_word_embeddings)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
