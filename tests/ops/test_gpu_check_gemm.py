"""ops/bench/gpu_check_gemm.py: without CUDA it measures nothing and exits 2; `--tiny` runs
every timed path (INT4 W4A16, FP8 quantize + matmul, the bf16 baselines) in Triton's
interpreter and prints both tables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.environ.get("TESSERA_TRITON_NATIVE") == "1",
                                reason="a CUDA run: gpu_check.sh runs the script itself")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "ops.bench.gpu_check_gemm", *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_without_cuda_it_exits_2_and_measures_nothing():
    done = _run()
    assert done.returncode == 2 and done.stdout == ""
    assert "no CUDA device" in done.stderr


def test_tiny_runs_every_timed_path_in_the_interpreter():
    pytest.importorskip("triton")
    done = _run("--tiny")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines()
            if line.startswith("| g32 sym")]
    assert [(r[2], r[3]) for r in rows] == [("1", "1"), ("1", "2"), ("4", "1"), ("4", "2")]
    assert sum(line.startswith("| 128x128 / 1x128") for line in done.stdout.splitlines()) == 1
