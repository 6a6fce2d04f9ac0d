"""The offline subcommands of `tessera`: generate, chat and convert's flags (the command itself is
ops/cli.py)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from runtime.engine_flags import add_engine_flags, engine_config
from runtime.formats import CONVERT_METHODS, INT4_GROUP_SIZES

HELP_FORMAT = argparse.ArgumentDefaultsHelpFormatter


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=-1, help="-1 or 0 = off")
    g.add_argument("--seed", type=int, default=None, help="same seed, same output")


def _build(args: argparse.Namespace) -> tuple[Any, Any]:
    from runtime import LLM, SamplingParams

    # NOTE: the sampling flags are checked before the model loads (seconds), not after
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    llm = LLM.from_config(args.model, engine_config(args))
    kv_mib = llm.engine.kv_cache_budget_bytes / 2**20
    prefill, decode = llm.engine.weight_labels
    weights = (f"weights {prefill}" if prefill == decode
               else f"prefill weights {prefill}, decode weights {decode}")
    print(f"[{llm.kv_capacity_tokens} tokens of {llm.serving_formats.kv.name} KV in "
          f"{kv_mib:.0f} MiB; {weights}]", file=sys.stderr)
    return llm, params


def cmd_generate(args: argparse.Namespace) -> int:
    llm, params = _build(args)
    start = time.perf_counter()
    outs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    n = 0
    for prompt, out in zip(args.prompt, outs, strict=True):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
        n += len(out.outputs[0].token_ids)
    print(f"[{len(outs)} prompts, {n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s; "
          f"{llm.kv_capacity_tokens} tokens of KV]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm, params = _build(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("tessera chat: type a message; an empty line, Ctrl-D or Ctrl-C to quit "
          "(Ctrl-C during a reply stops the reply).", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()  # ends the prompt's line, where input() wrote it
            break
        if not sys.stdin.isatty():
            print(line)  # piped input is not echoed: without this the reply shares its line
        if not line:
            break
        messages.append({"role": "user", "content": line})
        reply = ""
        print("bot> ", end="", flush=True)
        try:
            for out in llm.stream(llm.engine.processor.process_chat(messages), params):
                reply += out.delta_text
                print(out.delta_text, end="", flush=True)
        except KeyboardInterrupt:  # the stream's own cleanup aborts the request
            print(" [stopped]", end="")
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})
    return 0


def add_generate_parser(sub: Any) -> argparse.ArgumentParser:
    gen = sub.add_parser("generate", help="complete one or more prompts offline",
                         formatter_class=HELP_FORMAT)
    gen.add_argument("prompt", nargs="+", help="prompt text (one argument per prompt)")
    add_engine_flags(gen)
    _sampling_args(gen, 64)
    gen.set_defaults(fn=cmd_generate)
    return gen


def add_chat_parser(sub: Any) -> argparse.ArgumentParser:
    chat = sub.add_parser("chat", help="interactive chat with the model (chat template), "
                          "replies streamed as they are decoded", formatter_class=HELP_FORMAT)
    chat.add_argument("--system", default=None, help="a system message to start with")
    add_engine_flags(chat)
    _sampling_args(chat, 256)
    chat.set_defaults(fn=cmd_chat)
    return chat


# NOTE: the parser lives here, torch-free, because `tessera serve` builds every subcommand's
# parser in the gateway process; the conversion itself (runtime.cli_convert) imports torch.
CONVERT_DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_convert_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("convert", help="write a checkpoint with fp8 or int4 projections",
                              formatter_class=HELP_FORMAT)
    p.add_argument("src", nargs="?", default=None,
                   help="GGUF file or HF safetensors directory (default: the embedded SmolLM2)")
    p.add_argument("dst", help="new directory for the converted checkpoint")
    p.add_argument("--weights", required=True, choices=["int4", "fp8", "fp8-block"],
                   help="format of the projections (fp8: a scale per output channel; "
                        "fp8-block: DeepSeek-V3's 128x128 block scales, weight_scale_inv)")
    p.add_argument("--group-size", type=int, default=128, choices=list(INT4_GROUP_SIZES),
                   help="int4 group size")
    p.add_argument("--asymmetric", action="store_true", help="int4 with a zero point per group")
    p.add_argument("--dtype", default="auto", choices=list(CONVERT_DTYPES),
                   help="dtype of unquantized tensors (default: as in a safetensors source, "
                        "bfloat16 from GGUF)")
    p.add_argument("--method", default="rtn", choices=list(CONVERT_METHODS),
                   help="rounding: rtn (round to nearest; int4 with a per-group scale search) or "
                        "gptq (calibrated on standard-library docstrings)")
    p.add_argument("--calibration-windows", type=int, default=64,
                   help="gptq: windows of 256 tokens to calibrate on")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=None,
                   help="gptq: round columns by decreasing input energy, with static groups "
                        "(default on for gptq)")
    p.add_argument("--strict-groups", action="store_true",
                   help="refuse an input dimension the group size does not divide, instead of "
                        "a shorter last group")
    p.set_defaults(fn=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from runtime.cli_convert import convert_checkpoint
    from runtime.formats import WeightFormat

    fmt = WeightFormat.parse(args.weights, args.group_size, not args.asymmetric)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    src_bytes, dst_bytes = convert_checkpoint(args.src, args.dst, fmt, dtype,
                                              partial_groups=not args.strict_groups,
                                              method=args.method,
                                              calibration_windows=args.calibration_windows,
                                              act_order=args.act_order)
    print(f"{fmt.label} ({args.method}): source {src_bytes:,} bytes -> {args.dst} "
          f"{dst_bytes:,} bytes ({dst_bytes / src_bytes:.2f}x)")
    return 0
