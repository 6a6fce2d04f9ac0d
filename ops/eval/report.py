"""The harness's output: one JSON-able dict, and a human Markdown rendering of it."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ops.eval.compare import Comparison, EvalSettings
from ops.eval.verdict import Check

# metric -> (label, format)
ROWS: dict[str, tuple[str, str]] = {
    "kl": ("mean KL(A‖B), nats/token", ".3g"),
    "top1": ("top-1 agreement", ".4f"),
    "ppl_a": ("perplexity A", ".4f"),
    "ppl_b": ("perplexity B", ".4f"),
    "ppl_ratio": ("perplexity ratio B/A", ".5f"),
    "match": ("greedy match (agreeing prefix / tokens)", ".4f"),
}

DEFINITIONS = {
    "kl": "mean over scored positions of sum_v p_A(v) log(p_A(v)/p_B(v)), teacher-forced",
    "top1": "fraction of scored positions where argmax p_A == argmax p_B",
    "ppl_a": "exp(mean NLL of the actual next token) under A",
    "ppl_b": "exp(mean NLL of the actual next token) under B",
    "ppl_ratio": "perplexity B / perplexity A = exp(mean NLL_B - mean NLL_A)",
    "match": "sum over prompts of tokens before B's greedy continuation first differs from A's, "
             "over the sum of A's continuation lengths",
    "ci": "95% percentile bootstrap; unit = window (greedy match: prompt)",
    "verdict": "lower-is-better metrics (kl, ppl_ratio) pass if CI upper <= threshold; "
               "higher-is-better (top1, match) pass if CI lower >= threshold",
}


def build_report(*, spec_a: str, spec_b: str, kwargs_a: dict[str, Any],
                 kwargs_b: dict[str, Any], source: str, text_tokens: int,
                 settings: EvalSettings, comparison: Comparison, checks: list[Check],
                 seconds: dict[str, float]) -> dict[str, Any]:
    return {
        "a": {"spec": spec_a, "kwargs": kwargs_a},
        "b": {"spec": spec_b, "kwargs": kwargs_b},
        "text": {"source": source, "tokens": text_tokens},
        "settings": asdict(settings),
        "windows": comparison.windows,
        "tokens": comparison.tokens,
        "prompts": comparison.prompts,
        "continuation_tokens": comparison.continuation_tokens,
        "metrics": {k: v.as_dict() for k, v in comparison.estimates.items()},
        "match_prefixes": comparison.match_prefixes,
        "checks": [c.as_dict() for c in checks],
        "passed": all(c.passed for c in checks),
        "seconds": {**seconds, **{f"eval_{k}": v for k, v in comparison.seconds.items()}},
        "definitions": DEFINITIONS,
    }


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        f"A: {report['a']['spec'] or '(defaults)'}",
        f"B: {report['b']['spec'] or '(defaults)'}",
        f"text: {report['text']['source']} ({report['text']['tokens']:,} tokens); "
        f"{report['windows']} windows x {s['window']} tokens = {report['tokens']:,} "
        f"next-token predictions",
        f"greedy: {report['prompts']} prompts of {s['prompt_tokens']} tokens, "
        f"{s['max_tokens']} tokens each ({report['continuation_tokens']:,} in all)",
        f"95% CI: percentile bootstrap over windows (prompts for greedy match), "
        f"{s['resamples']} resamples, seed {s['seed']}",
        "",
        "| metric | value | 95% CI | threshold | verdict |",
        "|---|---|---|---|---|",
    ]
    checks = {c["metric"]: c for c in report["checks"]}
    for metric, (label, fmt) in ROWS.items():
        est = report["metrics"].get(metric)
        value = "-" if est is None else format(est["value"], fmt)
        ci = "-" if est is None else f"[{est['lo']:{fmt}}, {est['hi']:{fmt}}]"
        check = checks.get(metric)
        rule = verdict = ""
        if check is not None:
            op = "<=" if check["bound"] == "upper" else ">="
            rule = f"{check['bound']} {op} {check['threshold']:g}"
            verdict = "pass" if check["passed"] else "FAIL"
        lines.append(f"| {label} | {value} | {ci} | {rule} | {verdict} |")
    if report["match_prefixes"]:
        lines += ["", f"greedy agreeing prefix per prompt (of {s['max_tokens']}): "
                      + " ".join(map(str, report["match_prefixes"]))]
    lines += ["", verdict_line(report)]
    return "\n".join(lines)


def verdict_line(report: dict[str, Any]) -> str:
    checks = report["checks"]
    if not checks:
        return "verdict: no thresholds given, nothing judged (exit 0)"
    failed = [c for c in checks if not c["passed"]]
    if not failed:
        return f"verdict: PASS ({len(checks)} of {len(checks)} checks)"
    why = "; ".join(
        f"{c['metric']} not measured" if c["observed"] is None else
        f"{c['metric']} {c['bound']} bound {c['observed']:.4g} "
        f"{'>' if c['bound'] == 'upper' else '<'} {c['threshold']:g}" for c in failed)
    return f"verdict: FAIL ({len(failed)} of {len(checks)} checks): {why}"
