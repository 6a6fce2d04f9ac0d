"""Tiny random mixture-of-experts checkpoints built by transformers' own config and model
classes (seeded), saved with `save_pretrained` beside the SmolLM2 tokenizer: one per family."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=512, initializer_range=0.1, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
# What each family's tiny config exercises (every one: 3 layers, hidden 64, 4 heads):
CONFIGS = {
    # softmax routing, always renormalised; every layer sparse; GQA 4/2
    "MixtralForCausalLM": ("MixtralConfig", dict(
        intermediate_size=96, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2)),
    # softmax + norm_topk_prob; a dense layer from mlp_only_layers; q/k norms
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(
        intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)),
    # sigmoid + correction bias, 2 of 4 groups, scaling 2.5, a shared expert, a dense first
    # layer, q/k/v biases, q/k norms, RoPE on half of each head
    "Glm4MoeForCausalLM": ("Glm4MoeConfig", dict(
        intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, attention_bias=True,
        use_qk_norm=True)),
    # MLA (q LoRA, interleaved RoPE) + DeepSeek-V3 routing as above
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", dict(
        intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)),
}


def build_tiny_moe(architecture: str, path: Path, tokenizer, seed: int = 0):
    """A random `architecture` model in float32, saved to `path`; returns the model. Norms,
    biases and routers' correction biases are randomised too (init leaves them at 1 / 0)."""
    import transformers

    config_class, kwargs = CONFIGS[architecture]
    config = getattr(transformers, config_class)(**COMMON, **kwargs)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
                elif name.endswith(".bias"):
                    param.copy_(0.1 * torch.randn_like(param))
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.05 * torch.randn_like(buffer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model
