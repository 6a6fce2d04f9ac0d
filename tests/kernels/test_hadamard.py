"""The Hadamard-rotated FP8 KV format: the transform, attention over rotated pages as its
definition says, close to exact float32 attention. (Whether rotation lowers the error is a
property of real activations, measured on the model by `ops/eval`,
ops/bench/RESULTS.md#kv-format-quality: on synthetic keys whose outlier channel is a constant
offset it does not.)"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import decode_e4m3_bits
from kernels.hadamard import fwht, hadamard_matrix, kv_rotation_applies
from kernels.paged_attention import ref_paged_decode_attention, ref_paged_prefill_attention
from kernels.store_kv import ref_store_kv


@pytest.mark.parametrize("dim", [2, 16, 64, 128])
def test_fwht_is_the_orthonormal_symmetric_sylvester_matrix(dim):
    h = hadamard_matrix(dim)
    torch.testing.assert_close(h @ h.T, torch.eye(dim), atol=1e-6, rtol=0)
    assert torch.equal(h, h.T)
    assert torch.equal(h.abs(), torch.full((dim, dim), dim**-0.5))
    x = torch.randn(3, 5, dim, generator=torch.Generator().manual_seed(dim))
    torch.testing.assert_close(fwht(x), x @ h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fwht(fwht(x)), x, atol=1e-5, rtol=1e-5)


def test_only_power_of_two_heads_are_rotated():
    assert [d for d in (1, 2, 48, 64, 80, 96, 128, 256) if kv_rotation_applies(d)] == [
        2, 64, 128, 256]
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.randn(2, 80))


def _pages(k, v, page_size, hadamard, dtype=torch.uint8):
    tokens, heads, dim = k.shape
    pages = -(-tokens // page_size) + 1
    shape = (heads, pages, page_size, dim)
    k_cache = torch.full(shape, 0x7E, dtype=dtype)
    v_cache = k_cache.clone()
    k_scale = v_scale = None
    if dtype in (torch.uint8, torch.int8):
        k_scale = torch.full(shape[:-1], 3.0, dtype=torch.bfloat16)
        v_scale = k_scale.clone()
    page_ids = torch.arange(1, pages)  # page 0 stays poisoned and unused
    slots = page_ids.repeat_interleave(page_size)[:tokens] * page_size + (
        torch.arange(tokens) % page_size)
    ref_store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale, hadamard)
    return k_cache, v_cache, k_scale, v_scale, page_ids


def _outlier_kv(tokens, heads, dim, gen):
    """Keys with one large channel per head (as real models' attention sinks have)."""
    k = torch.randn(tokens, heads, dim, generator=gen)
    k[:, :, 5] *= 8.0
    v = torch.randn(tokens, heads, dim, generator=gen)
    return k, v


def test_rotated_fp8_decode_is_attention_in_the_rotated_basis_rotated_back():
    """Definition check: scores from rotated q and rotated pages, output rotated back."""
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim, page_size = 70, 6, 2, 64, 16
    k, v = _outlier_kv(tokens, kv_heads, dim, gen)
    q = torch.randn(2, heads, dim, generator=gen)
    kc, vc, ks, vs, page_ids = _pages(k, v, page_size, True)
    table = torch.stack([page_ids, page_ids.flip(0)])
    lens = torch.tensor([tokens, 40])
    got = ref_paged_decode_attention(q, kc, vc, table, lens, dim**-0.5, ks, vs, hadamard=True)
    rows = lambda c, s: (decode_e4m3_bits(c) * s.float()[..., None])  # noqa: E731
    k_rot, v_rot = rows(kc, ks), rows(vc, vs)  # [kv_heads, pages, page_size, dim]
    for b in range(2):
        kb = k_rot[:, table[b]].reshape(kv_heads, -1, dim)[:, : lens[b]]
        vb = v_rot[:, table[b]].reshape(kv_heads, -1, dim)[:, : lens[b]]
        qb = fwht(q[b]).view(kv_heads, heads // kv_heads, dim)
        probs = torch.softmax(qb @ kb.transpose(1, 2) * dim**-0.5, dim=-1)
        want = fwht(probs @ vb).reshape(heads * dim)
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)


# e4m3 keeps 3 mantissa bits: a few % relative error per element, far less on the output;
# int8's 255 uniform levels over the rotated (near-Gaussian) row several times less again
@pytest.mark.parametrize("dtype,bound", [(torch.uint8, 0.05), (torch.int8, 0.01)],
                         ids=["fp8", "int8"])
def test_rotated_quantized_decode_stays_close_to_exact_float32_attention(dtype, bound):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim, page_size = 70, 6, 2, 64, 16
    k, v = torch.randn(2, tokens, kv_heads, dim, generator=gen).unbind(0)
    q = torch.randn(1, heads, dim, generator=gen)
    kc, vc, _, _, page_ids = _pages(k, v, page_size, False, torch.float32)
    exact = ref_paged_decode_attention(q, kc, vc, page_ids[None], torch.tensor([tokens]),
                                       dim**-0.5)
    kc, vc, ks, vs, page_ids = _pages(k, v, page_size, True, dtype)
    got = ref_paged_decode_attention(q, kc, vc, page_ids[None], torch.tensor([tokens]),
                                     dim**-0.5, ks, vs, hadamard=True)
    assert float((got - exact).norm() / exact.norm()) < bound


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8], ids=["fp8", "int8"])
def test_rotated_quantized_prefill_matches_the_same_pages_read_by_decode(dtype):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, dim, page_size = 37, 4, 2, 32, 8
    k, v = _outlier_kv(tokens, kv_heads, dim, gen)
    kc, vc, ks, vs, page_ids = _pages(k, v, page_size, True, dtype)
    q = torch.randn(tokens, heads, dim, generator=gen)
    prefill = ref_paged_prefill_attention(q, kc, vc, page_ids, tokens, None, dim**-0.5, ks, vs,
                                          hadamard=True)
    last = ref_paged_decode_attention(q[-1:], kc, vc, page_ids[None], torch.tensor([tokens]),
                                      dim**-0.5, ks, vs, hadamard=True)
    first = ref_paged_decode_attention(q[:1], kc, vc, page_ids[None], torch.tensor([1]),
                                       dim**-0.5, ks, vs, hadamard=True)
    torch.testing.assert_close(prefill[-1:], last, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prefill[:1], first, atol=1e-5, rtol=1e-5)
