"""The Triton fused MoE (kernels/triton/launch_moe.py) in Triton's interpreter against the
per-expert loop (`kernels.moe.ref_fused_moe`): the device sort-and-pad, bf16 / fp32 experts,
block-FP8 (W8A16 and W8A8) and INT4 experts against the loop over their dequantized weights
(W8A8: and quantized activations), token counts from
1 up (both tile configs), experts that receive no token, top-k ties and a token routed twice to
one expert, outputs poisoned with NaN before each launch.

Tolerances: fp32 experts (IEEE dots in the interpreter) within 1e-5 of the loop, which only an
exact row gather passes; bf16/fp16 activations |got - ref| <= 1e-2 max|ref| + 1e-2 |ref| (the
SwiGLU activation and each row's down projection are stored in bf16 between the launches, as
vLLM's and SGLang's; the interpreter also truncates fp32 -> bf16).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_pools import DEVICE, NATIVE  # sets TRITON_INTERPRET=1 on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kernels.moe import moe_align, ref_fused_moe
from kernels.triton.gemm_ref import ref_dequant_fp8_blocks, ref_quant_fp8_groups
from kernels.triton.launch_moe import (
    ExpertWeights,
    MoeConfig,
    fused_moe,
    max_padded_rows,
    moe_align_block_size,
)
from runtime.models.moe import RoutingConfig, select_experts
from runtime.quant.fp8 import dequantize_fp8_row_blocks, expand_block_rows, quantize_fp8_blockwise
from runtime.quant.int4 import dequantize_int4_groupwise, pack_int4

HIDDEN, INTER, EXPERTS, TOP_K = 96, 80, 16, 2


def _experts(gen: torch.Generator, experts: int = EXPERTS, hidden: int = HIDDEN,
             inter: int = INTER) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return w13, w2


def _route(gen: torch.Generator, tokens: int, experts: int = EXPERTS, top_k: int = TOP_K,
           only: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing over random logits; `only`: the first `only` experts receive every
    token (the rest none)."""
    logits = torch.randn(tokens, experts, generator=gen)
    if only is not None:
        logits[:, only:] = float("-inf")
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights, ids


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
    assert not got.isnan().any(), "a row was never written (poisoned NaN left)"
    err = (got.float().cpu() - want).abs()
    bound = atol + rtol * want.abs()
    assert bool((err <= bound).all()), f"max |err| {err.max():.3g} (max |ref| " \
        f"{want.abs().max():.3g}), worst excess {(err - bound).max():.3g}"


def _run(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, weights: torch.Tensor,
         ids: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=DEVICE)
    return fused_moe(x.to(DEVICE), w13, w2, weights.to(DEVICE), ids.to(DEVICE), config, out)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert_close(got, want, 1e-2 * float(want.abs().max()), 1e-2)


