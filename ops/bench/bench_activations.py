"""Decode step time with int8 vs float32 activations for GGUF blocks served as stored: one
engine, the same sequences, the BlockLinear layers switched between the two kernels round by
round (so both see the same contexts and the same background load).

    python3 -m ops.bench.bench_activations --concurrency 1 8 32 --steps 8 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ops.bench.bench_step import PROMPT, _engine
from runtime.quant.blocks import BlockLinear
from runtime.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=8, help="timed steps per round and kind")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = p.parse_args(argv)
    engine = _engine(args.threads, 256 << 20, max(args.concurrency),
                     {"gguf_activations": "int8"})
    engine.warm_up()
    blocks = [m for m in engine.decode_model.modules() if isinstance(m, BlockLinear)]
    print(f"threads {torch.get_num_threads()}\n")
    print("| concurrency | activations | wall ms/step median | CPU ms/step median | tok/s (wall) |")
    print("|---|---|---|---|---|")
    for c in args.concurrency:
        need = args.rounds * args.steps * 2 + 8
        params = SamplingParams(max_tokens=need, temperature=0.0, ignore_eos=True)
        ids = [f"a{c}-{i}" for i in range(c)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, f"{i}. " + PROMPT * 4, params)
        while any(len(engine.requests[r].output_token_ids) == 0 for r in ids):
            engine.step()
        for _ in range(3):
            engine.step()
        times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []}
                                                   for k in ("int8", "float32")}
        for _ in range(args.rounds):
            for kind in ("float32", "int8"):
                for m in blocks:
                    m.int8 = kind == "int8"
                engine.step()  # first step after the switch: not timed
                for _ in range(args.steps):
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
