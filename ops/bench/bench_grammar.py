"""What constrained decoding costs a decode step, at concurrency 1 and 32, as a ratio to
unconstrained decoding measured in the same run (issue 18).

    python3 -m ops.bench.bench_grammar --concurrency 1 32 --rounds 5 --tokens 48

One engine (the default model, fp32, 1 GiB of KV) serves, per round and concurrency, the same
prompts twice: once free (`ignore_eos`), once constrained by a JSON schema that cannot be
complete within `--tokens` tokens (an array of at least 40 small objects), so every sequence
stays constrained for the whole run. Both sample at temperature 1 with the same seeds. The
order of the two alternates between rounds, so the shared box's drift falls on both.

Counted: decode steps where all `c` sequences decode (no prefill chunk in the step, none
finishing). Reported per mode: the step's median and p90 wall time; for the constrained mode
also what the grammar added inside the step: llguidance's mask fill (its thread pool), the
mask's application in the sampler, and advancing every matcher by its sampled token. The
ratio is the constrained median over the free median, pooled over rounds, with the range of
the per-round ratios. Compiling a request's grammar (once, when it is added) is timed apart.
Prints Markdown; writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import runtime.sampler
from ops.bench.workload import make_workload
from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.grammar import GrammarMatcher
from runtime.sampling_params import SamplingParams
from runtime.structured_output import StructuredOutput

# At least 40 items of ~12 tokens each: never complete within a few hundred tokens, and every
# part bounded (short strings, small integers) so that no sequence loops inside one value.
LONG_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
               "properties": {"items": {"type": "array", "minItems": 40, "items": {
                   "type": "object", "additionalProperties": False,
                   "required": ["name", "qty", "tags"],
                   "properties": {"name": {"type": "string", "maxLength": 16},
                                  "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                                  "tags": {"type": "array", "maxItems": 3,
                                           "items": {"enum": ["new", "used", "spare"]}}}}}}}
PARTS = ("fill", "apply", "accept", "compile")


class Timers:
    """Seconds spent in the grammar's parts, since the last `take`."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - start
        return timed

    def take(self) -> dict[str, float]:
        out, self.spent = dict(self.spent), defaultdict(float)
        return out


def instrument(engine: LLMEngine) -> Timers:
    """Time the grammar's parts where the engine calls them (a benchmark-only patch)."""
    timers = Timers()
    grammars = engine.grammars
    grammars.fill_masks = timers.wrap("fill", grammars.fill_masks)  # type: ignore[method-assign]
    grammars.matcher = timers.wrap("compile", grammars.matcher)  # type: ignore[method-assign]
    runtime.sampler.apply_token_masks = timers.wrap(  # type: ignore[attr-defined]
        "apply", runtime.sampler.apply_token_masks)
    GrammarMatcher.accept = timers.wrap("accept", GrammarMatcher.accept)  # type: ignore
    return timers


def run_once(engine: LLMEngine, timers: Timers, prompts: list[str], tokens: int,
             constrained: bool, tag: str) -> dict[str, Any]:
    so = StructuredOutput.json_schema(LONG_SCHEMA) if constrained else None
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    timers.take()
    for i, (rid, prompt) in enumerate(zip(rids, prompts, strict=True)):
        engine.add_request(rid, prompt, SamplingParams(
            max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=not constrained,
            structured_output=so))
    compile_s = timers.take().get("compile", 0.0)
    steps: list[float] = []
    parts: dict[str, list[float]] = {p: [] for p in PARTS[:3]}
    while engine.has_unfinished_requests():
        seqs = [engine.requests.get(r) for r in rids]
        decoding = all(s is not None and s.output_token_ids for s in seqs)
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        spent = timers.take()
        for out in outs:
            assert out.error is None, out.error
        if decoding and not any(o.finished for o in outs):
            steps.append(elapsed)
            for p in parts:
                parts[p].append(spent.get(p, 0.0))
    engine.check_quiescent()
    return {"steps": steps, "parts": parts, "compile_s_per_request": compile_s / len(prompts)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [s for r in runs for s in r["steps"]]
    out = {"steps": len(steps), "step_ms_median": 1e3 * statistics.median(steps),
           "step_ms_p90": 1e3 * statistics.quantiles(steps, n=10)[-1]}
    for p in PARTS[:3]:
        values = [v for r in runs for v in r["parts"][p]]
        out[f"{p}_us_median"] = 1e6 * statistics.median(values)
    out["compile_ms_per_request"] = 1e3 * statistics.median(
        r["compile_s_per_request"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48, help="output tokens per request")
    ap.add_argument("--out", default="ops/bench/out/grammar.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    engine = LLMEngine.from_path(None, EngineConfig(kv_cache_bytes=1 << 30, max_num_seqs=64))
    engine.warm_up()
    timers = instrument(engine)
    rows = []
    for c in args.concurrency:
        prompts = [r.prompt for r in make_workload(c, seed=c, max_prompt_chars=400)]
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        ratios = []
        for k in range(args.rounds):
            order = (False, True) if k % 2 == 0 else (True, False)
            for constrained in order:
                runs[constrained].append(run_once(engine, timers, prompts, args.tokens,
                                                  constrained, f"c{c}-r{k}-{constrained}"))
            free, bound = (statistics.median(runs[m][-1]["steps"]) for m in (False, True))
            ratios.append(bound / free)
        row = {"concurrency": c, "rounds": args.rounds, "free": summarize(runs[False]),
               "constrained": summarize(runs[True]), "round_ratios": ratios}
        row["ratio"] = row["constrained"]["step_ms_median"] / row["free"]["step_ms_median"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "tokens": args.tokens, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    lines = ["| concurrency | steps counted (free / constrained) | free step p50 / p90 ms | "
             "constrained step p50 / p90 ms | ratio (per-round range) | mask fill p50 us | "
             "mask apply p50 us | matcher advance p50 us | compile ms / request |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        f, g = r["free"], r["constrained"]
        lines.append(
            f"| {r['concurrency']} | {f['steps']} / {g['steps']} | "
            f"{f['step_ms_median']:.1f} / {f['step_ms_p90']:.1f} | "
            f"{g['step_ms_median']:.1f} / {g['step_ms_p90']:.1f} | "
            f"{r['ratio']:.3f} ({min(r['round_ratios']):.3f}-{max(r['round_ratios']):.3f}) | "
            f"{g['fill_us_median']:.0f} | {g['apply_us_median']:.0f} | "
            f"{g['accept_us_median']:.0f} | {g['compile_ms_per_request']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
