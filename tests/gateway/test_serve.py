"""`tessera serve` flags: defaults from the issue, serving formats passed on to workers."""

from __future__ import annotations

import argparse

from gateway.serve import _worker_format_args, add_serve_parser


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_defaults_bind_loopback_on_50051() -> None:
    args = parse()
    assert (args.host, args.grpc_port, args.api_keys) == ("127.0.0.1", 50051, None)
    assert _worker_format_args(args) == ()


def test_serving_formats_reach_the_worker_command_line() -> None:
    args = parse("--kv-cache-dtype", "fp8", "--decode-weights", "int4")
    assert _worker_format_args(args) == ("--kv-cache-dtype", "fp8", "--decode-weights", "int4")
