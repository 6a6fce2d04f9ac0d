"""Where an all-decode engine step's time goes, piece by piece, at several concurrencies.

    python3 -m ops.bench.decode_breakdown --concurrency 1 8 32 --steps 20 --threads 1 --clock cpu
    python3 -m ops.bench.decode_breakdown --concurrency 32 --config kv_cache_dtype=fp8

The same step as `ops/bench/bench_step.py` (real model, ~100-token prompts, every request
decoding one token a step). Host pieces are timed by wrapping the engine's own methods
(scheduler, integrity check, batch layout and attention metadata, model, lm_head, sampler);
the fused C++ decode step times its own phases (`FusedLlamaDecode.set_profiling`: norms,
each projection, RoPE, KV store, attention, SiLU x up). "host other" is the step minus every
timed piece: the model runner's per-token lists, bookkeeping, detokenizing, outputs.
Then the sampler alone on the last step's logits under other sampling parameters (greedy with
logprobs, temperature with top-p, with logprobs). Wall times on a shared machine: run at one
thread (`--threads 1`) for an account that adds up, and with `--clock cpu` (the main thread's
CPU time) for one that a loaded machine does not distort; medians per step.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ops.bench.bench_step import PROMPT, _engine

# (label, object path from the engine, method name): each wrapped for timing, exclusive of the
# pieces nested in it (the model's forward holds the fused step; the runner's execute holds
# layout, metadata, model and lm_head)
_HOST = (
    ("schedule", "scheduler", "schedule"),
    ("integrity check", "tracker", "verify_batch"),
    ("runner: execute", "runner", "execute"),
    ("runner: layout", "runner", "_layout"),
    ("attention metadata", "runner.backend", "build_metadata"),
    ("model: embed + rope tables", "runner.decode_model", "forward"),
    ("lm_head + final norm", "runner.decode_model", "compute_logits"),
    ("sampler", "sampler", "__call__"),
    ("scheduler postprocess", "scheduler", "postprocess"),
)
_NESTED = {"runner: execute": ("runner: layout", "attention metadata",
                               "model: embed + rope tables", "lm_head + final norm"),
           "model: embed + rope tables": ("fused step (C++)",)}


class _Timers:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.clock = clock

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[label] += 1e3 * (self.clock() - start)
        return timed


def _resolve(engine: Any, path: str) -> Any:
    obj = engine
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _install(engine: Any, timers: _Timers) -> None:
    for label, path, name in _HOST:
        obj = _resolve(engine, path)
        if name == "__call__":  # a special method: wrap the attribute the engine calls
            setattr(engine, path, timers.wrap(label, obj))
        else:
            setattr(obj, name, timers.wrap(label, getattr(obj, name)))


def _fused_step(engine: Any) -> Any:
    built = engine.runner.backend.fused.built if hasattr(engine.runner.backend, "fused") else {}
    for entry in built.values():
        if entry[2] is not None:
            return entry[2]
    return None


def breakdown(engine: Any, concurrency: int, steps: int, clock: str = "wall", warmup: int = 3
              ) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms per step of each piece at `concurrency` (host pieces exclusive of nested
    ones, fused-step phases, "step" the whole) by `clock` ("wall", or "cpu": this thread's
    CPU time), and the sampler alone under other parameters."""
    from runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + warmup + 8, temperature=0.0, ignore_eos=True)
    ids = [f"b{concurrency}-{i}" for i in range(concurrency)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, f"{i}. " + PROMPT * 4, params)
    while any(len(engine.requests[r].output_token_ids) == 0 for r in ids):
        engine.step()
    for _ in range(warmup):
        engine.step()
    now = time.perf_counter if clock == "wall" else time.thread_time
    timers = _Timers(now)
    _install(engine, timers)
    fused = _fused_step(engine)
    logits_seen: list[Any] = []
    if fused is not None:
        op = fused._op

        def fused_op(*args: Any) -> Any:
            start = now()
            out = op(*args)
            timers.step["fused step (C++)"] += 1e3 * (now() - start)
            return out
        fused._op = fused_op
    sampler = engine.sampler

    def sampler_seen(logits: Any, *args: Any) -> Any:
        logits_seen[:] = [logits.clone()]
        return sampler(logits, *args)
    engine.sampler = sampler_seen
    per_step: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        timers.step.clear()
        if fused is not None:
            fused.set_profiling(clock)
        start = now()
        engine.step()
        total = 1e3 * (now() - start)
        row = dict(timers.step)
        for outer, inner in _NESTED.items():
            if outer in row:
                row[outer] -= sum(row.get(i, 0.0) for i in inner)
        if fused is not None:
            for phase, ms in fused.phase_ms().items():
                row[f"fused: {phase}"] = ms
            row["fused step (C++)"] = row.get("fused step (C++)", 0.0) - sum(
                fused.phase_ms().values())
            fused.set_profiling(None)
        row["host other"] = total - sum(row.values())
        row["step"] = total
        for k, v in row.items():
            per_step[k].append(v)
    if fused is not None:
        fused._op = op
    engine.sampler = sampler
    for _label, path, name in _HOST:  # unwrap (instance attributes shadowing the class's)
        obj = _resolve(engine, path) if name != "__call__" else None
        if obj is not None and name in vars(obj):
            delattr(obj, name)
    engine.sampler = sampler
    for rid in ids:
        engine.abort_request(rid)
    medians = {k: statistics.median(v) for k, v in per_step.items()}
    return medians, _sampler_variants(engine, logits_seen[0], concurrency, steps, now)


