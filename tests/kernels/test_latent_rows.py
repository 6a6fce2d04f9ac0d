"""MLA latent page rows (`kernels/latent.py`): in fp8 / int8 pages the c_kv part is quantized
with one bf16 scale per token and the RoPE part kept as its bf16 bytes in the same row; float
pages hold the latent as it is."""

from __future__ import annotations

import pytest
import torch

from kernels import dequantize_latent_pages, dequantize_latent_rows, rope_view, store_latent
from kernels.latent import latent_split

LORA, ROPE, PAGES, PAGE = 32, 16, 5, 4


def _pages(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    width = LORA + (2 * ROPE if dtype in (torch.uint8, torch.int8) else ROPE)
    cache = torch.full((1, PAGES, PAGE, width), 7, dtype=dtype)  # poisoned
    scale = None
    if dtype in (torch.uint8, torch.int8):
        scale = torch.full((1, PAGES, PAGE), 3.0, dtype=torch.bfloat16)
    return cache, scale


def _latents(tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 1, LORA + ROPE, generator=g)
    x[..., LORA:] *= 40.0  # a RoPE part far larger than c_kv: one shared scale would crush c_kv
    return x


@pytest.mark.parametrize("dtype,step", [(torch.uint8, 16), (torch.int8, 200)])
def test_1_byte_rows_quantize_c_kv_alone_and_keep_rope_in_bf16_exactly(dtype, step):
    cache, scale = _pages(dtype)
    x = _latents(7)
    slots = torch.tensor([0, 5, 6, 11, 12, 18, 19])
    store_latent(x, cache, slots, scale)
    back = dequantize_latent_rows(cache[0].view(-1, cache.shape[-1])[slots],
                                  scale[0].view(-1)[slots], LORA + ROPE)
    assert torch.equal(back[:, LORA:], x[:, 0, LORA:].to(torch.bfloat16).float())
    c_kv = x[:, 0, :LORA]
    bound = c_kv.abs().amax(-1, keepdim=True) / step
    assert ((back[:, :LORA] - c_kv).abs() <= bound).all()
    assert not torch.equal(back[:, :LORA], c_kv)
    # the view the GPU kernel reads is the same bf16
    pe = rope_view(cache, LORA)[0].reshape(-1, ROPE)[slots]
    assert pe.dtype == torch.bfloat16 and torch.equal(pe.float(), back[:, LORA:])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_slot_minus_one_writes_nothing_and_other_rows_stay(dtype):
    cache, scale = _pages(dtype)
    before, scale_before = cache.clone(), scale.clone()
    store_latent(_latents(3), cache, torch.tensor([-1, 9, -1]), scale)
    changed = (cache != before).any(-1).view(-1).nonzero().view(-1).tolist()
    assert changed == [9]
    assert (scale != scale_before).view(-1).nonzero().view(-1).tolist() == [9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_rows_hold_the_latent_as_it_is(dtype):
    cache, scale = _pages(dtype)
    x = _latents(3)
    store_latent(x, cache, torch.tensor([1, 2, 17]), scale)
    assert torch.equal(cache[0].view(-1, LORA + ROPE)[[1, 2, 17]], x[:, 0].to(dtype))


def test_dequantized_pages_are_the_rows_of_the_asked_pages_in_order():
    cache, scale = _pages(torch.uint8)
    store_latent(_latents(PAGES * PAGE), cache, torch.arange(PAGES * PAGE), scale)
    ids = torch.tensor([3, 0])
    pages = dequantize_latent_pages(cache, scale, LORA + ROPE, ids)
    assert pages.shape == (1, 2, PAGE, LORA + ROPE)
    want = dequantize_latent_rows(cache[0, ids], scale[0, ids], LORA + ROPE)
    assert torch.equal(pages[0], want)


def test_row_widths_that_hold_no_such_latent_are_refused():
    assert latent_split(LORA + 2 * ROPE, LORA + ROPE, torch.uint8) == (LORA, ROPE)
    assert latent_split(LORA + ROPE, LORA + ROPE, torch.bfloat16) == (LORA + ROPE, 0)
    with pytest.raises(ValueError):
        latent_split(LORA + ROPE, LORA + ROPE, torch.int8)  # no room for a bf16 RoPE part
    with pytest.raises(ValueError):
        latent_split(LORA + 2 * ROPE, LORA + ROPE, torch.float32)
