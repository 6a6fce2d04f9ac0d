"""The Triton MLA decode kernel (kernels/triton/launch_mla.py) in Triton's interpreter against
the `torch` backend's MLA attention: `ref_paged_decode_attention` over the latent pages as both
K and V with the per-token scale for both, its first kv_lora_rank outputs (what
`runtime/models/mla.py`'s LatentPagedAttention computes). DeepSeek-V3's real 512 + 64 split
once with few tokens, scaled-down dims otherwise; bf16, fp8 and int8 pages with their
(non-unit) scales; the RoPE part under one scale with the row, its own scale, or bf16 in the
row's tail; ragged lengths across pages and splits, padded rows, random non-contiguous tables
over pools whose offsets pass 2**31 elements; outputs poisoned with NaN first.

Tolerance: |got - ref| <= 2e-2 + 1e-2 |ref| against the fp32 twin over the same codes and
scales (the paged-attention kernel tests' bound: bf16 probabilities and output).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_pools import DEVICE  # sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kernels.int8 import dequantize_kv, quantize_kv
from kernels.paged_attention import ref_paged_decode_attention
from kernels.triton.launch_mla import mla_decode
from tests.kernels.triton_pools import draw_pages, lazy_zeros, pool_pages

PAGE = 16
ATOL, RTOL = 2e-2, 1e-2
STORAGE = {"bf16": torch.bfloat16, "fp8": torch.uint8, "int8": torch.int8}


class LatentPool:
    """One MLA layer's latent pages [1, pages, PAGE, row] holding `lens` tokens per sequence.
    rope: "shared" (tessera's pages: one scale over the row), "own" (a second per-token scale
    for the RoPE part) or "bf16" (the RoPE part as bf16 bytes in the row's tail)."""

    def __init__(self, fmt: str, lora: int, rope: int, lens: list[int], gen: torch.Generator,
                 rope_mode: str = "shared", rope_ratio: float = 1.0) -> None:
        storage = STORAGE[fmt]
        self.quant = fmt != "bf16"
        self.lora, self.rope, self.mode = lora, rope, rope_mode
        bf16_tail = self.quant and rope_mode == "bf16"
        row = lora + (2 * rope if bf16_tail else rope)
        self.num_pages = pool_pages(1, PAGE, row)
        self.cache = lazy_zeros((1, self.num_pages, PAGE, row), storage)
        self.scale = self.rope_scale = None
        if self.quant:
            self.scale = lazy_zeros((1, self.num_pages, PAGE), torch.bfloat16)
        if self.quant and rope_mode == "own":
            self.rope_scale = lazy_zeros((1, self.num_pages, PAGE), torch.bfloat16)
        max_pages = -(-max(lens) // PAGE) + 1  # a stale extra column the kernel must not read
        table = draw_pages(self.num_pages, len(lens) * max_pages, gen).view(len(lens), max_pages)
        self.table, self.lens = table.to(DEVICE), torch.tensor(lens, device=DEVICE)
        slots = torch.cat([table[s, :].repeat_interleave(PAGE)[:n] * PAGE
                           + torch.arange(n) % PAGE for s, n in enumerate(lens)]).to(DEVICE)
        latent = torch.randn(slots.numel(), lora + rope, generator=gen)
        latent[:, lora:] *= rope_ratio
        self.latent = latent.to(DEVICE)
        self._store(slots)

    def _store(self, slots: torch.Tensor) -> None:
        rows = self.cache.view(-1, self.cache.shape[-1])
        x, lora = self.latent, self.lora
        if not self.quant:
            rows[slots] = x.to(rows.dtype)
            return
        scales = self.scale.view(-1)
        if self.mode == "shared":
            codes, s = quantize_kv(x[:, None], rows.dtype)
            rows[slots], scales[slots] = codes[:, 0], s[:, 0]
            return
        codes, s = quantize_kv(x[:, None, :lora], rows.dtype)
        rows[slots, :lora], scales[slots] = codes[:, 0], s[:, 0]
        if self.mode == "own":
            codes, s = quantize_kv(x[:, None, lora:], rows.dtype)
            rows[slots, lora:], self.rope_scale.view(-1)[slots] = codes[:, 0], s[:, 0]
        else:
            rows[slots, lora:] = x[:, lora:].to(torch.bfloat16).view(rows.dtype)

    def rope_args(self) -> dict:
        if self.mode == "bf16" and self.quant:
            return dict(rope_cache=self.cache[..., self.lora:].view(torch.bfloat16))
        return dict(rope_scale=self.rope_scale)

    def reference(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """The torch backend's MLA attention over these pages: K = V = the latent row with
        its scale; other RoPE formats are dequantized to fp32 pages first (only the pages the
        table names, renumbered)."""
        if self.mode == "shared" or not self.quant:
            cache, s, table = self.cache, self.scale, self.table
        else:
            used = self.table.reshape(-1).unique()
            cache, s = self._dequantized(used), None
            table = torch.searchsorted(used, self.table)
        out = ref_paged_decode_attention(q.float(), cache, cache, table, self.lens, scale, s, s)
        return out.view(q.shape)[..., : self.lora]

    def _dequantized(self, used: torch.Tensor) -> torch.Tensor:
        lat, lora = self.cache[0, used], self.lora
        nope = dequantize_kv(lat[..., :lora], self.scale[0, used])
        if self.mode == "own":
            pe = dequantize_kv(lat[..., lora:], self.rope_scale[0, used])
        else:
            pe = lat[..., lora:].view(torch.bfloat16).float()
        return torch.cat((nope, pe), dim=-1)[None]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not got.isnan().any(), "a row was never written (poisoned NaN left)"
    err = (got.float() - want).abs()
    bound = ATOL + RTOL * want.abs()
    assert bool((err <= bound).all()), f"max |err| {err.max():.3g}, worst excess " \
        f"{(err - bound).max():.3g}"


def _decode(pool: LatentPool, q: torch.Tensor, scale: float, splits: int,
            lens: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.full((*q.shape[:2], pool.lora), float("nan"), dtype=q.dtype, device=DEVICE)
    return mla_decode(q, pool.cache, pool.table, pool.lens if lens is None else lens, scale,
                      pool.lora, latent_scale=pool.scale, **pool.rope_args(),
                      num_splits=splits, out=out)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
def test_deepseek_v3_latent_512_plus_rope_64_matches_the_torch_backend(fmt):
    gen = torch.Generator().manual_seed(len(fmt))
    lens = [1, 19, 40]  # one token, across a page boundary, across pages and splits
    pool = LatentPool(fmt, 512, 64, lens, gen)
    q = torch.randn(len(lens), 16, 576, generator=gen).to(DEVICE, torch.bfloat16)
    scale = 192**-0.5  # DeepSeek-V3's qk_head_dim (128 + 64) ** -0.5
    want = pool.reference(q, scale)
    for splits in (1, 4):
        assert_close(_decode(pool, q, scale, splits), want)
    if pool.quant:  # scales are amax / 448 or / 127: a kernel that dropped them cannot pass
        ones = torch.ones_like(pool.scale)
        unscaled = ref_paged_decode_attention(q.float(), pool.cache, pool.cache, pool.table,
                                              pool.lens, scale, ones, ones)
        assert (unscaled.view(q.shape)[..., :512] - want).abs().max() > 20 * ATOL


@pytest.mark.parametrize(("fmt", "rope_mode", "heads"), [
    ("bf16", "shared", 20), ("fp8", "shared", 16), ("int8", "shared", 5),
    ("fp8", "own", 16), ("int8", "own", 20), ("fp8", "bf16", 16), ("int8", "bf16", 3),
])
def test_scaled_down_latents_in_every_rope_format_match_the_reference(fmt, rope_mode, heads):
    # heads not a multiple of the 16-head block: masked rows; 16 splits of a 1-token context:
    # empty splits; a zero-length padded row outputs zeros
    gen = torch.Generator().manual_seed(heads + len(rope_mode))
    lens = [1, 16, 47, 161]
    pool = LatentPool(fmt, 64, 16, lens, gen, rope_mode, rope_ratio=0.25)
    q = torch.randn(len(lens), heads, 80, generator=gen).to(DEVICE, torch.bfloat16)
    want = pool.reference(q, 0.2)
    outs = {s: _decode(pool, q, 0.2, s) for s in (1, 16)}
    for got in outs.values():
        assert_close(got, want)
    assert (outs[1].float() - outs[16].float()).abs().max() <= 2e-2
    padded = pool.lens.clone()
    padded[2] = 0
    got = _decode(pool, q, 0.2, 4, padded)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    assert_close(got[[0, 1, 3]], want[[0, 1, 3]])


def _rope_score_error(fmt: str, rope_mode: str, ratio: float) -> float:
    """Relative error of the RoPE part's scores q_pe . k_pe through a page format, for
    N(0, 1) latents with 4 outlier channels (8x) whose RoPE part is `ratio` times as large
    (512 + 64 dims)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1, 576, generator=gen)
    x[..., :4] *= 8
    x[..., 512:] *= ratio
    q_pe = torch.randn(16, 64, generator=gen)
    storage = STORAGE[fmt]
    if rope_mode == "shared":
        k_pe = dequantize_kv(*quantize_kv(x, storage))[:, 0, 512:]
    elif rope_mode == "own":
        k_pe = dequantize_kv(*quantize_kv(x[..., 512:], storage))[:, 0]
    else:
        k_pe = x[:, 0, 512:].to(torch.bfloat16).float()
    exact = q_pe @ x[:, 0, 512:].T
    return float((q_pe @ k_pe.T - exact).norm() / exact.norm())


def test_one_int8_scale_over_the_row_loses_a_small_rope_part_its_own_scale_keeps_it():
    # the measurement behind the recommended page format (docs/DESIGN.md, MLA decode)
    assert _rope_score_error("int8", "shared", 0.1) > 0.2
    assert _rope_score_error("int8", "own", 0.1) < 0.01
    # e4m3's error is relative: its own scale buys nothing, bf16 does
    assert _rope_score_error("fp8", "own", 0.1) > 0.02
    assert _rope_score_error("fp8", "bf16", 0.1) < 0.003


def test_launcher_refuses_one_byte_latent_pages_without_their_scales():
    gen = torch.Generator().manual_seed(1)
    pool = LatentPool("fp8", 64, 16, [5], gen)
    q = torch.randn(1, 4, 80, generator=gen).to(DEVICE, torch.bfloat16)
    with pytest.raises(AssertionError, match="need their per-token scales"):
        mla_decode(q, pool.cache, pool.table, pool.lens, 0.2, 64)
