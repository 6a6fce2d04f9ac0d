"""Milliseconds of one prefill step (engine level), its time by op, this tree against another.

    python3 -m ops.bench.bench_prefill --tokens 128 --repeats 10
    python3 -m ops.bench.bench_prefill --tokens 128 --profile        # time by op and shape
    python3 -m ops.bench.bench_prefill --ref-tree /work/main --rounds 5   # A/B, interleaved

Each repeat admits one request of `--tokens` prompt tokens (real text, cut to length; no
prefix cache) with max_tokens=1 and times the engine step that prefills it and samples its
first token: the quiet-machine TTFT at concurrency 1 less the serving layers. `--profile` runs
torch.profiler over a few such steps and sums self CPU time by op and input shapes, so each
block linear shows as its projection (qkv, o, gate_up, down, lm_head) with its GOPS (2 M N K
over its time). `--ref-tree` runs the same measurement in another checkout (its own C++ build:
`--ref-env KEY=VALUE` sets e.g. its TORCH_EXTENSIONS_DIR), the two trees alternating round by
round so background load falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TEXT = ("The history of computing is a story of machines that grew smaller, faster and "
        "cheaper, while the problems people asked them to solve grew larger. ")


def _engine(threads: int | None, extra: dict[str, str]) -> Any:
    import torch

    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine

    if threads is not None:
        torch.set_num_threads(threads)
    config = EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=4,
                          enable_prefix_caching=False, **extra)
    return LLMEngine.from_path(None, config)


def _prompt(engine: Any, tokens: int, salt: int) -> list[int]:
    ids = engine.tokenizer.encode(f"{salt}. " + TEXT * (tokens // 8 + 4))
    return list(ids[:tokens])


def prefill_ms(engine: Any, tokens: int, repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Wall and process-CPU milliseconds of `repeats` prefill steps of `tokens` tokens."""
    from runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {"wall": [], "cpu": []}
    for r in range(warmup + repeats):
        rid = f"p{r}"
        engine.add_request(rid, _prompt(engine, tokens, r), params)
        start, start_cpu = time.perf_counter(), time.process_time()
        while rid in engine.requests and not engine.requests[rid].output_token_ids:
            engine.step()
        if r >= warmup:
            times["cpu"].append(1e3 * (time.process_time() - start_cpu))
            times["wall"].append(1e3 * (time.perf_counter() - start))
        while rid in engine.requests:
            engine.step()
    return times


# (N, K) of SmolLM2-135M's projections -> names; anything else prints its shape.
_NAMES = {(960, 576): "qkv", (576, 576): "o", (3072, 576): "gate_up", (576, 1536): "down",
          (49152, 576): "lm_head"}


def profile(engine: Any, tokens: int, steps: int = 3) -> None:
    """Self CPU time per prefill step by op (block linears by projection), with GOPS."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prefill_ms(engine, tokens, 1, warmup=1)
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        prefill_ms(engine, tokens, steps, warmup=0)
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])  # us, calls, ops
    for ev in prof.key_averages(group_by_input_shape=True):
        name = ev.key
        if "linear" in name and ev.input_shapes and len(ev.input_shapes[0]) == 2:
            m, k = ev.input_shapes[0]
            n = ev.input_shapes[1][0]
            kq = k
            name = f"{_NAMES.get((n, kq), f'linear {n}x{kq}')} (M={m})"
            rows[name][2] += 2.0 * m * n * k * ev.count
        rows[name][0] += ev.self_cpu_time_total
        rows[name][1] += ev.count
    total = sum(r[0] for r in rows.values())
    print(f"\n## {tokens}-token prefill, {steps} steps: self CPU time per step by op\n")
    print("| op | ms/step | share | calls/step | GOPS |")
    print("|---|---|---|---|---|")
    for name, (us, calls, ops) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:25]:
        gops = f"{ops / us / 1e3:.0f}" if ops else ""
        print(f"| {name} | {us / 1e3 / steps:.2f} | {us / total:.1%} | {calls / steps:.0f} | "
              f"{gops} |")
    print(f"| total | {total / 1e3 / steps:.2f} | | | |")


def breakdown(engine: Any, tokens: int, steps: int = 5) -> None:
    """Thread-CPU milliseconds per prefill step in each projection, rotary and paged attention
    (KV store included), through forward hooks; the rest (norms, SwiGLU, embedding, sampler,
    bookkeeping) is the step's CPU time less theirs. Exact with one thread, under any load."""
    model = engine.prefill_model
    spent: dict[str, float] = defaultdict(float)
    macs: dict[str, float] = defaultdict(float)
    starts: dict[int, float] = {}

    watched: set[int] = set()

    def watch(name: str, module: Any) -> None:
        if id(module) in watched:  # one rotary module serves every layer
            return
        watched.add(id(module))

        def pre(mod: Any, args: Any) -> None:
            starts[id(mod)] = time.thread_time()

        def post(mod: Any, args: Any, out: Any) -> None:
            spent[name] += time.thread_time() - starts.pop(id(mod))
            if hasattr(mod, "in_features"):
                rows = args[0].numel() // mod.in_features
                macs[name] += rows * mod.in_features * mod.out_features

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    for layer in model.model.layers:
        attn = layer.self_attn
        for name, mod in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("rotary", attn.rotary),
                          ("attention + KV store", attn.attn),
                          ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
            watch(name, mod)
    watch("lm_head", model.lm_head)
    prefill_ms(engine, tokens, 1, warmup=1)
    spent.clear()
    macs.clear()
    total = sum(prefill_ms(engine, tokens, steps, warmup=0)["cpu"]) / 1e3
    print(f"\n## {tokens}-token prefill, {steps} steps, thread CPU ms per step\n")
    print("| part | ms/step | share | GOPS (2 MNK / time) |")
    print("|---|---|---|---|")
    for name, sec in sorted(spent.items(), key=lambda kv: -kv[1]):
        gops = f"{2 * macs[name] / sec / 1e9:.0f}" if macs[name] else ""
        print(f"| {name} | {1e3 * sec / steps:.1f} | {sec / total:.1%} | {gops} |")
    rest = total - sum(spent.values())
    print(f"| rest of the step | {1e3 * rest / steps:.1f} | {rest / total:.1%} | |")
    print(f"| step (process CPU) | {1e3 * total / steps:.1f} | | |")


