"""DeepSeek-V3 (and Kimi-K2, which ships this architecture): multi-head latent attention over
latent KV pages (`mla.py`), dense MLPs in the first `first_k_dense_replace` layers, then
sigmoid group-limited routing with the score-correction bias, `routed_scaling_factor` and shared
experts (`moe.py`). Multi-token-prediction layers in the checkpoint are not served."""

from __future__ import annotations

from torch import nn

from runtime.errors import ModelLoadError
from runtime.models.glm4_moe import routed_block
from runtime.models.layers import RotaryEmbedding
from runtime.models.mla import DeepseekV3Attention, MLAConfig
from runtime.models.moe import SparseMoeBlock, SwiGLU
from runtime.models.moe_decoder import MoECausalLM
from runtime.models.weights import MLP_RULES

# Attention tensors keep their checkpoint names (q_a_proj, kv_a_proj_with_mqa, kv_b_proj ...).
CHECKPOINT_RULES = MLP_RULES


class DeepseekV3ForCausalLM(MoECausalLM):
    CHECKPOINT_RULES = CHECKPOINT_RULES

    def rotary_dim(self) -> int:
        if self.config.rope_scaling:  # yarn (the released checkpoints) changes scores' scale
            kind = self.config.rope_scaling.get("rope_type", self.config.rope_scaling.get("type"))
            raise ModelLoadError(f"DeepSeek-V3 rope scaling {kind!r} is not supported yet",
                                 field="rope_scaling")
        self.mla_config = MLAConfig.from_hf(self.hf, self.config.num_attention_heads)
        return self.mla_config.qk_rope_head_dim

    def build_attention(self, layer_index: int, rotary: RotaryEmbedding) -> nn.Module:
        return DeepseekV3Attention(self.config, self.mla_config, layer_index, rotary)

    def build_mlp(self, layer_index: int) -> SparseMoeBlock | SwiGLU:
        return routed_block(self, layer_index)
