"""The `tessera` command: generate, chat, convert, serve, plan, bench. It sits on the top floor: it
composes each floor's own subcommands and nothing imports it."""

from __future__ import annotations

import argparse
import sys

from runtime import ShadowedPackageError, check_packages
from runtime.errors import TesseraError


def build_parser() -> argparse.ArgumentParser:
    from gateway.serve import add_serve_parser
    from ops.bench.serving.cli import add_bench_parser
    from runtime.cli import add_chat_parser, add_convert_parser, add_generate_parser

    parser = argparse.ArgumentParser(prog="tessera", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plan", add_help=False,
                   help="capacity planner: weights, KV per token and KV capacity for a "
                        "config.json (tessera plan --help)")
    add_generate_parser(sub)
    add_chat_parser(sub)
    add_convert_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:  # NOTE: before any import that reaches `kernels`, which would fail far from the cause
        check_packages()
    except ShadowedPackageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if argv[:1] == ["plan"]:  # the planner owns its flags and imports no torch
        from ops.planner.cli import main as plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except TesseraError as e:
        print(f"error: {e.reason}: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
