"""Weight formats: projection bytes per format (ratio to bf16), decode tok/s at concurrency 1 and
prefill tok/s, formats interleaved and repeated, medians printed as a Markdown table.

    python3 -m ops.bench.bench_weights --repeats 3 --decode-tokens 64 --prefill-tokens 512
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

from runtime import LLM, SamplingParams
from runtime.formats import WeightFormat
from runtime.quant import convert_model, linear_weight_bytes

FORMATS = {"bf16": WeightFormat("bf16"), "fp8": WeightFormat("fp8"),
           "int4-g128": WeightFormat("int4", 128),
           "int4-g128-asym": WeightFormat("int4", 128, symmetric=False)}
TEXT = ("The history of the printing press begins with movable type, ink and paper, and with "
        "the people who combined them into a trade that changed how knowledge travelled. ")


def engine_for(label: str, args: argparse.Namespace) -> LLM:
    fmt = FORMATS[label]
    kwargs: dict = dict(kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=4,
                        enable_prefix_caching=False)
    if fmt.name in ("bf16", "fp16", "fp32"):
        # Unquantized weights are served in the compute dtype: fp32 on CPU (a bf16 matmul
        # would need bf16 activations), so this row is the engine's dense baseline.
        return LLM(**kwargs)
    params = inspect.signature(LLM).parameters
    native = "decode_weights" in params and not args.swap_models
    if native and (fmt.symmetric or "weight_symmetric" in params):
        if not fmt.symmetric:
            kwargs["weight_symmetric"] = False
        return LLM(prefill_weights=fmt.name, decode_weights=fmt.name,
                   weight_group_size=fmt.group_size, **kwargs)
    llm = LLM(**kwargs)  # fall back: swap a converted model into the runner
    if fmt.name in ("bf16", "fp16", "fp32"):
        return llm  # the engine's own dtype (fp32 on CPU): a bf16 matmul needs bf16 activations
    model = convert_model(llm.engine.model, fmt)
    for name in ("model", "prefill_model", "decode_model"):
        if hasattr(llm.engine.runner, name):
            setattr(llm.engine.runner, name, model)
    return llm


def measure(llm: LLM, prompt_ids: list[int], decode_tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    llm.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0.0))
    prefill = len(prompt_ids) / (time.perf_counter() - start)
    start = time.perf_counter()
    llm.generate([prompt_ids[:8]], SamplingParams(max_tokens=decode_tokens, temperature=0.0,
                                                  ignore_eos=True))
    decode = decode_tokens / (time.perf_counter() - start)
    return prefill, decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    ap.add_argument("--swap-models", action="store_true",
                    help="convert the engine's model here instead of LLM(decode_weights=...)")
    args = ap.parse_args()
    torch.manual_seed(0)
    base = LLM(kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=4, enable_prefix_caching=False)
    source = base.engine.model
    bf16_bytes = linear_weight_bytes(convert_model(source, FORMATS["bf16"])).total
    ids = base.engine.tokenizer.encode(TEXT * 64)[: args.prefill_tokens]
    engines = {label: engine_for(label, args) for label in args.formats}
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label in args.formats}
    for label in args.formats:  # warm up (fp8's compiled decode, allocator)
        measure(engines[label], ids[:16], 2)
    for _ in range(args.repeats):
        for label in args.formats:  # interleaved: drift on a shared box hits every format
            samples[label].append(measure(engines[label], ids, args.decode_tokens))
    print("| weights | projection bytes | vs bf16 | prefill tok/s | decode tok/s (c=1) |")
    print("|---|---|---|---|---|")
    for label in args.formats:
        nbytes = linear_weight_bytes(convert_model(source, FORMATS[label])).total
        prefill = statistics.median(s[0] for s in samples[label])
        decode = statistics.median(s[1] for s in samples[label])
        print(f"| {label} | {nbytes:,} | {nbytes / bf16_bytes:.3f} | {prefill:.1f} | "
              f"{decode:.1f} |")


if __name__ == "__main__":
    main()
