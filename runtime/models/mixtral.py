"""Mixtral (Mistral AI's sparse MoE): Llama attention; every layer's MLP is a
`block_sparse_moe` of `num_local_experts` SwiGLU experts (w1 gate, w3 up, w2 down) under a
softmax router whose top-k weights are always renormalised."""

from __future__ import annotations

from torch import nn

from runtime.models.layers import RotaryEmbedding
from runtime.models.moe import RoutingConfig, SparseMoeBlock
from runtime.models.moe_decoder import GQAAttention, MoECausalLM
from runtime.models.weights import GQA_RULES, LAYER, Rule

EXPERT = LAYER + r"\.block_sparse_moe\.experts\.(?P<expert>\d+)"
CHECKPOINT_RULES = (
    *GQA_RULES,
    Rule(EXPERT + r"\.w1\.weight", r"\1.block_sparse_moe.experts.w13", 0, 2),
    Rule(EXPERT + r"\.w3\.weight", r"\1.block_sparse_moe.experts.w13", 1, 2),
    Rule(EXPERT + r"\.w2\.weight", r"\1.block_sparse_moe.experts.w2"),
)


class MixtralForCausalLM(MoECausalLM):
    CHECKPOINT_RULES = CHECKPOINT_RULES
    MLP_NAME = "block_sparse_moe"

    def build_attention(self, layer_index: int, rotary: RotaryEmbedding) -> nn.Module:
        return GQAAttention(self.config, layer_index, rotary, qkv_bias=False, o_bias=False,
                            qk_norm=False)

    def build_mlp(self, layer_index: int) -> SparseMoeBlock:
        routing = RoutingConfig(self.hf_int("num_local_experts"),
                                self.hf_int("num_experts_per_tok"), "softmax",
                                norm_topk_prob=True)
        return SparseMoeBlock(self.config.hidden_size, routing, self.config.intermediate_size)
