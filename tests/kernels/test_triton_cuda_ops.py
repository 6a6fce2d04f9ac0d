"""The Triton launchers as the CUDA kernels of the `tessera` ops (kernels/triton/cuda_ops.py):
each claimed op gets a CUDA kernel, each adapter takes its op's schema arguments in order, and
each adapter, run on CPU tensors in Triton's interpreter, returns what the op's torch twin does
(store and tag check exactly; attention within the kernel tests' 2e-2 + 1e-2 |ref|)."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.kernels.triton_pools import DEVICE  # sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kernels.ops import OPS, twin_ops
from kernels.triton import cuda_ops
from kernels.verify_pages import ref_verify_pages

ATOL, RTOL = 2e-2, 1e-2
SCHEMAS = {op.name: op.schema for op in OPS}


def _schema_args(schema: str) -> list[str]:
    args = schema.split("(", 1)[1].rsplit(") ->", 1)[0]
    return [a.split("=")[0].split()[-1] for a in args.split(", ")]


def test_every_claimed_op_is_a_tessera_op_and_its_adapter_takes_the_schema_arguments():
    assert set(cuda_ops.CUDA_KERNELS) == {"store_kv_rows", "paged_decode_attention",
                                          "paged_prefill_attention", "verify_pages"}
    for name, fn in cuda_ops.CUDA_KERNELS.items():
        assert name in SCHEMAS, name
        assert list(inspect.signature(fn).parameters) == _schema_args(SCHEMAS[name]), name


def test_importing_the_ops_registers_each_adapter_as_the_cuda_kernel_once():
    for name in cuda_ops.CUDA_KERNELS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tessera::{name}", "CUDA"), name
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("tessera::add_rms_norm", "CUDA")
    assert cuda_ops.register_cuda_kernels("CUDA") == []  # already registered at import


def _cache(dtype: torch.dtype, heads: int = 2, pages: int = 12, dim: int = 64):
    cache = torch.zeros(heads, pages, 16, dim, dtype=dtype, device=DEVICE)
    scale = None
    if dtype in (torch.int8, torch.uint8):
        scale = torch.zeros(heads, pages, 16, dtype=torch.bfloat16, device=DEVICE)
    return cache, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.uint8])
def test_store_kv_rows_adapter_writes_the_twins_bits(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(21, 2, 64, generator=gen).to(DEVICE)
    slots = torch.randperm(12 * 16, generator=gen)[:21].to(DEVICE)
    slots[4] = -1
    quant = dtype != torch.bfloat16
    smooth = (None, None)
    if quant:
        smooth = (torch.randn(2, 64, generator=gen).to(DEVICE),
                  (torch.rand(2, 64, generator=gen) + 0.5).to(DEVICE))
    got, got_scale = _cache(dtype)
    want, want_scale = _cache(dtype)
    cuda_ops.store_kv_rows(x, got, slots, got_scale, quant, *smooth)
    kept = slots >= 0  # the twin has no padding slot: it writes the other rows alone
    twin_ops().store_kv_rows(x[kept], want, slots[kept], want_scale, quant, *smooth)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if quant:
        assert torch.equal(got_scale.view(torch.int16), want_scale.view(torch.int16))


def _filled(dtype: torch.dtype, gen: torch.Generator):
    k, k_scale = _cache(dtype)
    v, v_scale = _cache(dtype)
    x = torch.randn(12 * 16, 2, 64, generator=gen).to(DEVICE)
    slots = torch.arange(12 * 16, device=DEVICE)
    quant = dtype != torch.bfloat16
    twin_ops().store_kv_rows(x, k, slots, k_scale, quant)
    twin_ops().store_kv_rows(x * 2, v, slots, v_scale, quant)
    return k, v, dict(k_scale=k_scale, v_scale=v_scale, hadamard=quant)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.float() - want.float()).abs()
    assert bool((err <= ATOL + RTOL * want.float().abs()).all()), f"max |err| {err.max():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_paged_decode_attention_adapter_matches_the_twin(dtype):
    gen = torch.Generator().manual_seed(2)
    k, v, args = _filled(dtype, gen)
    table = torch.randperm(12, generator=gen)[:8].view(2, 4).to(DEVICE)
    lens = torch.tensor([37, 61], device=DEVICE)
    q = torch.randn(2, 8, 64, generator=gen).to(DEVICE, torch.bfloat16)
    assert cuda_ops.decode_splits(1, 2, DEVICE) > 1  # the split-K path on the CPU "device"
    got = cuda_ops.paged_decode_attention(q, k, v, table, lens, 0.125, **args)
    want = twin_ops().paged_decode_attention(q.float(), k, v, table, lens, 0.125, **args)
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_paged_prefill_attention_adapter_matches_the_twin_with_a_cached_prefix(dtype):
    gen = torch.Generator().manual_seed(3)
    k, v, args = _filled(dtype, gen)
    pages = torch.randperm(12, generator=gen)[:4].to(DEVICE)
    ctx, chunk = 50, 19
    mask = (torch.arange(ctx)[None] <= torch.arange(ctx - chunk, ctx)[:, None]).to(DEVICE)
    q = torch.randn(chunk, 8, 64, generator=gen).to(DEVICE, torch.bfloat16)
    got = cuda_ops.paged_prefill_attention(q, k, v, pages, ctx, mask, 0.125, **args)
    want = twin_ops().paged_prefill_attention(q.float(), k, v, pages, ctx, mask, 0.125, **args)
    assert_close(got, want)


def test_verify_pages_adapter_gives_the_twins_cause_per_entry():
    gen = torch.Generator().manual_seed(4)
    pages = 64
    tags = torch.randint(1, 9, (pages,), generator=gen)
    owners = torch.randint(1, 3, (pages,), generator=gen)
    refcounts = torch.randint(0, 2, (pages,), generator=gen)
    ids = torch.randint(0, pages, (200,), generator=gen)
    expected_ids = torch.where(torch.rand(200, generator=gen) < 0.05, (ids + 1) % pages, ids)
    expected_tags = torch.where(torch.rand(200, generator=gen) < 0.1, tags[ids] + 1, tags[ids])
    expected_owners = torch.where(torch.rand(200, generator=gen) < 0.1, 3, owners[ids])
    args = [t.to(DEVICE) for t in (ids, expected_ids, expected_tags, expected_owners, tags,
                                   owners, refcounts)]
    want = ref_verify_pages(*args)
    assert set(want.tolist()) == {0, 1, 2, 3, 4}  # every cause occurs
    got = cuda_ops.verify_pages(*args)
    assert got.dtype == want.dtype and torch.equal(got, want)
