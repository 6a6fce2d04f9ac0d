"""`tessera serve` refuses, before any worker starts, an engine choice no worker could ever start
with: a new-user trial saw `--device cuda` (a CPU build of torch) and `--attention-backend
triton` (no triton) restart workers until --worker-start-timeout-s, a traceback each time."""

from __future__ import annotations

import argparse
import importlib.metadata
import socket
import subprocess
import sys
import time

import pytest

import runtime.extras
from gateway.serve import check_engine_choices

CPU_TORCH = "+cpu" in importlib.metadata.version("torch")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not CPU_TORCH, reason="needs a CPU build of torch (this one may see CUDA)")
def test_cuda_on_a_cpu_build_of_torch_exits_1_with_one_line_before_any_worker():
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ops.cli", "serve", "--device", "cuda", "--grpc-port",
         str(_free_port()), "--http-port", str(_free_port())],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "--device cuda" in proc.stderr and "CPU build" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "starting workers" not in proc.stdout  # refused before the gateway started any
    assert time.monotonic() - started < 60


def test_triton_without_its_extra_is_refused_naming_the_extra(monkeypatch):
    real = runtime.extras.importlib.util.find_spec
    monkeypatch.setattr(runtime.extras.importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(SystemExit, match=r"needs the 'cuda' extra") as e:
        check_engine_choices(argparse.Namespace(attention_backend="triton", device="cpu"))
    assert e.value.code != 0


def test_possible_choices_pass():
    check_engine_choices(argparse.Namespace(attention_backend="cpu", device="cpu"))
    check_engine_choices(argparse.Namespace(attention_backend="auto", device="auto"))