def test_align_groups_rows_by_expert_in_token_order_padded_to_the_block():
    ids = torch.tensor([[3, 1], [1, 3], [0, 1], [3, 0], [1, 5]])
    align = moe_align_block_size(ids.to(DEVICE), num_experts=8, block_m=4)
    rows, flat = 10, ids.reshape(-1)
    sorted_ids, blocks = align.sorted_ids.cpu(), align.expert_ids.cpu()
    assert sorted_ids.numel() == max_padded_rows(rows, 8, 4) == 36  # 10 + 8 * 3, in blocks
    used = int(align.num_post_pad)
    assert used == 4 * 4  # experts 0 (2 rows), 1 (4), 3 (3), 5 (1): one block each
    assert blocks[: used // 4].tolist() == [0, 1, 3, 5]
    assert (blocks[used // 4 :] == -1).all()
    for b, expert in enumerate(blocks[: used // 4].tolist()):
        chunk = sorted_ids[4 * b : 4 * b + 4]
        real = chunk[chunk < rows]
        assert (flat[real.long()] == expert).all()
        assert real.tolist() == sorted(real.tolist())  # stable: token order within an expert
        assert (chunk[len(real):] == rows).all()  # padding after the expert's rows
    assert sorted(sorted_ids[sorted_ids < rows].tolist()) == list(range(rows))


def test_align_sizes_depend_on_shapes_only_not_on_the_routing():
    gen = torch.Generator().manual_seed(0)
    sizes = set()
    for only in (None, 2, 5):
        _, ids = _route(gen, 9, only=only)
        align = moe_align_block_size(ids.to(DEVICE), EXPERTS, 16)
        sizes.add((align.sorted_ids.numel(), align.expert_ids.numel()))
    assert len(sizes) == 1  # one grid for the bucket: a CUDA graph replays any routing


@pytest.mark.parametrize("tokens", [1, 3, 8, 40])
def test_fp32_experts_match_the_per_expert_loop_exactly(tokens):
    # 1 and 3 tokens: 16-row blocks (rows <= experts); 40 tokens: 64-row grouped-M blocks
    gen = torch.Generator().manual_seed(tokens)
    w13, w2 = _experts(gen)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    weights, ids = _route(gen, tokens)
    got = _run(x, ExpertWeights(w13.to(DEVICE)), ExpertWeights(w2.to(DEVICE)), weights, ids)
    assert_close(got, ref_fused_moe(x, w13, w2, weights, ids), 1e-5, 1e-5)


@pytest.mark.parametrize(("tokens", "dtype"), [(1, torch.bfloat16), (5, torch.float16),
                                                (33, torch.bfloat16)])
def test_half_precision_experts_match_the_per_expert_loop(tokens, dtype):
    gen = torch.Generator().manual_seed(100 + tokens)
    w13, w2 = (w.to(dtype) for w in _experts(gen))
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    weights, ids = _route(gen, tokens)
    got = _run(x, ExpertWeights(w13.to(DEVICE)), ExpertWeights(w2.to(DEVICE)), weights, ids)
    assert got.dtype == dtype
    assert_bf16_close(got, ref_fused_moe(x.float(), w13.float(), w2.float(), weights, ids))


def test_experts_that_receive_no_token_launch_no_work_and_the_rest_are_exact():
    gen = torch.Generator().manual_seed(7)
    w13, w2 = _experts(gen)
    x = torch.randn(12, HIDDEN, generator=gen)
    weights, ids = _route(gen, 12, only=3)  # experts 3..15 get nothing
    assert set(ids.unique().tolist()) <= {0, 1, 2}
    align = moe_align_block_size(ids.to(DEVICE), EXPERTS, 16)
    assert int(align.num_post_pad) == 16 * len(ids.unique())
    # NaN weights in the idle experts: any read of them would poison the output
    w13[3:], w2[3:] = float("nan"), float("nan")
    got = _run(x, ExpertWeights(w13.to(DEVICE)), ExpertWeights(w2.to(DEVICE)), weights, ids)
    assert_close(got, ref_fused_moe(x, w13, w2, weights, ids), 1e-5, 1e-5)


def test_tied_router_scores_and_a_token_routed_twice_to_one_expert():
    gen = torch.Generator().manual_seed(11)
    w13, w2 = _experts(gen)
    x = torch.randn(6, HIDDEN, generator=gen)
    # every expert ties for every token: topk breaks the ties, the kernel follows its ids
    tied = torch.zeros(6, EXPERTS)
    weights, ids = select_experts(tied, RoutingConfig(EXPERTS, 4, "softmax", True))
    assert torch.equal(weights, torch.full_like(weights, 0.25))
    got = _run(x, ExpertWeights(w13.to(DEVICE)), ExpertWeights(w2.to(DEVICE)), weights, ids)
    assert_close(got, ref_fused_moe(x, w13, w2, weights, ids), 1e-5, 1e-5)
    # a degenerate routing choosing one expert twice: two rows, both summed
    twice = torch.tensor([[5, 5], [2, 5], [5, 2], [0, 0], [5, 5], [9, 1]])
    w = torch.rand(6, 2, generator=gen)
    got = _run(x, ExpertWeights(w13.to(DEVICE)), ExpertWeights(w2.to(DEVICE)), w, twice)
    assert_close(got, ref_fused_moe(x, w13, w2, w, twice), 1e-5, 1e-5)


def test_deepseek_v3_grouped_sigmoid_routing_feeds_the_kernel_as_the_loop():
    # noaux_tc: 4 groups of 4 experts, 2 groups compete, top-4 of 16, weights x 2.5 (not 1)
    gen = torch.Generator().manual_seed(13)
    cfg = RoutingConfig(16, 4, "sigmoid", True, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, correction_bias=True)
    w13, w2 = _experts(gen)
    x = torch.randn(9, HIDDEN, generator=gen)
    weights, ids = select_experts(torch.randn(9, 16, generator=gen), cfg,
                                  torch.randn(16, generator=gen) * 0.1)
    assert torch.allclose(weights.sum(-1), torch.full((9,), 2.5))
    got = _run(x, ExpertWeights(w13.to(DEVICE)), ExpertWeights(w2.to(DEVICE)), weights, ids)
    assert_close(got, ref_fused_moe(x, w13, w2, weights, ids), 1e-5, 1e-5)


def _fp8_experts(w: torch.Tensor) -> tuple[ExpertWeights, torch.Tensor]:
    """Block-FP8 as DeepSeek-V3 ships it (128x128 blocks), held per (row, column block) as
    tessera holds it in memory; and the weights it dequantizes to."""
    codes, scales, deq = [], [], []
    for e in range(w.shape[0]):
        q, s = quantize_fp8_blockwise(w[e])
        s = expand_block_rows(s, w.shape[1], 128)
        codes.append(q)
        scales.append(s)
        deq.append(dequantize_fp8_row_blocks(q, s, 128))
    packed = ExpertWeights(torch.stack(codes).to(DEVICE), "fp8-block",
                           torch.stack(scales).to(DEVICE))
    return packed, torch.stack(deq)


def _int4_experts(shape: tuple[int, int, int], group: int, symmetric: bool,
                  gen: torch.Generator) -> tuple[ExpertWeights, torch.Tensor]:
    """Random INT4 experts in tessera's layout (codes packed by `pack_int4`, bf16 group
    scales, 4-bit zero points) and the weights `dequantize_int4_groupwise` makes of them."""
    experts, rows, cols = shape
    codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8)
    scales = ((torch.rand(experts, rows, cols // group, generator=gen) + 0.5)
              * cols**-0.5 / 4).to(torch.bfloat16)
    zeros = None if symmetric else torch.randint(4, 12, scales.shape, generator=gen,
                                                 dtype=torch.uint8)
    deq = torch.stack([dequantize_int4_groupwise(codes[e], scales[e],
                                                 None if zeros is None else zeros[e])
                       for e in range(experts)])
    packed = ExpertWeights(pack_int4(codes, torch.uint8).to(DEVICE), "int4", scales.to(DEVICE),
                           None if zeros is None else zeros.to(DEVICE), group)
    return packed, deq


@pytest.mark.parametrize("tokens", [1, 12])
def test_block_fp8_experts_match_the_loop_over_their_dequantized_weights(tokens):
    # hidden 192 = 128 + a partial block, inter 96 < one block: ragged K blocks in both
    gen = torch.Generator().manual_seed(200 + tokens)
    w13, w2 = _experts(gen, 8, 192, 96)
    (q13, d13), (q2, d2) = _fp8_experts(w13), _fp8_experts(w2)
    assert not torch.equal(q13.scale, torch.ones_like(q13.scale))
    x = torch.randn(tokens, 192, generator=gen)
    weights, ids = _route(gen, tokens, experts=8)
    got = _run(x.bfloat16(), q13, q2, weights, ids)
    assert_bf16_close(got, ref_fused_moe(x.bfloat16().float(), d13, d2, weights, ids))
    # fp32 activations: the same codes and block scales, exact up to fp32 rounding
    got = _run(x, q13, q2, weights, ids)
    assert_close(got, ref_fused_moe(x, d13, d2, weights, ids), 1e-5, 1e-5)


@pytest.mark.parametrize(("group", "symmetric", "tokens"), [(32, True, 1), (128, False, 3),
                                                             (32, False, 24)])
def test_int4_experts_match_the_loop_over_their_dequantized_weights(group, symmetric, tokens):
    gen = torch.Generator().manual_seed(group + tokens)
    (q13, d13), (q2, d2) = (_int4_experts(shape, group, symmetric, gen)
                            for shape in ((8, 256, 256), (8, 256, 128)))
    x = torch.randn(tokens, 256, generator=gen)
    weights, ids = _route(gen, tokens, experts=8)
    got = _run(x, q13, q2, weights, ids)
    assert_close(got, ref_fused_moe(x, d13, d2, weights, ids), 1e-5, 1e-5)
    got = _run(x.bfloat16(), q13, q2, weights, ids)
    assert_bf16_close(got, ref_fused_moe(x.bfloat16().float(), d13, d2, weights, ids))


def test_mixed_formats_per_projection_and_an_explicit_config():
    gen = torch.Generator().manual_seed(3)
    w13, _ = _experts(gen, 8, 256, 128)
    (q13, d13), (q2, d2) = _fp8_experts(w13), _int4_experts((8, 256, 128), 32, True, gen)
    x = torch.randn(10, 256, generator=gen)
    weights, ids = _route(gen, 10, experts=8)
    got = _run(x, q13, q2, weights, ids, MoeConfig(32, 32, 64, 4))
    assert_close(got, ref_fused_moe(x, d13, d2, weights, ids), 1e-5, 1e-5)


def test_expert_weights_refuse_layouts_that_do_not_fit_their_kind():
    w = torch.zeros(2, 8, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="need scales"):
        ExpertWeights(w, "fp8-block")
    with pytest.raises(ValueError, match="float32 scales"):
        ExpertWeights(w, "fp8-block", torch.ones(2, 8, 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K/group_size"):
        ExpertWeights(w, "int4", torch.ones(2, 8, 4), group_size=32)  # K 256 / 32 = 8 groups
    with pytest.raises(ValueError, match="kind must be one of"):
        ExpertWeights(w, "nf4")
    with pytest.raises(ValueError, match="without scales"):
        ExpertWeights(w.float(), "float", torch.ones(2, 8, 1))


def _fp8_round(a: torch.Tensor) -> torch.Tensor:
    """a through e4m3 per (row, 128 columns) and back: the activation quantizer's twin."""
    q, s = ref_quant_fp8_groups(a)
    return ref_dequant_fp8_blocks(q, s, 1)


def _w8a8_loop(x: torch.Tensor, d13: torch.Tensor, d2: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor) -> torch.Tensor:
    """The per-expert loop with each projection's input quantized as W8A8 quantizes it."""
    rows = moe_align(ids, d13.shape[0])
    xs = _fp8_round(x).index_select(0, rows.tokens)
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(rows.counts):
        if n:
            gate, up = (xs[start : start + n] @ d13[e].t()).chunk(2, dim=-1)
            ys[start : start + n] = _fp8_round(torch.nn.functional.silu(gate) * up) @ d2[e].t()
            start += n
    ys *= weights.reshape(-1).index_select(0, rows.order)[:, None]
    return torch.zeros_like(x).index_add_(0, rows.tokens, ys)


@pytest.mark.parametrize("tokens", [1, 12])
def test_w8a8_block_fp8_experts_match_the_loop_over_quantized_activations(tokens):
    """fp8_activations: x and the SwiGLU activation each quantized per (row, 128 columns) before
    their launch; against the loop quantizing the same inputs (fp32 activations: the
    quantizer's inputs agree to fp32 rounding, so a code may flip at a rounding tie: 1e-3; on a
    GPU the fp8 tensor cores accumulate with fewer bits than fp32, so more codes flip: 2e-2,
    measured 1.2e-2 on an H200, and still under half the distance to W8A16)."""
    gen = torch.Generator().manual_seed(300 + tokens)
    w13, w2 = _experts(gen, 8, 192, 96)
    (q13, d13), (q2, d2) = _fp8_experts(w13), _fp8_experts(w2)
    x = torch.randn(tokens, 192, generator=gen)
    weights, ids = _route(gen, tokens, experts=8)
    out = torch.full(x.shape, float("nan"), device=DEVICE)
    got = fused_moe(x.to(DEVICE), q13, q2, weights.to(DEVICE), ids.to(DEVICE), out=out,
                    fp8_activations=True)
    want = _w8a8_loop(x, d13, d2, weights, ids)
    rel = 2e-2 if NATIVE else 1e-3
    assert_close(got, want, rel * float(want.abs().max()), rel)
    w8a16 = ref_fused_moe(x, d13, d2, weights, ids)
    assert (want - w8a16).abs().max() > 1e-3 * w8a16.abs().max()  # the activations were rounded
    assert (got.float().cpu() - want).abs().max() < 0.5 * (want - w8a16).abs().max()
