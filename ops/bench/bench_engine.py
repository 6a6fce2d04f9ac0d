"""Engine throughput and per-token latency vs transformers' static batching, in one run.

    python3 -m ops.bench.bench_engine --concurrency 1 8 32

Both sides serve the same prompts (real text) with output lengths drawn from 16..256 tokens
(ignore_eos, so lengths are exact). tessera runs a continuous batch capped at the concurrency;
transformers runs static batches of that size, each generating until its longest request is
done (only the requested tokens count as output). Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from ops.bench.roofline import flops_per_token, matmul_gflops
from ops.bench.workload import BenchRequest, make_workload
from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.extras import require_extra
from runtime.sampling_params import SamplingParams


def run_tessera(engine: LLMEngine, reqs: list[BenchRequest], concurrency: int) -> dict:
    engine.scheduler.config = type(engine.scheduler.config)(
        max_num_seqs=concurrency,
        max_num_batched_tokens=engine.scheduler.config.max_num_batched_tokens)
    stamps: dict[str, list[float]] = {}
    start = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add_request(f"b{i}", r.prompt, SamplingParams(
            max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
        stamps[f"b{i}"] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps[out.request_id].append(time.perf_counter())
    wall = time.perf_counter() - start
    tokens = sum(len(s) for s in stamps.values())
    itl = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps.values() if len(s) > 1]
    engine.check_quiescent()
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "itl_ms_median": 1e3 * statistics.median(itl),
            "itl_ms_p95": 1e3 * statistics.quantiles(itl, n=20)[-1] if len(itl) > 1 else None}


def run_transformers(model, tokenizer, reqs: list[BenchRequest], concurrency: int) -> dict:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokens, per_token = 0, []
    start = time.perf_counter()
    for b in range(0, len(reqs), concurrency):
        batch = reqs[b : b + concurrency]
        enc = tokenizer([r.prompt for r in batch], return_tensors="pt", padding=True)
        longest = max(r.output_len for r in batch)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, do_sample=False, max_new_tokens=longest,
                           min_new_tokens=longest, pad_token_id=tokenizer.pad_token_id)
        per_token.append((time.perf_counter() - t) / longest)
        tokens += sum(r.output_len for r in batch)
    wall = time.perf_counter() - start
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "itl_ms_median": 1e3 * statistics.median(per_token), "itl_ms_p95": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-slot", type=float, default=2.0,
                    help="requests per level = max(4, this x concurrency)")
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--out", default="ops/bench/out/engine.json")
    args = ap.parse_args()
    if not args.skip_transformers:
        require_extra("compare", "transformers",
                      what="ops.bench.bench_engine (or pass --skip-transformers)")
    torch.manual_seed(0)
    engine = LLMEngine.from_path(None, EngineConfig(kv_cache_bytes=1 << 30, max_num_seqs=64))
    hf = tok = None
    if not args.skip_transformers:
        import transformers

        path = engine.checkpoint.path
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    rows = []
    for c in args.concurrency:
        reqs = make_workload(max(4, int(args.requests_per_slot * c)), args.min_output,
                             args.max_output, seed=c)
        ours = run_tessera(engine, reqs, c)
        theirs = run_transformers(hf, tok, reqs, c) if hf is not None else None
        rows.append({"concurrency": c, "requests": len(reqs), "tessera": ours,
                     "transformers": theirs})
        print(json.dumps(rows[-1]), flush=True)
    cfg = engine.model_config
    roof = {"gflops_2048": matmul_gflops(2048, 2048, 2048),
            "gflops_decode_32x576x1536": matmul_gflops(32, 576, 1536, repeats=50),
            "mflop_per_token_ctx256": flops_per_token(cfg, 256) / 1e6}
    roof["roof_tok_s"] = roof["gflops_2048"] * 1e3 / roof["mflop_per_token_ctx256"]
    report = {"date": time.strftime("%Y-%m-%d"),
              "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "rows": rows, "roof": roof}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = ["| concurrency | requests | tessera tok/s | transformers tok/s | ratio | "
             "tessera ITL p50 / p95 ms | transformers ms/step |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ours, theirs = r["tessera"], r["transformers"]
        ratio = f"{ours['tok_s'] / theirs['tok_s']:.2f}x" if theirs else "-"
        p95 = f"{ours['itl_ms_p95']:.1f}" if ours["itl_ms_p95"] else "-"
        lines.append(f"| {r['concurrency']} | {r['requests']} | {ours['tok_s']:.1f} | "
                     f"{theirs['tok_s']:.1f} | {ratio} | {ours['itl_ms_median']:.1f} / {p95} | "
                     f"{theirs['itl_ms_median']:.1f} |" if theirs else
                     f"| {r['concurrency']} | {r['requests']} | {ours['tok_s']:.1f} | - | - | "
                     f"{ours['itl_ms_median']:.1f} / {p95} | - |")
    roof = report["roof"]
    lines.append(f"\nRoof: {roof['gflops_2048']:.0f} GFLOP/s (2048^3 fp32 matmul), "
                 f"{roof['gflops_decode_32x576x1536']:.0f} GFLOP/s decode-shaped; "
                 f"{roof['mflop_per_token_ctx256']:.0f} MFLOP/token at context 256 -> "
                 f"{roof['roof_tok_s']:.0f} tok/s compute roof.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
