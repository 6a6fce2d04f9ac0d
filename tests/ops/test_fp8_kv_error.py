"""The 1-byte KV error analysis' fake quantization is the served formats' round trip."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import ref_paged_prefill_attention
from kernels.store_kv import ref_store_kv
from ops.bench.fp8_kv_error import STORAGE, fake_kv, layer_errors


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_fake_kv_gives_attention_what_the_served_pages_give(fmt):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim, page = 20, 6, 2, 32, 8
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen) + 3
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    shift = k.mean(0)
    k_div = torch.rand(kv_heads, dim, generator=gen) + 0.5
    v_div = torch.rand(kv_heads, dim, generator=gen) + 0.5
    pages = [torch.zeros(kv_heads, 3, page, dim, dtype=STORAGE[fmt]) for _ in range(2)]
    scales = [torch.zeros(kv_heads, 3, page, dtype=torch.bfloat16) for _ in range(2)]
    ref_store_kv(k, v, *pages, torch.arange(tokens), *scales, True, shift, k_div, v_div)
    served = ref_paged_prefill_attention(q, *pages, torch.arange(3), tokens, None, dim**-0.5,
                                         *scales, True, k_div, v_div)
    kq, vq = fake_kv(k, fmt, True, shift, k_div), fake_kv(v, fmt, True, None, v_div)
    faked = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kq.transpose(0, 1), vq.transpose(0, 1), is_causal=True,
        enable_gqa=True, scale=dim**-0.5).transpose(0, 1).reshape(tokens, -1)
    torch.testing.assert_close(served, faked, atol=1e-4, rtol=1e-4)


def test_served_int8_errs_less_than_served_fp8_on_random_activations():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(64, 6, 32, generator=gen)
    k = torch.randn(64, 2, 32, generator=gen) * torch.linspace(0.2, 5, 32)
    v = torch.randn(64, 2, 32, generator=gen)
    smooth = (k.mean(0), torch.ones(2, 32), torch.ones(2, 32))
    out = layer_errors(q, k, v, smooth)
    assert out["int8_kv"] < out["fp8_kv"] < out["fp8plain_kv"] * 1.5
    assert out["int8_energy"].shape == (32,)
