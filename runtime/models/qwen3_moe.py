"""Qwen3-MoE: GQA attention with per-head RMSNorm of q and k; sparse layers every
`decoder_sparse_step` layers except `mlp_only_layers`, softmax routing with optional top-k
renormalisation (`norm_topk_prob`), no shared experts."""

from __future__ import annotations

from torch import nn

from runtime.models.layers import RotaryEmbedding
from runtime.models.moe import RoutingConfig, SparseMoeBlock, SwiGLU
from runtime.models.moe_decoder import GQAAttention, MoECausalLM
from runtime.models.weights import GQA_RULES, MLP_RULES

CHECKPOINT_RULES = (*GQA_RULES, *MLP_RULES)


class Qwen3MoeForCausalLM(MoECausalLM):
    CHECKPOINT_RULES = CHECKPOINT_RULES

    def build_attention(self, layer_index: int, rotary: RotaryEmbedding) -> nn.Module:
        bias = self.config.attention_bias
        return GQAAttention(self.config, layer_index, rotary, qkv_bias=bias, o_bias=bias,
                            qk_norm=True)

    def is_sparse(self, layer_index: int) -> bool:
        experts = self.hf_int("num_experts", "num_local_experts", default=0)
        step = self.hf_int("decoder_sparse_step", default=1)
        dense = self.hf.get("mlp_only_layers") or []
        return layer_index not in dense and experts > 0 and (layer_index + 1) % step == 0

    def build_mlp(self, layer_index: int) -> SparseMoeBlock | SwiGLU:
        if not self.is_sparse(layer_index):
            return SwiGLU(self.config.hidden_size, self.config.intermediate_size)
        routing = RoutingConfig(self.hf_int("num_experts", "num_local_experts"),
                                self.hf_int("num_experts_per_tok"), "softmax",
                                norm_topk_prob=bool(self.hf.get("norm_topk_prob", False)))
        return SparseMoeBlock(self.config.hidden_size, routing,
                              self.hf_int("moe_intermediate_size"))
