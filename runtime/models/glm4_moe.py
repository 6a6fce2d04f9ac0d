"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): GQA attention with q/k/v biases, optional per-head
q/k RMSNorm (`use_qk_norm`) and RoPE on the first `partial_rotary_factor` of each head; dense
MLPs in the first `first_k_dense_replace` layers, then sigmoid group-limited routing with the
score-correction bias (DeepSeek-V3's) plus shared experts."""

from __future__ import annotations

from torch import nn

from runtime.models.layers import RotaryEmbedding
from runtime.models.moe import RoutingConfig, SparseMoeBlock, SwiGLU
from runtime.models.moe_decoder import GQAAttention, MoECausalLM
from runtime.models.weights import GQA_RULES, MLP_RULES

CHECKPOINT_RULES = (*GQA_RULES, *MLP_RULES)


def routed_block(model: MoECausalLM, layer_index: int) -> SparseMoeBlock | SwiGLU:
    """DeepSeek-V3-style layer MLP: dense before `first_k_dense_replace`, then routed experts
    plus `n_shared_experts` shared ones (GLM-4.5 and DeepSeek-V3 / Kimi-K2 alike)."""
    hidden = model.config.hidden_size
    if layer_index < model.hf_int("first_k_dense_replace", default=0):
        return SwiGLU(hidden, model.config.intermediate_size)
    inter = model.hf_int("moe_intermediate_size")
    shared = model.hf_int("n_shared_experts", default=0) * inter
    return SparseMoeBlock(hidden, RoutingConfig.sigmoid_grouped(model.hf), inter, shared)


class Glm4MoeForCausalLM(MoECausalLM):
    CHECKPOINT_RULES = CHECKPOINT_RULES

    def rotary_dim(self) -> int:
        params = self.hf.get("rope_parameters") or {}
        factor = params.get("partial_rotary_factor", self.hf.get("partial_rotary_factor", 0.5))
        return int(self.config.head_dim * float(factor))

    def build_attention(self, layer_index: int, rotary: RotaryEmbedding) -> nn.Module:
        return GQAAttention(self.config, layer_index, rotary,
                            qkv_bias=self.config.attention_bias, o_bias=False,
                            qk_norm=bool(self.hf.get("use_qk_norm", False)))

    def build_mlp(self, layer_index: int) -> SparseMoeBlock | SwiGLU:
        return routed_block(self, layer_index)
