"""Llama-family decoder (Llama, SmolLM2, Llama-3 RoPE scaling) over paged KV.

Names mirror Hugging Face; q/k/v and gate/up are fused for fewer, larger matmuls, and
`load_weights` maps checkpoint names onto the fused parameters through one table.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kernels.activation import silu_mul
from runtime.attention import backend_of
from runtime.config import ModelConfig
from runtime.context import get_forward_context
from runtime.errors import ModelLoadError
from runtime.formats import WeightFormat
from runtime.models.layers import PagedAttention, RMSNorm, RotaryEmbedding
from runtime.models.weights import check_state

# checkpoint suffix -> (our parameter suffix, shard index in the fused tensor)
STACKED_PARAMS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.rotary = rotary
        self.attn = PagedAttention(layer_index, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # q and k heads are adjacent in qkv: rotated together, one set of ops for both.
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads,
                                                         self.head_dim)
        (qk,) = self.rotary(positions, qk)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                pending: torch.Tensor | None) -> torch.Tensor:
        """x: [T, hidden], the residual stream, which this layer updates in place; `pending`:
        the previous layer's output not yet added to it (None for the first layer). Returns
        this layer's own, for the next layer (or the model) to add: each add is fused with
        the norm that follows it."""
        h = self.input_layernorm.add_and_norm(x, pending)
        h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(positions, h))
        return self.mlp(h)


class LlamaModel(nn.Module):
    # An attention backend that runs a fused decode step (runtime/attention/fused_decode.py)
    # may run a step in one call; False runs the Python layers (its twin) always.
    fused_decode = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        ctx = get_forward_context()
        backend = backend_of(ctx)
        if backend.runs_fused_decode:
            hidden = backend.run_fused_decode(self, x, positions, ctx.attn, ctx.kv_cache)
            if hidden is not None:
                return hidden
        pending = None
        for layer in self.layers:
            pending = layer(positions, x, pending)
        return x if pending is None else x.add_(pending)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states for every token: [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     quantization: WeightFormat | None = None) -> None:
        """Assign checkpoint tensors (HF names) to this meta-device module, fusing shards. With
        an fp8/int4 `quantization`, projections are built from their packed tensors as stored."""
        built: tuple[str, ...] = ()  # projections already built from packed tensors
        if quantization is not None and quantization.name in ("fp8", "int4"):
            from runtime.loader.quantized import load_quantized_projections

            tensors, built = load_quantized_projections(self, tensors, dtype, quantization)
        state: dict[str, torch.Tensor] = {}
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in tensors:
            if "rotary_emb.inv_freq" in name:
                continue
            target, shard = map_checkpoint_name(name)
            if shard is None:
                state[target] = tensor.to(dtype)
            else:
                shards.setdefault(target, {})[shard] = tensor.to(dtype)
        for target, parts in shards.items():
            want = 3 if "qkv" in target.rsplit(".", 2)[-2] else 2
            if sorted(parts) != list(range(want)):
                raise ModelLoadError(f"checkpoint lacks some of the shards of {target}",
                                     tensor=target)
            state[target] = torch.cat([parts[i] for i in range(want)], dim=0)
        if self.config.tie_word_embeddings or "lm_head.weight" not in state:
            if "model.embed_tokens.weight" in state:
                state["lm_head.weight"] = state["model.embed_tokens.weight"]
        expected = {k: v.shape for k, v in self.state_dict().items() if not k.startswith(built)}
        check_state(state, expected)
        self.load_state_dict(state, assign=True, strict=not built)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def map_checkpoint_name(name: str) -> tuple[str, int | None]:
    for suffix, (target, shard) in STACKED_PARAMS.items():
        if f".{suffix}.weight" in name:
            return name.replace(f".{suffix}.weight", f".{target}.weight"), shard
        if f".{suffix}.bias" in name:
            return name.replace(f".{suffix}.bias", f".{target}.bias"), shard
    return name, None
