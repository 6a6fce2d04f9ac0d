"""The offline subcommands of `tessera`: generate and chat (the command itself is ops/cli.py)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from runtime.engine_flags import add_engine_flags, engine_config

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

    llm = LLM.from_config(args.model, engine_config(args))
    f = llm.serving_formats
    print(f"[{llm.kv_capacity_tokens} tokens of {f.kv.name} KV in {args.kv_cache_bytes} bytes; "
          f"prefill weights {f.prefill.weights.label}, decode weights "
          f"{f.decode.weights.label}]", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
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
            print(file=sys.stderr)
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        reply = ""
        print("bot> ", end="", flush=True)
        try:
            for out in llm.stream(llm.tokenizer.encode_chat(messages), params):
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
