"""Tool-call validity per serving format: how often the model, unconstrained, writes a tool call
that parses and matches its function's schema (the reference's quality metric for agents).

    python3 -m ops.eval.tool_calls --formats fp32 fp8_kv int4_decode --modes auto opened \
        [--limit N]

Each of the 60 requests of `ops/eval/tool_prompts.py` is offered three functions and rendered
exactly as the REST shim renders `tools` with `tool_choice: "auto"` (the Hermes format of
`gateway/rest/tool_calls.py`, through the model's chat template); the model answers greedily,
with no constrained decoding, up to `--max-tokens` tokens or its first `</tool_call>`. Two
modes: `auto`, the answer as the model begins it (it may answer in text: "no call"); `opened`,
the assistant turn already begins with `<tool_call>\n` (a prompt prefix, as a client continuing
its final message would send; decoding stays unconstrained), which measures what the metric is
about, whether the call the model writes is valid, on a model that seldom opens one itself. The
shim's own parser reads the answer (with the prefix, in `opened` mode). A request scores:

  - valid: at least one `<tool_call>` block, and every block parsed into a call of an offered
    function whose arguments are a JSON object valid for its parameters (jsonschema, Draft
    2020-12);
  - invalid: a block that does not parse, names no offered function, or has arguments that do
    not validate (or is cut off by the token limit);
  - no call: plain text only.

Validity = valid / requests, with a 95% Wilson score interval (requests are the independent
units; greedy decoding makes each request's outcome a fixed function of the format). Also
reported: the right function called (valid and naming the request's function), and, against
the first format, how many requests changed outcome. Formats are `runtime.LLM` keyword sets
(FORMATS), loaded one at a time. `--disaggregated`: every request is prefilled (prompt and first
token) and then handed over to be decoded, its KV and first token moving as transfer frames
(`runtime.disagg.local`, the worker processes' flow driven in one process, the format's engine
on both sides); greedy decoding must give the colocated outcome request for request. Prints
Markdown; writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "fp8_kv": {"kv_cache_dtype": "fp8"},
    "int8_kv": {"kv_cache_dtype": "int8"},
    "int4_decode": {"decode_weights": "int4"},
}
OUTCOMES = ("valid", "invalid", "no_call")


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (95% by default); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Scored:
    outcome: str  # one of OUTCOMES
    right_function: bool
    detail: str  # why invalid, or the calls made


def score(text: str, offered: list[str], expected: str) -> Scored:
    """One answer's outcome (see the module docstring)."""
    import jsonschema

    from gateway.rest.tool_calls import OPEN, ToolCallParser
    from ops.eval.tool_prompts import FUNCTIONS

    if OPEN not in text:
        return Scored("no_call", False, "")
    parser = ToolCallParser(set(offered))
    list(parser.feed(text))
    list(parser.finish())
    if len(parser.calls) != text.count(OPEN):
        return Scored("invalid", False, "a block did not parse as a call of an offered function")
    for call in parser.calls:
        try:
            args = json.loads(call.arguments)
        except ValueError:
            return Scored("invalid", False, f"{call.name}: arguments are not JSON")
        errors = list(jsonschema.Draft202012Validator(FUNCTIONS[call.name][1]).iter_errors(args))
        if errors:
            return Scored("invalid", False, f"{call.name}: {errors[0].message[:120]}")
    names = [c.name for c in parser.calls]
    return Scored("valid", expected in names, ",".join(names))


def conversations() -> list[tuple[list[dict[str, str]], list[str], str]]:
    """(rendered messages, offered functions, expected function) for every request."""
    from gateway.rest.structured import ToolFields
    from gateway.rest.tool_calls import render_messages
    from ops.eval.tool_prompts import REQUESTS, offered, tool_list

    out = []
    for i, (expected, request) in enumerate(REQUESTS):
        names = offered(i)
        fields = ToolFields.model_validate({"tools": tool_list(names), "tool_choice": "auto"})
        fields.check_tools()
        messages = render_messages([{"role": "user", "content": request}], fields)
        out.append((messages, names, expected))
    return out


OPENED = "<tool_call>\n"


DISAGG_BATCH = 16  # requests handed over together (each holds its pages twice meanwhile)


def run_format(name: str, kwargs: dict[str, Any], convs: list[Any], max_tokens: int,
               modes: list[str], disaggregated: bool = False) -> list[dict[str, Any]]:
    """Load one format and score every request in each mode."""
    from runtime import LLM

    start = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - start
    results = [run_mode(llm, convs, max_tokens, mode, disaggregated) for mode in modes]
    for r in results:
        r.update(format=f"{name} prefill/decode" if disaggregated else name, kwargs=kwargs,
                 served=str(llm.serving_formats), load_s=load_s, disaggregated=disaggregated)
    return results


