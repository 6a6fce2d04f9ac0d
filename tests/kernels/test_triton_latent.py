"""The Triton latent-row store and varlen MLA attention (kernels/triton/launch_mla.py) in
Triton's interpreter: the store writes `kernels/latent.py`'s row bit for bit as the torch twin
(fp8 / int8: c_kv codes and scale, the RoPE part bf16; bf16 pages: the latent), slot -1
nowhere; `mla_attention` gives every query token of a mixed batch (a decode, a prefill from 0,
an extend after cached tokens) the fp32 twin's attention over its own causal context in
dequantized pages, within the MLA kernel tests' bound (2e-2 + 1e-2 |ref|)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_pools import DEVICE  # sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kernels.latent import dequantize_latent_pages, ref_store_latent
from kernels.paged_attention import ref_paged_decode_attention
from kernels.triton.launch_mla import mla_attention, store_latent

PAGE, PAGES = 16, 12
STORAGE = {"bf16": torch.bfloat16, "fp8": torch.uint8, "int8": torch.int8}


def _pool(fmt: str, lora: int, rope: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    quant = fmt != "bf16"
    width = lora + (2 * rope if quant else rope)
    cache = torch.full((1, PAGES, PAGE, width), 5, dtype=STORAGE[fmt], device=DEVICE)
    scale = None
    if quant:
        scale = torch.full((1, PAGES, PAGE), 7.0, dtype=torch.bfloat16, device=DEVICE)
    return cache, scale


def _latents(tokens: int, lora: int, rope: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 1, lora + rope, generator=g)
    x[..., lora:] *= 8.0
    return x.to(DEVICE)


@pytest.mark.parametrize("fmt,lora,rope,tokens", [("bf16", 32, 16, 37), ("fp8", 32, 16, 37),
                                                   ("int8", 32, 16, 37), ("int8", 512, 64, 5)])
def test_latent_store_writes_the_twins_rows_bit_for_bit(fmt, lora, rope, tokens):
    cache, scale = _pool(fmt, lora, rope)
    want, want_scale = cache.clone(), None if scale is None else scale.clone()
    x = _latents(tokens, lora, rope)
    slots = torch.randperm(PAGES * PAGE, generator=torch.Generator().manual_seed(1))[:tokens]
    slots[3] = -1
    slots = slots.to(DEVICE)
    store_latent(x, cache, slots, scale)
    ref_store_latent(x, want, slots, want_scale)
    assert torch.equal(cache.view(torch.uint8) if fmt != "bf16" else cache,
                       want.view(torch.uint8) if fmt != "bf16" else want)
    if scale is not None:
        assert torch.equal(scale, want_scale)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_varlen_mla_gives_each_token_the_twin_over_its_own_causal_context(fmt):
    lora, rope, heads = 32, 16, 4
    cache, scale = _pool(fmt, lora, rope)
    # a decode (40 cached), a prefill from 0 (19), an extend (13 new after 21 cached)
    seq_lens, q_lens = [40, 19, 34], [1, 19, 13]
    table = torch.randperm(PAGES, generator=torch.Generator().manual_seed(2))[:9].view(3, 3)
    for s, n in enumerate(seq_lens):
        slots = table[s].repeat_interleave(PAGE)[:n] * PAGE + torch.arange(n) % PAGE
        ref_store_latent(_latents(n, lora, rope, seed=10 + s), cache, slots.to(DEVICE), scale)
    q = _latents(sum(q_lens), lora, rope, seed=3).expand(-1, heads, -1) * torch.linspace(
        0.5, 1.5, heads, device=DEVICE)[None, :, None]
    cu = torch.tensor([0, 1, 20, 33], dtype=torch.int32, device=DEVICE)
    got = mla_attention(q.contiguous(), cache, scale, table.to(DEVICE),
                        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), cu, 0.2,
                        lora, max_seqlen_q=19)
    if scale is None:
        pages, ids = cache.float(), table
    else:
        used = torch.arange(PAGES)
        pages, ids = dequantize_latent_pages(cache, scale, lora + rope, used.to(DEVICE)), table
    rows = [(s, seq_lens[s] - q_lens[s] + i + 1) for s in range(3) for i in range(q_lens[s])]
    want = ref_paged_decode_attention(
        q.float(), pages, pages, ids[[s for s, _ in rows]].to(DEVICE),
        torch.tensor([n for _, n in rows], device=DEVICE), 0.2).view(q.shape)[..., :lora]
    assert got.shape == (33, heads, lora)
    assert ((got.float() - want).abs() <= 2e-2 + 1e-2 * want.abs()).all()
