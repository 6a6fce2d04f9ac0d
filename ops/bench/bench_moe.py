"""MoE decode throughput: tessera's grouped expert compute vs a Python loop over experts.

    python3 -m ops.bench.bench_moe --concurrency 1 8 32 --repeats 3

Builds a random Qwen3-MoE checkpoint with transformers (seeded; 6 layers, hidden 512, 32
experts of 256, top-4, the SmolLM2 tokenizer), serves it with tessera, and times the decode
steps (after every prompt's prefill) at each concurrency with the routed experts computed by
(a) `kernels.moe.fused_moe`: (token, expert) pairs sorted by expert, one gather, one matmul
pair per expert with rows, one scatter-add; (b) the loop transformers' Mixtral/Qwen3-MoE blocks
run: for each expert that got tokens, `torch.where` over the routing mask, gather, the
expert's matmuls, `index_add_`. Runs alternate (a, b, b, a, ...) on one engine; medians.
Also times one MoE layer's expert compute alone at the same row counts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels.moe import fused_moe
from runtime import LLM, SamplingParams
from runtime.extras import require_extra
from runtime.models.moe import FusedExperts

CONFIG = dict(vocab_size=49152, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
              num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
              num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
              decoder_sparse_step=1, max_position_embeddings=1024, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)


def loop_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor) -> torch.Tensor:
    """transformers' per-expert loop (MixtralSparseMoeBlock), same shapes as `fused_moe`."""
    out = torch.zeros_like(x)
    mask = F.one_hot(topk_ids.long(), w13.shape[0]).permute(2, 1, 0)  # [E, top_k, T]
    for expert in (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
        k, t = torch.where(mask[expert])
        gate, up = F.linear(x[t], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[t, k, None].to(x.dtype)
        out.index_add_(0, t, y)
    return out


def use_experts(llm: LLM, impl: Any) -> None:
    for module in llm.engine.model.modules():
        if isinstance(module, FusedExperts):
            module.forward = (lambda m: lambda x, w, i: impl(x, m.w13, m.w2, w, i))(module)


def build_checkpoint(path: Path) -> None:
    import transformers

    from runtime.loader import default_model_path

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3MoeConfig(**CONFIG, initializer_range=0.05)).float()
    model.save_pretrained(path)
    gguf = default_model_path()
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent),
                                               gguf_file=gguf.name).save_pretrained(path)


_run_ids = itertools.count()


def decode_tok_s(llm: LLM, concurrency: int, max_tokens: int) -> float:
    """Decode tok/s of `concurrency` 16-token prompts after their prefills. Request ids are
    the same in every process (tensor-parallel ranks must see the same batches)."""
    engine = llm.engine
    run = next(_run_ids)
    for i in range(concurrency):
        prompt = [1 + (37 * i + 11 * j) % 4000 for j in range(16)]
        engine.add_request(f"run{run}-{i}", prompt,
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or any(not s.output_token_ids
                                          for s in engine.scheduler.running):
        engine.step()  # prefills (and their first tokens)
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += len(engine.step())
    return tokens / (time.perf_counter() - start)


def layer_ms(rows: int, repeats: int = 40) -> dict[str, float]:
    """One layer's routed experts alone at `rows` tokens, CONFIG's shapes, random routing:
    median and fastest ms of each implementation, alternating."""
    e, k, h, inter = 32, 4, 512, 256
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * 0.05
    w2 = torch.randn(e, h, inter, generator=gen) * 0.05
    ids = torch.rand(rows, e, generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(rows, k, generator=gen)
    assert torch.allclose(fused_moe(x, w13, w2, weights, ids),
                          loop_moe(x, w13, w2, weights, ids), atol=1e-4)
    impls = {"grouped": fused_moe, "loop": loop_moe}
    times: dict[str, list[float]] = {name: [] for name in impls}
    for r in range(repeats):
        for name in sorted(impls, reverse=bool(r % 2)):
            start = time.perf_counter()
            impls[name](x, w13, w2, weights, ids)
            times[name].append(1e3 * (time.perf_counter() - start))
    return {**{n: statistics.median(t) for n, t in times.items()},
            **{f"{n}_min": min(t) for n, t in times.items()}}


def main() -> None:
    require_extra("compare", "transformers", what="ops.bench.bench_moe")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"threads": args.threads, "config": CONFIG, "decode": {},
                               "layer": {}}
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(Path(tmp))
        llm = LLM(tmp, kv_cache_bytes=256 << 20, max_num_seqs=64)
    decode_tok_s(llm, 2, 4)  # warm-up
    for c in args.concurrency:
        runs: dict[str, list[float]] = {"grouped": [], "loop": []}
        for r in range(args.repeats):
            order = ("grouped", "loop") if r % 2 == 0 else ("loop", "grouped")
            for name in order:
                use_experts(llm, fused_moe if name == "grouped" else loop_moe)
                runs[name].append(decode_tok_s(llm, c, args.max_tokens))
        med = {k: statistics.median(v) for k, v in runs.items()}
        results["decode"][c] = {"runs": runs, "median": med,
                                "ratio": med["grouped"] / med["loop"]}
        results["layer"][c] = layer_ms(c)
        print(f"concurrency {c:3d}: decode tok/s grouped {med['grouped']:.1f} loop "
              f"{med['loop']:.1f} ({med['grouped'] / med['loop']:.2f}x); one layer's experts "
              f"{results['layer'][c]['grouped']:.2f} vs {results['layer'][c]['loop']:.2f} ms "
              f"(median), {results['layer'][c]['grouped_min']:.2f} vs "
              f"{results['layer'][c]['loop_min']:.2f} (fastest)",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
