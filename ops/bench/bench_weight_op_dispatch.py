"""Host-side cost of one Triton weight-op call at decode size (M = 1), without a GPU: what
`torch.ops.tessera.{w4a16_linear, fp8_block_linear, fused_moe}` does on the host from the
op call to the kernel launches (dispatch, the CUDA adapter, the launcher's asserts, configs,
split-K plan, buffers, the MoE sort), with every `@triton.jit` kernel replaced by a stub that
counts its launches, so nothing is interpreted or compiled.

    python3 -m ops.bench.bench_weight_op_dispatch [--calls 2000]

Per op: CPU microseconds a call (process time over `--calls` calls: load-independent within
noise, unlike wall time on a shared box), Python function calls, aten ops dispatched (each is
a device kernel launch or a view on CUDA), tensors allocated, and Triton launches. Triton's own
launch path (argument binding, the cache lookup, the driver call: tens of microseconds in
Triton 3.x) is not in these figures; a CUDA graph replays none of it, nor any of these.
Shapes: Kimi-K2's 7168 x 2048 (INT4 g32, block FP8); a MoE layer routing one token to 8 of 64
experts (INT4 g32 and block-FP8 W8A8), the experts 128 x 256 (sizes change no host work, and
small ones quantize in seconds on CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Callable

os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU switch needs it; stubs run instead

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALLOCATING = ("empty", "zeros", "ones", "full", "new_empty", "new_zeros", "arange",
               "empty_like", "zeros_like", "ones_like", "full_like", "clone")


class _Stub:
    """A `@triton.jit` kernel's place: `kernel[grid](*args, **meta)` counts and returns."""

    def __init__(self, launches: Counter, name: str) -> None:
        self.launches, self.name = launches, name

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: object, **meta: object) -> None:
            self.launches[self.name] += 1
        return launch


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        if func.namespace == "tessera":  # the adapter the op dispatches to, its ops counted
            from kernels.triton.cuda_ops import WEIGHT_KERNELS

            with self:
                return WEIGHT_KERNELS[func.overloadpacket.__name__](*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def stub_kernels(launches: Counter) -> None:
    from kernels.triton import fp8_block, fused_moe, w4a16

    for module, names in ((w4a16, ("w4a16_kernel", "reduce_splits_kernel")),
                          (fp8_block, ("quant_fp8_groups_kernel", "fp8_block_matmul_kernel")),
                          (fused_moe, ("fused_moe_kernel",))):
        for name in names:
            setattr(module, name, _Stub(launches, name))


def cases() -> dict[str, Callable[[], torch.Tensor]]:
    from runtime.formats import WeightFormat
    from runtime.quant.experts import QuantizedExperts
    from runtime.quant.linear import Fp8Linear, Int4Linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(7168, 2048, generator=gen) * 0.02
    x = torch.randn(1, 2048, generator=gen).bfloat16()
    int4 = Int4Linear.from_float(w, group_size=32)
    assert int4.layout == "int4_tiles", int4.layout
    fp8 = Fp8Linear.from_float(w, block=(128, 128))
    assert fp8.block_kernel
    h = torch.randn(1, 256, generator=gen).bfloat16()
    w13 = torch.randn(64, 256, 256, generator=gen) * 0.05
    w2 = torch.randn(64, 256, 128, generator=gen) * 0.05
    ids = torch.randperm(64, generator=gen)[:8].view(1, 8)
    weights = torch.rand(1, 8, generator=gen)
    experts = {fmt: QuantizedExperts.from_float(w13, w2, WeightFormat.parse(fmt, 32))
               for fmt in ("int4", "fp8-block")}
    assert experts["fp8-block"].fp8_activations
    return {"w4a16_linear 7168x2048 g32": lambda: int4(x),
            "fp8_block_linear 7168x2048": lambda: fp8(x),
            "fused_moe int4 g32, top-8 of 64": lambda: experts["int4"](h, weights, ids),
            "fused_moe fp8 W8A8, top-8 of 64": lambda: experts["fp8-block"](h, weights, ids),
            "(for scale: one aten.add)": lambda: torch.ops.aten.add(x, x)}


def measure(fn: Callable[[], object], calls: int, launches: Counter) -> dict[str, float]:
    fn()  # first call: imports, caches
    before = sum(launches.values())
    fn()
    per_call_launches = sum(launches.values()) - before
    py = Counter()

    def profile(frame, event, arg):
        py[event] += 1
    sys.setprofile(profile)
    fn()
    sys.setprofile(None)
    with _CountOps() as mode:
        fn()
    ops = mode.ops
    start = time.process_time()
    for _ in range(calls):
        fn()
    cpu_us = (time.process_time() - start) / calls * 1e6
    return {"us": cpu_us, "py": py["call"] + py["c_call"], "aten": sum(ops.values()),
            "alloc": sum(n for name, n in ops.items() if name in _ALLOCATING),
            "launches": per_call_launches, "ops": ops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--ops", action="store_true", help="list each call's aten ops")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from kernels.triton import cuda_ops

    launches: Counter = Counter()
    stub_kernels(launches)
    print(f"## weight-op host cost per call, M = 1, {time.strftime('%Y-%m-%d %H:%M UTC')}, "
          f"{args.calls} calls, CPU time (kernels stubbed)")
    print("\n| call | host us | Python calls | aten ops | allocations | Triton launches |")
    print("|---|---|---|---|---|---|")
    with cuda_ops.interpreted_weight_kernels():
        table = cases()
        for name, fn in table.items():
            r = measure(fn, args.calls, launches)
            print(f"| {name} | {r['us']:.1f} | {r['py']} | {r['aten']} | {r['alloc']} | "
                  f"{r['launches']} |")
            if args.ops:
                print(f"|  | {dict(r['ops'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
