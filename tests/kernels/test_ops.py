"""The `tessera` op library (`kernels/ops.py`): every op the engine calls is declared once, with a
schema its kernels honour (what they mutate, what they return) and a fake implementation that
traces on fake tensors, as `torch.compile` and CUDA graphs need."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels.block_panels import pack_block_panels
from kernels.cpu_ops import native, native_ops
from kernels.decode_llama import BlockProjSpec, DecodeLayerSpec, FusedLlamaDecode
from kernels.int4pack import pack_int4pack
from kernels.ops import OPS, twin_ops
from kernels.qgemv import pack_q4_blocks
from kernels.store_kv import ref_store_kv
from kernels.triton.int4_layout import OFFSET_ZEROS

H, KVH, D, PAGE, PAGES = 4, 2, 16, 4, 6
N, K = 64, 64  # a block linear's out and in features


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _pages(fmt: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = _gen()
    kc = torch.zeros(KVH, PAGES, PAGE, D, dtype=fmt)
    vc = torch.zeros_like(kc)
    quantized = fmt in (torch.uint8, torch.int8)
    ks = torch.ones(KVH, PAGES, PAGE, dtype=torch.bfloat16) if quantized else None
    vs = None if ks is None else ks.clone()
    slots = torch.arange(10)
    ref_store_kv(torch.randn(10, KVH, D, generator=g), torch.randn(10, KVH, D, generator=g),
                 kc, vc, slots, ks, vs)
    return kc, vc, ks, vs


def _q4() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen()
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    d = (torch.rand(N, K // 32, generator=g) / 8).half()
    m = (-torch.rand(N, K // 32, generator=g)).half()
    return pack_q4_blocks(codes), d, m


def _q8() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen()
    qs = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    return qs, (torch.rand(N, K // 32, generator=g) / 64).half()


def _q4_panels() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    p = pack_block_panels(*_q4())
    return p.pw, p.pd, p.pm


def _x(rows: int = 3) -> torch.Tensor:
    return torch.randn(rows, K, generator=_gen())


def _int4_tiles() -> tuple[object, ...]:
    """INT4 tiles (kernels/triton/int4_layout.py) with zero points, groups of 32."""
    g = _gen()
    qt = torch.randint(0, 256, (K // 2, N), generator=g, dtype=torch.uint8)
    d = (torch.rand(K // 32, N, generator=g) / 8).bfloat16()
    zeros = torch.randint(0, 16, (K // 32, N), generator=g, dtype=torch.uint8)
    return qt, d, zeros, OFFSET_ZEROS, 32


def _moe_args() -> tuple[object, ...]:
    """4 int4-g32 experts (hidden K, inter 32), 5 tokens routed to 2 each."""
    g, e, inter = _gen(), 4, 32
    w13 = torch.randint(0, 256, (e, 2 * inter, K // 2), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (e, K, inter // 2), generator=g, dtype=torch.uint8)
    s13, s2 = torch.rand(e, 2 * inter, K // 32, generator=g) / 8, torch.rand(e, K, 1) / 8
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [1, 0]])
    return (_x(5), w13, s13.bfloat16(), None, w2, s2.bfloat16(), None,
            torch.rand(5, 2, generator=g), ids, "int4", 32)


def _sample_args() -> dict[str, Callable[[], tuple[object, ...]]]:
    """Small, valid arguments for every declared op (fresh tensors on each call)."""
    table = torch.tensor([[0, 1, 2], [3, 0, 0]])
    lens = torch.tensor([9, 3])
    q4, q8 = _q4, _q8

    def q4_codes() -> torch.Tensor:
        return torch.randint(0, 16, (N, K), generator=_gen(), dtype=torch.uint8)
    return {
        "store_kv_rows": lambda: (torch.randn(3, KVH, D), _pages(torch.uint8)[0],
                                  torch.tensor([1, 7, 12]), _pages(torch.uint8)[2], True),
        "paged_decode_attention": lambda: (torch.randn(2, H, D), *_pages(torch.float32)[:2],
                                           table, lens, D**-0.5),
        "paged_prefill_attention": lambda: (torch.randn(3, H, D), *_pages(torch.int8)[:2],
                                            torch.tensor([0, 1, 2]), 10,
                                            torch.ones(3, 10, dtype=torch.bool), D**-0.5,
                                            *_pages(torch.int8)[2:]),
        "gather_e4m3_rows": lambda: (_pages(torch.uint8)[0].view(KVH * PAGES, PAGE * D),
                                     torch.tensor([3, 0, 5])),
        "add_rms_norm": lambda: (torch.randn(3, K), torch.randn(3, K), torch.rand(K), 1e-5),
        "silu_mul": lambda: (torch.randn(3, 2 * K),),
        "q4_linear_out": lambda: (_x(), *q4()[:2], q4()[2], None, 32, torch.empty(3, N)),
        "q8_linear_out": lambda: (_x(), *q8(), torch.empty(3, N)),
        "q4_dequantize": lambda: (*q4(), None, 32),
        "q8_dequantize": lambda: q8(),
        "q4_linear_i8_out": lambda: (_x(), *q4(), torch.empty(3, N), 2),
        "q8_linear_i8_out": lambda: (_x(), *q8(), torch.empty(3, N), 1),
        "block_linear_out": lambda: (_x(), *q4(), None, 32, 2, torch.empty(3, N)),
        "block_panels_linear_out": lambda: (_x(), *_q4_panels(), 2, torch.empty(3, N)),
        "fp8_dequantize": lambda: (torch.randn(N, K).to(torch.float8_e4m3fn).view(torch.uint8),
                                   torch.rand(N), None),
        "int4pack_mm": lambda: (_x().bfloat16(), pack_int4pack(q4_codes()), 32,
                                torch.rand(K // 32, N, 2).bfloat16()),
        "bf16_linear_out": lambda: (_x(), torch.randn(N, K).bfloat16(), torch.empty(3, N)),
        "w4a16_linear": lambda: (_x().bfloat16(), *_int4_tiles()),
        "fp8_block_linear": lambda: (_x(), torch.randn(N, K).to(torch.float8_e4m3fn)
                                     .view(torch.uint8), torch.rand(N, 1) + 0.5),
        "fused_moe": lambda: _moe_args(),
        "verify_pages": lambda: (torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]),
                                 torch.tensor([5, 6, 7]), torch.tensor([0, 0, 1]),
                                 torch.arange(8), torch.zeros(8, dtype=torch.long),
                                 torch.ones(8, dtype=torch.long)),
    }


def _seeded(name: str) -> tuple[object, ...]:
    torch.manual_seed(0)
    return _sample_args()[name]()


def _cpu_kernel_runs(name: str) -> bool:
    if name.endswith("_i8_out") or name in ("block_linear_out", "block_panels_linear_out"):
        return native() is not None and bool(torch.ops.tessera.cpu_int8_kernels())
    if "bf16" in name:
        return native() is not None and bool(torch.ops.tessera.cpu_bf16_gemm())
    return True


def test_every_declared_op_has_sample_arguments_here():
    assert sorted(_sample_args()) == sorted(op.name for op in OPS)


@pytest.mark.parametrize("name", sorted(op.name for op in OPS))
def test_op_honours_its_schema_and_its_fake_traces(name):
    """opcheck: the kernel torch dispatches to here (the C++ one where built, else the twin)
    mutates only what the schema marks, and the fake gives the real output's shape, dtype and
    strides on fake tensors."""
    if not _cpu_kernel_runs(name):
        pytest.skip("this CPU build lacks the kernel (no VNNI / no bf16 GEMM)")
    native_ops()
    op = getattr(torch.ops.tessera, name).default
    torch.library.opcheck(op, _sample_args()[name](),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("name", sorted(op.name for op in OPS))
def test_op_equals_its_twin(name):
    """The op as dispatched (C++ on CPU where built) against its twin on the same inputs."""
    if not _cpu_kernel_runs(name):
        pytest.skip("this CPU build lacks the kernel (no VNNI / no bf16 GEMM)")
    args, twin_args = _seeded(name), _seeded(name)
    got = getattr(native_ops(), name)(*args)
    want = getattr(twin_ops(), name)(*twin_args)
    if got is None:  # an in-place op: compare what it wrote
        got = [a for a in args if isinstance(a, torch.Tensor)]
        want = [a for a in twin_args if isinstance(a, torch.Tensor)]
    tol = 2e-2 if "i8" in name or "bf16" in name or name.startswith("block_") else 1e-5
    if name == "int4pack_mm":  # bf16 output: one rounding apart
        tol = 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.skipif(native() is None, reason="no C++ toolchain: the fused step is not built")
def test_fused_decode_step_traces_on_fake_tensors():
    """`llama_decode_step` (declared by the C++ build beside its state class): its fake returns
    the residual stream it updates in place, without running the layers."""
    qs, d, m = _q4()
    proj = BlockProjSpec(False, 0, qs, d, m, None)
    kc, vc, _, _ = _pages(torch.float32)
    layer = DecodeLayerSpec(torch.ones(K), torch.ones(K), proj, proj, proj, proj, kc, vc)
    step = FusedLlamaDecode(H, KVH, D, 1e-5, D**-0.5, [layer])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(2, K))
        out = torch.ops.tessera.llama_decode_step(
            step._step, x, torch.ones(2, 1, D // 2), torch.zeros(2, 1, D // 2),
            torch.tensor([10, 11]), torch.tensor([[0, 1, 2], [3, 0, 0]]), torch.tensor([11, 3]))
    assert out is x
