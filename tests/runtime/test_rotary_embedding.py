"""RotaryEmbedding's rotation, x * cat(cos, cos) + cat(x2, x1) * cat(-sin, sin), is bit for bit
the rotate-half formula cat(x1 cos - x2 sin, x2 cos + x1 sin) it replaced (the fused decode
step computes that one: tests/runtime/test_fused_decode.py holds the two paths to one bit)."""

from __future__ import annotations

import pytest
import torch

from runtime.config import ModelConfig
from runtime.models.layers import RotaryEmbedding


def _config(head_dim: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=4 * head_dim,
                       intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=4096,
                       tie_word_embeddings=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 128])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_rotation_is_the_rotate_half_formula_bit_for_bit(dtype: torch.dtype, tokens: int,
                                                         head_dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens * head_dim)
    rotary = RotaryEmbedding(_config(head_dim))
    heads = 6
    # a strided view, as the model's q/k heads are a slice of the fused qkv output
    qkv = (torch.randn(tokens, (heads + 2) * head_dim, generator=gen) * 4).to(dtype)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    (got,) = rotary(positions, x)
    cos, sin = rotary.cos_sin(positions, dtype)
    half = head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)


def test_the_wide_table_follows_the_step() -> None:
    rotary = RotaryEmbedding(_config(64))
    a, b = torch.arange(5), torch.arange(5, 10)
    cos_a, _ = rotary.wide_cos_sin(a, torch.float32)
    cos_b, sin_b = rotary.wide_cos_sin(b, torch.float32)
    assert not torch.equal(cos_a, cos_b)
    cos, sin = rotary.cos_sin(b, torch.float32)
    assert torch.equal(cos_b, torch.cat((cos, cos), -1))
    assert torch.equal(sin_b, torch.cat((-sin, sin), -1))
