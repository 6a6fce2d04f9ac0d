"""The GPU check's MoE and MLA measurements (run by ops/bench/gpu_check.sh after gpu_check.py):
the Triton fused MoE (bf16, block-FP8 W8A16 and W8A8, and INT4 g32 experts) against the
per-expert torch loop at Qwen3-30B-A3B's expert shapes (128 experts, top-8, hidden 2048,
inter 768), and MLA decode over latent pages at DeepSeek-V3's 512 + 64 with 16 heads (128
heads at TP 8), with its share of the measured copy bandwidth. CUDA events, median, L2
flushed (gpu_check.Timer).

`--tiny` runs the same code paths on tiny shapes (in Triton's interpreter without a GPU).
"""

from __future__ import annotations

import time
from functools import partial

import torch

from ops.bench.gpu_check import Timer, copy_bandwidth

MOE_FULL = dict(experts=128, top_k=8, hidden=2048, inter=768, tokens=(1, 8, 32, 256, 2048))
MOE_TINY = dict(experts=8, top_k=2, hidden=128, inter=128, tokens=(1, 9))
MLA_FULL = dict(heads=16, shapes=((32, 4096), (64, 8192)), lora=512, rope=64)
MLA_TINY = dict(heads=16, shapes=((2, 64),), lora=512, rope=64)
PAGE = 64


def _experts(kind: str, e: int, n: int, k: int, device: torch.device):
    from kernels.triton.launch_moe import ExpertWeights

    if kind == "bf16":
        return ExpertWeights(torch.randn(e, n, k, device=device).mul_(k**-0.5).bfloat16())
    if kind == "fp8-block":
        codes = torch.randint(0, 0x7F, (e, n, k), dtype=torch.uint8, device=device)
        scale = torch.rand(e, n, -(-k // 128), device=device) * 1e-3
        return ExpertWeights(codes, "fp8-block", scale)
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
    scale = (torch.rand(e, n, k // 32, device=device) * 1e-2).bfloat16()
    return ExpertWeights(codes, "int4", scale, None, 32)


def moe_table(timer: Timer, sizes: dict, bw: float) -> None:
    from kernels.moe import ref_fused_moe
    from kernels.triton.launch_moe import fused_moe

    dev = timer.device
    e, top_k, hidden, inter = sizes["experts"], sizes["top_k"], sizes["hidden"], sizes["inter"]
    weights = {kind: (_experts(kind, e, 2 * inter, hidden, dev),
                      _experts(kind, e, hidden, inter, dev))
               for kind in ("bf16", "fp8-block", "int4")}
    per_expert = {"bf16": 2.0, "fp8-block": 1.0, "int4": 0.5 + 2 / 32}  # bytes per weight
    print(f"\n| fused MoE ({e} experts, top-{top_k}, {hidden} x {inter}) | tokens | us | "
          f"loop us | speed-up | weight GB/s | share of copy |")
    print("|---|---|---|---|---|---|---|")
    for tokens in sizes["tokens"]:
        x = torch.randn(tokens, hidden, device=dev).bfloat16()
        logits = torch.randn(tokens, e, device=dev)
        topk_w, ids = logits.softmax(-1).topk(top_k)
        w13, w2 = weights["bf16"]
        loop = timer(partial(ref_fused_moe, x, w13.weight, w2.weight, topk_w, ids))
        touched = int(ids.unique().numel())
        runs = [(kind, w13, w2, False) for kind, (w13, w2) in weights.items()]
        runs.append(("fp8-block W8A8", *weights["fp8-block"], True))  # the prefill form
        for kind, w13, w2, w8a8 in runs:
            us = timer(partial(fused_moe, x, w13, w2, topk_w, ids, fp8_activations=w8a8))
            moved = touched * 3 * hidden * inter * per_expert[kind.split()[0]]
            print(f"| {kind} | {tokens} | {us:.1f} | {loop:.1f} | {loop / us:.2f}x | "
                  f"{moved / us / 1e3:.0f} | {moved / (us * 1e-6) / bw:.0%} |")


def mla_table(timer: Timer, sizes: dict, bw: float) -> None:
    from kernels.triton.launch import decode_num_splits
    from kernels.triton.launch_mla import mla_decode

    dev = timer.device
    heads, lora, rope = sizes["heads"], sizes["lora"], sizes["rope"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if timer.cuda else 132
    print(f"\n| MLA decode ({lora} + {rope}, {heads} heads) | batch | context | splits | us | "
          f"GB/s | share of copy |")
    print("|---|---|---|---|---|---|---|")
    for batch, context in sizes["shapes"]:
        pages = batch * context // PAGE
        table = torch.randperm(pages, device=dev).view(batch, -1)
        lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        q = torch.randn(batch, heads, lora + rope, device=dev).bfloat16()
        for fmt in ("bf16", "fp8", "fp8+bf16-rope"):
            row = lora + rope if fmt != "fp8+bf16-rope" else lora + 2 * rope
            if fmt == "bf16":
                cache = torch.randn(1, pages, PAGE, row, device=dev).bfloat16()
                extra, per = {}, 2 * row
            else:
                cache = torch.randint(0, 0x7F, (1, pages, PAGE, row), dtype=torch.uint8,
                                      device=dev)
                scale = (torch.rand(1, pages, PAGE, device=dev) * 1e-2).bfloat16()
                extra, per = dict(latent_scale=scale), row + 2
                if fmt == "fp8+bf16-rope":
                    extra["rope_cache"] = cache[..., lora:].view(torch.bfloat16)
            for splits in sorted({1, decode_num_splits(batch, 1, sms)}):
                us = timer(partial(mla_decode, q, cache, table, lens, 192**-0.5, lora,
                                   num_splits=splits, **extra))
                moved = batch * context * per
                print(f"| {fmt} | {batch} | {context} | {splits} | {us:.1f} | "
                      f"{moved / us / 1e3:.0f} | {moved / (us * 1e-6) / bw:.0%} |")
        del cache


def main(argv: list[str] | None = None) -> int:
    from ops.bench.gpu_check import check_device

    checked = check_device("gpu_check_moe_mla", __doc__, argv)
    if checked is None:
        return 2
    args, device = checked
    timer = Timer(device, 2 if args.tiny else 20)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"## GPU check, MoE and MLA: {device}, {stamp}")
    bw = copy_bandwidth(timer, (1 << 20) if args.tiny else (2 << 30))
    print(f"copy bandwidth (read + write): {bw / 1e9:.0f} GB/s")
    moe_table(timer, MOE_TINY if args.tiny else MOE_FULL, bw)
    mla_table(timer, MLA_TINY if args.tiny else MLA_FULL, bw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