def _sampler_variants(engine: Any, logits: Any, rows: int, repeats: int,
                      now: Callable[[], float]) -> dict[str, float]:
    import torch

    from runtime.sampling_params import SamplingParams

    variants = {
        "greedy": SamplingParams(temperature=0.0),
        "greedy, logprobs=5": SamplingParams(temperature=0.0, logprobs=5),
        "temperature 0.8, top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
        "temperature 0.8, top_k 40, logprobs=1": SamplingParams(temperature=0.8, top_k=40,
                                                                logprobs=1),
    }
    out = {}
    for name, p in variants.items():
        times = []
        for _ in range(repeats):
            gens = [torch.Generator().manual_seed(i) for i in range(rows)]
            start = now()
            engine.sampler(logits, [p] * rows, [([1, 2], [3])] * rows, gens, None, None)
            times.append(1e3 * (now() - start))
        out[name] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the main thread's CPU time (exact with --threads 1 on a loaded "
                        "machine)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig string field (repeatable)")
    args = p.parse_args(argv)
    engine = _engine(args.threads, args.kv_cache_bytes, max(args.concurrency),
                     dict(kv.split("=", 1) for kv in args.config))
    engine.warm_up()
    results = {c: breakdown(engine, c, args.steps, args.clock) for c in args.concurrency}
    labels = list(dict.fromkeys(k for r, _ in results.values() for k in r))
    labels = [k for k in labels if k != "step"] + ["step"]
    cols = " | ".join(f"c={c} ms | %" for c in results)
    print(f"| piece | {cols} |")
    print("|---|" + "---|---|" * len(results))
    for k in labels:
        cells = []
        for r, _ in results.values():
            v = r.get(k, 0.0)
            cells.append(f"{v:.2f} | {100 * v / r['step']:.1f}")
        print(f"| {k} | {' | '.join(cells)} |")
    print(f"\n| sampler alone (ms, median) | {' | '.join(f'c={c}' for c in results)} |")
    print("|---|" + "---|" * len(results))
    for name in next(iter(results.values()))[1]:
        print(f"| {name} | {' | '.join(f'{s[name]:.2f}' for _, s in results.values())} |")


if __name__ == "__main__":
    main()
