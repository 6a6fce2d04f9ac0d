"""The C++ CPU ops against their torch twins: sizes swept, random pages, poisoned outputs."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels import cpu_ops
from kernels.paged_attention import ref_paged_decode_attention
from kernels.store_kv import ref_store_kv

STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "fp8": torch.uint8, "int8": torch.int8}
QUANTIZED = ("fp8", "int8")  # 1-byte pages with a bf16 scale per (token, head)


@pytest.fixture(scope="module")
def ops():
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the CPU ops cannot be built")
    built = cpu_ops.native()
    assert built is not None, "the CPU ops failed to build (see the log)"
    return built


def _cache(fmt: str, kv_heads: int, pages: int, page_size: int, dim: int):
    shape = (kv_heads, pages, page_size, dim)
    poison = 0x7E if fmt in QUANTIZED else 1e4  # a slot nobody wrote shows up as garbage
    k = torch.full(shape, poison, dtype=STORAGE[fmt])
    scales = (None, None)
    if fmt in QUANTIZED:
        scales = (torch.full(shape[:-1], 3.0, dtype=torch.bfloat16),
                  torch.full(shape[:-1], 3.0, dtype=torch.bfloat16))
    return k, k.clone(), *scales


def _filled(fmt, lengths, kv_heads, page_size, dim, seed, hadamard=False):
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // page_size) for n in lengths]
    pages = sum(per_seq) + 2
    order = torch.randperm(pages, generator=gen).tolist()
    k_cache, v_cache, k_scale, v_scale = _cache(fmt, kv_heads, pages, page_size, dim)
    table = torch.zeros(len(lengths), max(per_seq), dtype=torch.long)
    for i, (n, p) in enumerate(zip(lengths, per_seq, strict=True)):
        ids = [order.pop() for _ in range(p)]
        table[i, :p] = torch.tensor(ids)
        slots = torch.tensor([ids[t // page_size] * page_size + t % page_size for t in range(n)])
        k = torch.randn(n, kv_heads, dim, generator=gen) * 3
        v = torch.randn(n, kv_heads, dim, generator=gen)
        ref_store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale, hadamard)
    return (k_cache, v_cache, k_scale, v_scale), table, gen


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "fp8", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim,page_size", [
    (9, 3, 64, 16), (4, 4, 32, 8), (6, 1, 80, 16), (12, 2, 17, 5), (2, 2, 128, 1),
])
@pytest.mark.parametrize("lengths", [[1], [16, 17, 3], [100, 1, 33, 64, 15]])
def test_decode_op_matches_torch_twin(ops, fmt, heads, kv_heads, dim, page_size, lengths):
    cache, table, gen = _filled(fmt, lengths, kv_heads, page_size, dim, seed=len(lengths) + dim)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    lens = torch.tensor(lengths)
    got = ops.paged_decode_attention(q, cache[0], cache[1], table, lens, dim**-0.5, *cache[2:])
    want = ref_paged_decode_attention(q, cache[0], cache[1], table, lens, dim**-0.5, *cache[2:])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("heads,kv_heads,dim,page_size", [(9, 3, 64, 16), (2, 2, 128, 1),
                                                        (4, 1, 16, 5)])
@pytest.mark.parametrize("lengths", [[1], [100, 1, 33, 64, 15]])
def test_decode_op_reads_hadamard_rotated_pages_as_its_twin(ops, fmt, heads, kv_heads, dim,
                                                             page_size, lengths):
    cache, table, gen = _filled(fmt, lengths, kv_heads, page_size, dim, seed=dim,
                                hadamard=True)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    lens = torch.tensor(lengths)
    args = (q, cache[0], cache[1], table, lens, dim**-0.5, *cache[2:])
    got = ops.paged_decode_attention(*args, hadamard=True)
    want = ref_paged_decode_attention(*args, hadamard=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(got, ops.paged_decode_attention(*args), atol=1e-2)


def test_decode_op_attends_only_to_each_sequences_own_context(ops):
    """Padding slots of a shorter sequence hold another sequence's KV: it must not be read."""
    cache, table, gen = _filled("bf16", [40, 5], 3, 16, 64, seed=7)
    table[1, 1:] = table[0, 1:]  # the short sequence's unused table entries point at live pages
    q = torch.randn(2, 9, 64, generator=gen)
    lens = torch.tensor([40, 5])
    alone = ops.paged_decode_attention(q[1:], cache[0], cache[1], table[1:, :1], lens[1:],
                                       0.125, None, None)
    both = ops.paged_decode_attention(q, cache[0], cache[1], table, lens, 0.125, None, None)
    torch.testing.assert_close(both[1:], alone, atol=0, rtol=0)