def _run_tree(args: argparse.Namespace, tree: Path, env: dict[str, str]) -> dict[str, list]:
    # this file, run over the other tree's packages (that tree need not have it)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--tokens",
           str(args.tokens), "--repeats", str(args.repeats)]
    cmd += [f"--config={kv}" for kv in args.config]
    cmd += ["--threads", str(args.threads)] if args.threads else []
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tree,
                         env={**os.environ, "PYTHONPATH": str(tree), **env}, check=False)
    if out.returncode != 0:
        raise SystemExit(f"measurement in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(args: argparse.Namespace) -> None:
    ref = Path(args.ref_tree).resolve()
    ref_env = dict(kv.split("=", 1) for kv in args.ref_env)
    runs: dict[str, dict[str, list[float]]] = {"ref": {}, "this": {}}
    for _ in range(args.rounds):
        for name, tree, env in (("ref", ref, ref_env), ("this", REPO, {})):
            for kind, ms in _run_tree(args, tree, env).items():
                runs[name].setdefault(kind, []).extend(ms)
    print(f"| {args.tokens}-token prefill | clock | ref ms (median) | this tree | ratio ref/this |")
    print("|---|---|---|---|---|")
    for kind in ("wall", "cpu"):
        r, t = statistics.median(runs["ref"][kind]), statistics.median(runs["this"][kind])
        print(f"| {ref} | {kind} | {r:.1f} | {t:.1f} | {r / t:.2f}x |")
    print(f"\nload average at the end: {os.getloadavg()}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--profile", action="store_true", help="time by op and shape")
    p.add_argument("--breakdown", action="store_true",
                   help="thread-CPU time per part (use --threads 1)")
    p.add_argument("--json", action="store_true", help="print the raw times as JSON")
    p.add_argument("--ref-tree", default=None, help="another checkout to compare against")
    p.add_argument("--ref-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the --ref-tree runs (e.g. TORCH_EXTENSIONS_DIR)")
    p.add_argument("--rounds", type=int, default=3, help="with --ref-tree: alternations")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig string field (repeatable; both trees)")
    args = p.parse_args(argv)
    if args.ref_tree is not None:
        compare(args)
        return
    engine = _engine(args.threads, dict(kv.split("=", 1) for kv in args.config))
    engine.warm_up()
    if args.profile:
        profile(engine, args.tokens)
        return
    if args.breakdown:
        breakdown(engine, args.tokens)
        return
    times = prefill_ms(engine, args.tokens, args.repeats)
    if args.json:
        print(json.dumps(times))
        return
    for kind in ("wall", "cpu"):
        print(f"{args.tokens}-token prefill, {kind} ms: median {statistics.median(times[kind]):.1f}"
              f" min {min(times[kind]):.1f} (of {len(times[kind])})")


if __name__ == "__main__":
    main()
