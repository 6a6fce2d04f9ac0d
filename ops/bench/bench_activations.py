"""Decode step time with float32, int8 and bf16 activations for GGUF blocks served as stored:
one engine, the same sequences, the BlockLinear layers switched between the kinds round by round
(so all see the same contexts and the same background load). With `--mixed`, each timed step
also admits a new ~110-token prompt, so it runs that prompt's prefill beside the decodes (what
a serving step does whenever a request arrives).

    python3 -m ops.bench.bench_activations --concurrency 1 8 32 --steps 8 --rounds 3
    python3 -m ops.bench.bench_activations --concurrency 32 --steps 4 --rounds 3 --mixed
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from ops.bench.bench_step import PROMPT, _engine
from runtime.quant.blocks import INT8_LIMBS, BlockLinear
from runtime.sampling_params import SamplingParams

KINDS = ("float32", "int8", "int8x2", "bf16")


def _switch(engine: Any, blocks: list[BlockLinear], kind: str) -> None:
    for m in blocks:
        m.activations, m.bf16 = kind, kind == "bf16"
        m.limbs = INT8_LIMBS.get(kind, 0)
        m.int8 = m.limbs > 0
    engine.runner.backend.fused.built.clear()  # the fused decode step is rebuilt for the kind


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=8, help="timed steps per round and kind")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--mixed", action="store_true", help="a prefill arrives every timed step")
    args = p.parse_args(argv)
    engine = _engine(args.threads, 256 << 20, max(args.concurrency) + 2,
                     {"gguf_activations": "int8"})
    engine.warm_up()
    blocks = [m for m in engine.decode_model.modules() if isinstance(m, BlockLinear)]
    print(f"threads {torch.get_num_threads()}\n")
    print("| concurrency | activations | wall ms/step median | CPU ms/step median | tok/s (wall) |")
    print("|---|---|---|---|---|")
    for c in args.concurrency:
        need = args.rounds * args.steps * len(args.kinds) + 8
        params = SamplingParams(max_tokens=need, temperature=0.0, ignore_eos=True)
        ids = [f"a{c}-{i}" for i in range(c)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, f"{i}. " + PROMPT * 4, params)
        while any(len(engine.requests[r].output_token_ids) == 0 for r in ids):
            engine.step()
        for _ in range(3):
            engine.step()
        times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []}
                                                   for k in args.kinds}
        arrivals = 0
        for _ in range(args.rounds):
            for kind in args.kinds:
                _switch(engine, blocks, kind)
                engine.step()  # first step after the switch: not timed
                for _ in range(args.steps):
                    if args.mixed:
                        arrivals += 1
                        engine.add_request(f"p{c}-{arrivals}", f"{arrivals} " + PROMPT * 4,
                                           SamplingParams(max_tokens=1, temperature=0.0))
                    t0, c0 = time.perf_counter(), time.process_time()
                    engine.step()
                    times[kind]["cpu"].append(1e3 * (time.process_time() - c0))
                    times[kind]["wall"].append(1e3 * (time.perf_counter() - t0))
        for kind, t in times.items():
            wall = statistics.median(t["wall"])
            print(f"| {c} | {kind} | {wall:.1f} | {statistics.median(t['cpu']):.1f} | "
                  f"{c * 1e3 / wall:.0f} |")
        for rid in ids:
            engine.abort_request(rid)


if __name__ == "__main__":
    main()
