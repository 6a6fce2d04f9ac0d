"""Paged KV in fp32 / bf16 / fp8 / int8 pages: store, decode and prefill attention against
references."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels import (
    dequantize_fp8_kv,
    kv_fp8,
    paged_decode_attention,
    paged_prefill_attention,
    ref_paged_decode_attention,
    store_kv,
)
from kernels.cpu_ops import native
from kernels.int8 import dequantize_kv
from kernels.kv_fp8 import ref_gather_e4m3_rows
from kernels.ops import twin_ops

HEADS, KV_HEADS, DIM, PAGE = 6, 2, 64, 16


def _pages(num_pages: int, fmt: str) -> tuple[torch.Tensor, ...]:
    shape = (KV_HEADS, num_pages, PAGE, DIM)
    storage = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.uint8,
               "int8": torch.int8}[fmt]
    quantized = fmt in ("fp8", "int8")
    # NOTE: poisoned, not zeroed: a slot the kernels forget to write shows up as garbage.
    k = torch.full(shape, 0x7E if quantized else 1e4, dtype=storage)
    v = k.clone()
    if not quantized:
        return k, v, None, None
    return k, v, torch.full(shape[:-1], 3.0, dtype=torch.bfloat16), \
        torch.full(shape[:-1], 3.0, dtype=torch.bfloat16)


def _fill(lengths: list[int], fmt: str, seed: int = 0):
    """Write random K/V for sequences of these lengths into shuffled pages; return the pages,
    per-sequence page tables and the fp32 K/V that was written."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // PAGE) for n in lengths]
    num_pages = sum(per_seq) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()
    k_cache, v_cache, k_scale, v_scale = _pages(num_pages, fmt)
    tables, written = [], []
    for n, p in zip(lengths, per_seq, strict=True):
        ids = [order.pop() for _ in range(p)]
        slots = torch.tensor([ids[i // PAGE] * PAGE + i % PAGE for i in range(n)])
        k = torch.randn(n, KV_HEADS, DIM, generator=gen) * 2
        v = torch.randn(n, KV_HEADS, DIM, generator=gen)
        store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        tables.append(ids)
        written.append((k, v))
    return (k_cache, v_cache, k_scale, v_scale), tables, written


def _decode_inputs(lengths: list[int], tables: list[list[int]]):
    max_pages = max(len(t) for t in tables)
    table = torch.zeros(len(tables), max_pages, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    return table, torch.tensor(lengths)


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q: [heads, dim]; k, v: [L, kv_heads, dim] -> [heads * dim]
    kk = k.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    probs = torch.softmax((q[:, None] @ kk.transpose(-1, -2)) * DIM**-0.5, dim=-1)
    return (probs @ vv).reshape(-1)


# int8 keeps 255 uniform levels over a row's amax: ~1/2 of a level (amax / 254) per element,
# ~8x finer than e4m3's 3 mantissa bits near amax
@pytest.mark.parametrize("fmt,tol", [("fp32", 1e-5), ("bf16", 3e-2), ("fp8", 1.5e-1),
                                     ("int8", 5e-2)])
@pytest.mark.parametrize("lengths", [[1], [5, 16, 17], [33, 7, 64, 100]])
def test_decode_attention_matches_dense_attention_within_format_error(fmt, tol, lengths):
    cache, tables, written = _fill(lengths, fmt)
    table, lens = _decode_inputs(lengths, tables)
    q = torch.randn(len(lengths), HEADS, DIM)
    out = paged_decode_attention(q, cache[0], cache[1], table, lens, DIM**-0.5, *cache[2:])
    assert torch.isfinite(out).all()
    for i, (k, v) in enumerate(written):
        want = _dense_attention(q[i], k, v)
        torch.testing.assert_close(out[i], want, atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("lengths", [[3, 40], [17, 1, 90]])
def test_quantized_decode_equals_attention_over_dequantized_pages(fmt, lengths):
    """Folding the per-token scales into scores and probabilities is exact up to rounding."""
    cache, tables, _ = _fill(lengths, fmt, seed=1)
    table, lens = _decode_inputs(lengths, tables)
    q = torch.randn(len(lengths), HEADS, DIM)
    out = paged_decode_attention(q, cache[0], cache[1], table, lens, DIM**-0.5, *cache[2:])
    k_deq, v_deq = dequantize_kv(cache[0], cache[2]), dequantize_kv(cache[1], cache[3])
    if fmt == "fp8":  # the e4m3 helpers agree with the format-generic one
        assert torch.equal(k_deq, dequantize_fp8_kv(cache[0].view(torch.float8_e4m3fn),
                                                    cache[2]))
    want = ref_paged_decode_attention(q, k_deq, v_deq, table, lens, DIM**-0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt,tol", [("fp32", 1e-5), ("bf16", 3e-2), ("fp8", 1.5e-1),
                                     ("int8", 5e-2)])
def test_prefill_attention_with_history_matches_dense(fmt, tol):
    n, start = 45, 20  # the chunk is tokens [20, 45); the first 20 are history
    cache, tables, written = _fill([n], fmt, seed=2)
    k, v = written[0]
    q = torch.randn(n - start, HEADS, DIM)
    q_pos = torch.arange(start, n)[:, None]
    mask = torch.arange(n)[None] <= q_pos
    out = paged_prefill_attention(q, cache[0], cache[1], torch.tensor(tables[0]), n, mask,
                                  DIM**-0.5, *cache[2:])
    for i in range(n - start):
        want = _dense_attention(q[i], k[: start + i + 1], v[: start + i + 1])
        torch.testing.assert_close(out[i], want, atol=tol, rtol=tol)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_every_e4m3_gather_path_is_bit_exact_for_every_finite_byte(path, monkeypatch):
    if path == "native":
        if shutil.which("g++") is None:
            pytest.skip("no C++ compiler on this machine: the C++ op cannot be built")
        assert native() is not None, "the C++ op failed to build (see the log)"
    else:
        monkeypatch.setattr(kv_fp8, "native_ops", twin_ops)
    finite = [b for b in range(256) if b & 0x7F != 0x7F]  # 0x7F / 0xFF are NaN in e4m3fn
    flat = torch.tensor(finite * 3, dtype=torch.uint8).view(6, -1)
    rows = torch.tensor([5, 0, 3, 3])
    want = flat.index_select(0, rows).view(torch.float8_e4m3fn).float()
    assert torch.equal(ref_gather_e4m3_rows(flat, rows), want)
    assert torch.equal(kv_fp8.gather_e4m3_rows(flat, rows), want)


@pytest.mark.parametrize("fmt,rel", [("fp8", 0.07), ("int8", 0.01)])
def test_quantized_pages_survive_outliers_nan_and_inf(fmt, rel):
    cache, tables, _ = _fill([20], fmt, seed=3)
    k = torch.randn(4, KV_HEADS, DIM)
    k[0, 0, 0] = 3e4  # an outlier 10^4 x the rest
    k[1, 1, :] = 0.0
    k[2, 0, 5] = float("inf")
    k[3, 1, 7] = float("nan")
    slots = torch.tensor([tables[0][0] * PAGE + i for i in range(4)])
    store_kv(k, k.clone(), cache[0], cache[1], slots, cache[2], cache[3])
    for data, scale in ((cache[0], cache[2]), (cache[1], cache[3])):
        deq = dequantize_kv(data, scale)
        assert torch.isfinite(deq).all()
        got = deq[:, tables[0][0], :4].transpose(0, 1)  # [4, kv_heads, dim]
        assert got[0, 0, 0] == pytest.approx(3e4, rel=rel)
        assert torch.equal(got[1, 1], torch.zeros(DIM))
    table, lens = _decode_inputs([20], tables)
    out = paged_decode_attention(torch.randn(1, HEADS, DIM), cache[0], cache[1], table, lens,
                                 DIM**-0.5, *cache[2:])
    assert torch.isfinite(out).all()
