"""The `tessera` command: generate, chat, plan, convert, serve."""

from __future__ import annotations

import argparse
import sys
import time

from runtime.errors import TesseraError


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30,
                   help="bytes of KV pages (scales included); capacity is printed at start")
    p.add_argument("--max-model-len", type=int, default=None)
    fmts = p.add_argument_group("serving formats ('auto' = the compute dtype)")
    fmts.add_argument("--kv-cache-dtype", default="auto",
                      choices=["auto", "fp32", "bf16", "fp16", "fp8"])
    fmts.add_argument("--prefill-kv-cache-dtype", default="auto",
                      choices=["auto", "fp32", "bf16", "fp16", "fp8"])
    fmts.add_argument("--prefill-weights", default="auto",
                      choices=["auto", "fp32", "bf16", "fp16", "fp8", "int4"])
    fmts.add_argument("--decode-weights", default="auto",
                      choices=["auto", "fp32", "bf16", "fp16", "fp8", "int4"])
    fmts.add_argument("--weight-group-size", type=int, default=128, choices=[32, 64, 128])
    fmts.add_argument("--weight-asymmetric", action="store_true",
                      help="int4 with a zero point per group")
    fmts.add_argument("--serving-config", default=None, metavar="FILE",
                      help='JSON: {"prefill": {"weights": "fp8", "kv_cache_dtype": "bf16"}, '
                           '"decode": {"weights": "int4", "kv_cache_dtype": "fp8"}}')


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)


def _build(args: argparse.Namespace):
    from runtime import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, kv_cache_bytes=args.kv_cache_bytes,
              max_model_len=args.max_model_len, **format_kwargs(args))
    f = llm.serving_formats
    print(f"[{llm.kv_capacity_tokens} tokens of {f.kv.name} KV in {args.kv_cache_bytes} bytes; "
          f"prefill weights {f.prefill.weights.label}, decode weights "
          f"{f.decode.weights.label}]", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    return llm, params


def format_kwargs(args: argparse.Namespace) -> dict:
    """The LLM keyword arguments for the serving formats named on the command line."""
    if args.serving_config:
        from runtime.serving_formats import read_serving_config

        kw = read_serving_config(args.serving_config)
        kw["weight_group_size"] = kw.pop("group_size", args.weight_group_size)
        kw["weight_symmetric"] = kw.pop("symmetric", not args.weight_asymmetric)
        return kw
    return {"kv_cache_dtype": args.kv_cache_dtype,
            "prefill_kv_cache_dtype": args.prefill_kv_cache_dtype,
            "prefill_weights": args.prefill_weights, "decode_weights": args.decode_weights,
            "weight_group_size": args.weight_group_size,
            "weight_symmetric": not args.weight_asymmetric}


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
    print("tessera chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        out = llm.chat(messages, params)[0].outputs[0]
        print(f"bot> {out.text.strip()}", flush=True)
        messages.append({"role": "assistant", "content": out.text})
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # the planner owns its flags and imports no torch
        from ops.planner.cli import main as plan_main

        return plan_main(argv[1:])
    parser = argparse.ArgumentParser(prog="tessera", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plan", add_help=False,
                   help="capacity planner: weights, KV per token and KV capacity for a "
                        "config.json (tessera plan --help)")
    gen = sub.add_parser("generate", help="complete one or more prompts offline")
    gen.add_argument("prompt", nargs="+")
    _engine_args(gen)
    _sampling_args(gen, 64)
    gen.set_defaults(fn=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model (chat template)")
    chat.add_argument("--system", default=None)
    _engine_args(chat)
    _sampling_args(chat, 256)
    chat.set_defaults(fn=cmd_chat)
    from runtime.cli_convert import add_convert_parser

    add_convert_parser(sub)
    from gateway.serve import add_serve_parser

    add_serve_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except TesseraError as e:
        print(f"error: {e.reason}: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