def generate_texts(llm: Any, prompts: list[list[int]], params: Any,
                   disaggregated: bool) -> list[str]:
    """Each prompt's output text, colocated or handed over from prefill to decode."""
    if not disaggregated:
        return [out.outputs[0].text for out in llm.generate(prompts, params)]
    from runtime.disagg.local import LocalTransfer

    local = LocalTransfer(llm.engine, llm.engine)
    texts = []
    for lo in range(0, len(prompts), DISAGG_BATCH):
        batch = {f"tool-{i}": p for i, p in enumerate(prompts[lo : lo + DISAGG_BATCH], lo)}
        results = local.generate(batch, params)
        for rid in batch:
            if results[rid].error is not None:
                raise results[rid].error
            texts.append(results[rid].text)
    return texts


def run_mode(llm: Any, convs: list[Any], max_tokens: int, mode: str,
             disaggregated: bool = False) -> dict[str, Any]:
    from runtime import SamplingParams

    start = time.perf_counter()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["</tool_call>"],
                            include_stop_str_in_output=True)
    tok = llm.tokenizer
    prefix = tok.encode(OPENED, add_special_tokens=False) if mode == "opened" else []
    outputs = generate_texts(llm, [tok.encode_chat(messages) + prefix
                                   for messages, _, _ in convs], params, disaggregated)
    generate_s = time.perf_counter() - start
    rows = []
    for (_, names, expected), out in zip(convs, outputs, strict=True):
        text = (OPENED if mode == "opened" else "") + out
        s = score(text, names, expected)
        rows.append({"expected": expected, "offered": names, "outcome": s.outcome,
                     "right_function": s.right_function, "detail": s.detail, "text": text})
    n = len(rows)
    valid = sum(r["outcome"] == "valid" for r in rows)
    right = sum(r["right_function"] for r in rows)
    return {"mode": mode, "requests": n,
            "counts": {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES},
            "validity": valid / n, "validity_ci": wilson(valid, n),
            "right_function": right / n, "right_function_ci": wilson(right, n),
            "generate_s": generate_s, "rows": rows}


def changed(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, int]:
    """Requests valid under a and not under b, and the reverse."""
    pairs = list(zip(a["rows"], b["rows"], strict=True))
    lost = sum(x["outcome"] == "valid" and y["outcome"] != "valid" for x, y in pairs)
    gained = sum(x["outcome"] != "valid" and y["outcome"] == "valid" for x, y in pairs)
    return lost, gained


def markdown(report: dict[str, Any]) -> str:
    results = report["results"]
    lines = ["| mode | format | validity [95% Wilson] | valid / invalid / no call | right "
             "function [95% Wilson] | vs the mode's first format: lost / gained | generate s |",
             "|---|---|---|---|---|---|---|"]
    first = {}
    for r in results:
        first.setdefault(r["mode"], r)
        lo, hi = r["validity_ci"]
        rlo, rhi = r["right_function_ci"]
        c = r["counts"]
        lost, gained = changed(first[r["mode"]], r)
        lines.append(f"| {r['mode']} | {r['format']} | {r['validity']:.3f} [{lo:.3f}, {hi:.3f}] | "
                     f"{c['valid']} / {c['invalid']} / {c['no_call']} | "
                     f"{r['right_function']:.3f} [{rlo:.3f}, {rhi:.3f}] | {lost} / {gained} | "
                     f"{r['generate_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m ops.eval.tool_calls", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    ap.add_argument("--modes", nargs="+", choices=["auto", "opened"], default=["opened"])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests")
    ap.add_argument("--disaggregated", action="store_true",
                    help="prefill each request, then hand it over to be decoded (see above)")
    ap.add_argument("--out", default="ops/eval/out/tool_calls.json")
    args = ap.parse_args(argv)
    convs = conversations()[: args.limit]
    results = []
    for name in args.formats:
        for r in run_format(name, FORMATS[name], convs, args.max_tokens, args.modes,
                            args.disaggregated):
            results.append(r)
            print(f"{name} {r['mode']}: validity {r['validity']:.3f} {r['counts']} "
                  f"({r['generate_s']:.0f} s)", flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": platform.processor() or platform.machine(),
              "max_tokens": args.max_tokens, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    results.sort(key=lambda r: args.modes.index(r["mode"]))  # stable: formats in order
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
