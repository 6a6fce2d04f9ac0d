"""The gateway process never loads torch: the gRPC gateway, its supervisor, `tessera serve`, the
REST shim and the SDK import without it (only worker processes compute)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GATEWAY_MODULES = ("gateway.serve", "gateway.runner", "gateway.supervisor",
                   "gateway.grpc_server", "gateway.client", "gateway.rest.app",
                   "gateway.rest.http_server", "ops.cli")


def test_gateway_and_rest_modules_import_without_torch():
    code = ("import importlib, sys\n"
            f"for m in {GATEWAY_MODULES!r}: importlib.import_module(m)\n"
            # `tessera serve` builds every subcommand's parser before it serves
            "importlib.import_module('ops.cli').build_parser()\n"
            "heavy = sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules)\n"
            "print(','.join(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"the gateway imported {proc.stdout.strip()}"