@pytest.mark.parametrize("bad", ["page_out_of_range", "negative_page", "zero_length",
                                 "length_past_table", "fp8_without_scales",
                                 "int8_without_scales"])
def test_decode_op_refuses_bad_input_with_a_clear_error(ops, bad):
    fmt = bad.split("_")[0] if bad.endswith("without_scales") else "bf16"
    cache, table, gen = _filled(fmt, [20, 9], 3, 16, 64, seed=3)
    lens = torch.tensor([20, 9])
    q = torch.randn(2, 9, 64, generator=gen)
    scales = cache[2:]
    if bad == "page_out_of_range":
        table[0, 1] = cache[0].shape[1]
    elif bad == "negative_page":
        table[1, 0] = -1
    elif bad == "zero_length":
        lens[1] = 0
    elif bad == "length_past_table":
        lens[0] = table.shape[1] * 16 + 1
    else:
        scales = (None, None)
    message = {"page_out_of_range": "page id out of range", "negative_page": "page id out of range",
               "zero_length": "context length", "length_past_table": "context length",
               "fp8_without_scales": "need k_scale", "int8_without_scales": "need k_scale"}[bad]
    with pytest.raises(RuntimeError, match=message):
        ops.paged_decode_attention(q, cache[0], cache[1], table, lens, 0.125, *scales)


def _awkward_rows(tokens: int, heads: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    magnitudes = torch.logspace(-6, 4, tokens)[:, None, None]
    x = torch.randn(tokens, heads, dim, generator=gen) * magnitudes
    x[0, 0, 3] = 3e4  # an outlier
    x[1 % tokens, -1] = 0.0  # an all-zero row
    x[2 % tokens, 0, 1] = float("inf")
    x[3 % tokens, -1, 2] = float("-inf")
    x[4 % tokens, 0, 5] = float("nan")
    x[5 % tokens, -1] = 1e-30  # scale below the 1e-12 floor
    return x


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "fp8", "int8"])
@pytest.mark.parametrize("tokens,heads,dim,page_size", [(1, 1, 64, 16), (7, 3, 64, 16),
                                                        (33, 2, 17, 5), (64, 4, 128, 8)])
def test_store_op_writes_the_torch_twins_bytes(ops, fmt, tokens, heads, dim, page_size):
    gen = torch.Generator().manual_seed(tokens * dim)
    pages = -(-tokens // page_size) * 2 + 1
    x = _awkward_rows(tokens, heads, dim, gen)
    if fmt not in QUANTIZED:  # casts keep NaN/inf; only the quantized formats map them
        x = torch.nan_to_num(x, posinf=1e4, neginf=-1e4)
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens]
    got = _cache(fmt, heads, pages, page_size, dim)
    want = _cache(fmt, heads, pages, page_size, dim)
    ops.store_kv_rows(x, got[0], slots, got[2])
    ref_store_kv(x, x.clone(), want[0], want[1], slots, want[2], want[3])
    assert torch.equal(got[0], want[0])
    if fmt in QUANTIZED:
        assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("tokens,heads,dim,page_size", [(1, 1, 64, 16), (7, 3, 64, 16),
                                                        (33, 2, 16, 5), (64, 4, 128, 8)])
