"""`tessera serve` flags: the REST shim unless told not to, per-tenant limit defaults."""

from __future__ import annotations

import argparse

from gateway.serve import add_serve_parser


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_starts_the_shim_on_port_8000_by_default() -> None:
    args = parse()
    assert args.http_port == 8000 and args.no_http is False


def test_serve_takes_another_http_port_or_none() -> None:
    assert parse("--http-port", "8123").http_port == 8123
    assert parse("--no-http").no_http is True


def test_serve_takes_per_tenant_limits_for_keys_without_their_own() -> None:
    args = parse()
    assert (args.tenant_max_inflight, args.tenant_max_queued) == (None, 32)
    args = parse("--tenant-max-inflight", "4", "--tenant-max-queued", "0")
    assert (args.tenant_max_inflight, args.tenant_max_queued) == (4, 0)
