"""`python3 -m ops.eval`: compare two serving configs of one model on the same text.

    python3 -m ops.eval --a kv_cache_dtype=bf16 --b kv_cache_dtype=fp8 \\
        --thresholds kl=0.05,top1=0.9,match=0.5,ppl_ratio=1.02

A config is `key=value,...`, passed as keyword arguments to `runtime.LLM` (values read as bool
`true`/`false`, `none`, int, float, else string; `model=PATH` picks the checkpoint). Both load
and stay resident. The text (default: Python's own `pydoc_data.topics`; or `--text FILE`) is
tokenized without special tokens and cut into non-overlapping windows of `--window` tokens, at
most `--max-windows` of them, evenly spaced over the text.

Measured, each with a 95% bootstrap CI (resampling windows, or prompts, not tokens):
  - kl: mean KL(A‖B) of the teacher-forced next-token distributions (`LLM.prompt_logits`, the
    engine's paged path, so the KV format and prefill weights count), nats per position;
  - top1: fraction of positions where both configs' most likely next token is the same;
  - ppl_a, ppl_b: perplexity exp(mean NLL of the actual next token); ppl_ratio = B / A;
  - match: greedy continuation agreement. For each prompt (the first `--prompt-tokens` of a
    window) both configs generate `--max-tokens` tokens at temperature 0 (EOS ignored); the
    prompt scores the number of leading tokens that agree before B first differs from A.
    match = sum of those prefixes / sum of continuation lengths; 1.0 means identical output.
    Positions after a divergence are not counted: the two contexts differ from there on.

Verdict (exit code 0 pass, 1 fail, 2 bad arguments): for each `--thresholds` entry, kl and
ppl_ratio pass when the CI upper bound <= threshold; top1 and match pass when the CI lower
bound >= threshold. No thresholds: report only, exit 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ops.eval.compare import EvalSettings, ServingModel, compare, tokenize
from ops.eval.report import build_report, markdown
from ops.eval.spec import SpecError, check_kwargs, parse_config, parse_thresholds
from ops.eval.text import load_text, make_windows
from ops.eval.verdict import METRICS, judge

Loader = Callable[[dict[str, Any]], ServingModel]


def load_llm(kwargs: dict[str, Any]) -> ServingModel:
    from runtime import LLM

    return LLM(**kwargs)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m ops.eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, metavar="CONFIG", help="reference config, key=value,...")
    ap.add_argument("--b", required=True, metavar="CONFIG", help="candidate config, key=value,...")
    ap.add_argument("--text", metavar="PATH", help="a UTF-8 text file (default: pydoc topics)")
    ap.add_argument("--window", type=int, default=256, help="tokens per window")
    ap.add_argument("--max-windows", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="greedy prompt length")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy continuation length")
    ap.add_argument("--prompts", type=int, default=None,
                    help="greedy prompts (default: one per window; 0: skip greedy match)")
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--thresholds", default="", metavar="SPEC",
                    help=f"metric=value,... over {', '.join(METRICS)}")
    ap.add_argument("--json", action="store_true", help="print the JSON report, not the table")
    ap.add_argument("--out", metavar="PATH", help="also write the JSON report here")
    return ap


def main(argv: list[str] | None = None, *, loader: Loader | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        kwargs_a, kwargs_b = parse_config(args.a), parse_config(args.b)
        if loader is None:
            from runtime.llm import LLM

            check_kwargs(kwargs_a, LLM.__init__)
            check_kwargs(kwargs_b, LLM.__init__)
        thresholds = parse_thresholds(args.thresholds, METRICS)
        settings = EvalSettings(window=args.window, max_windows=args.max_windows,
                                prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                                num_prompts=args.prompts, resamples=args.resamples,
                                seed=args.seed)
        text, source = load_text(args.text)
    except (SpecError, ValueError, OSError) as e:
        ap.error(str(e))
    load = loader or load_llm
    seconds: dict[str, float] = {}
    llms = []
    for side, kwargs in (("a", kwargs_a), ("b", kwargs_b)):
        start = time.perf_counter()
        try:
            llms.append(load(kwargs))
        except Exception as e:  # a config the engine refuses is a usage error, said plainly
            print(f"config {side.upper()} ({getattr(args, side)!r}) failed to load: "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
            return 2
        seconds[f"load_{side}"] = time.perf_counter() - start
        note(f"loaded {side.upper()} in {seconds[f'load_{side}']:.1f} s")
    try:
        ids = tokenize(llms[0], llms[1], text)
        windows = make_windows(ids, settings.window, settings.max_windows)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    comparison = compare(llms[0], llms[1], windows, settings, progress=note)
    checks = judge(comparison.estimates, thresholds)
    report = build_report(spec_a=args.a, spec_b=args.b, kwargs_a=kwargs_a, kwargs_b=kwargs_b,
                          source=source, text_tokens=len(ids), settings=settings,
                          comparison=comparison, checks=checks, seconds=seconds)
    print(json.dumps(report, indent=2) if args.json else markdown(report), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


def note(message: str) -> None:
    print(f"[ops.eval] {message}", file=sys.stderr, flush=True)