def test_store_op_writes_the_twins_bytes_for_hadamard_rotated_rows(ops, fmt, tokens, heads, dim,
                                                                    page_size):
    gen = torch.Generator().manual_seed(tokens + dim)
    pages = -(-tokens // page_size) * 2 + 1
    x = _awkward_rows(tokens, heads, dim, gen)
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens]
    got = _cache(fmt, heads, pages, page_size, dim)
    want = _cache(fmt, heads, pages, page_size, dim)
    ops.store_kv_rows(x, got[0], slots, got[2], hadamard=True)
    ref_store_kv(x, x.clone(), want[0], want[1], slots, want[2], want[3], hadamard=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    y = torch.randn(tokens, heads, dim, generator=gen)  # (x may be degenerate rows only)
    rotated, plain = (_cache(fmt, heads, pages, page_size, dim) for _ in range(2))
    ops.store_kv_rows(y, rotated[0], slots, rotated[2], hadamard=True)
    ops.store_kv_rows(y, plain[0], slots, plain[2])
    assert not torch.equal(rotated[0], plain[0])


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_ops_refuse_a_hadamard_rotation_of_a_non_power_of_two_head(ops, fmt):
    cache, table, gen = _filled(fmt, [5], 1, 4, 48, seed=1)
    q = torch.randn(1, 2, 48, generator=gen)
    with pytest.raises(RuntimeError, match="power-of-two"):
        ops.paged_decode_attention(q, cache[0], cache[1], table, torch.tensor([5]), 0.1,
                                   *cache[2:], hadamard=True)
    with pytest.raises(RuntimeError, match="power-of-two"):
        ops.store_kv_rows(torch.randn(1, 1, 48), cache[0], torch.tensor([0]), cache[2],
                          hadamard=True)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_store_op_refuses_an_out_of_range_slot_and_writes_nothing(ops, fmt):
    k_cache, _, k_scale, _ = _cache(fmt, 2, 3, 16, 64)
    before, scale_before = k_cache.clone(), k_scale.clone()
    x = torch.randn(4, 2, 64)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.store_kv_rows(x, k_cache, torch.tensor([0, 5, 48, 1]), k_scale)
    assert torch.equal(k_cache, before) and torch.equal(k_scale, scale_before)


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path) -> None:
    import os
    import time

    from kernels.cpu_ops import STALE_LOCK_S, clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()  # a build may be running
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()
    assert not clear_stale_lock(tmp_path)  # nothing there: nothing to do


def test_a_builder_killed_mid_build_leaves_no_lock_that_others_wait_on(tmp_path) -> None:
    import fcntl
    import signal
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, sys, time\n"
        "from kernels.cpu_ops import build_lock\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "with build_lock(d):\n"
        "    (d / 'lock').touch()\n"  # torch's own lock, as a build in progress holds it
        "    print('building', flush=True)\n"
        "    time.sleep(60)\n"), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "building"
        with open(tmp_path / "tessera.flock", "a+") as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live builder keeps others out
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / "lock").exists()

    from kernels.cpu_ops import build_lock

    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_sources_are_staged_once_per_build_so_checkouts_share_one_build(tmp_path) -> None:
    from kernels.cpu_ops import _ROOT, stage_sources

    staged = stage_sources(tmp_path)
    names = sorted(p.name for p in _ROOT.iterdir() if p.suffix in (".cpp", ".h"))
    assert sorted(p.name for p in staged.iterdir()) == names
    (staged / names[0]).write_text("// edited")
    mtime = (staged / names[1]).stat().st_mtime_ns
    assert stage_sources(tmp_path) == staged
    assert (staged / names[0]).read_bytes() == (_ROOT / names[0]).read_bytes()
    assert (staged / names[1]).stat().st_mtime_ns == mtime  # unchanged files are not rewritten
