"""ops/bench/gpu_check_engine.py: without CUDA it measures nothing and exits 2; `--tiny` runs
the engine section (random models built on the device with BF16 and FP8 KV under one budget, a
first request served eagerly, the capture, decode with graphs on / off and tags off) in
Triton's interpreter and prints a row per batch, with the static-buffer runner's greedy tokens
equal to the eager step's, and BF16 out of pages where FP8 still fits."""

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
    return subprocess.run([sys.executable, "-m", "ops.bench.gpu_check_engine", *args],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_without_cuda_it_exits_2_and_measures_nothing():
    done = _run()
    assert done.returncode == 2 and done.stdout == ""
    assert "no CUDA device" in done.stderr


def test_tiny_runs_the_engine_section_in_the_interpreter():
    pytest.importorskip("triton")
    done = _run("--tiny")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines()
            if line[:4] in ("| 1 ", "| 2 ", "| 4 ")]
    assert [r[0] for r in rows] == ["| 1", "| 2", "| 4"]
    assert all(r[6] == "yes" for r in rows), rows
    assert [r[1] == "out of KV" for r in rows] == [False, False, True], rows  # BF16's pages
    assert all(float(r[2]) > 0 for r in rows), rows  # FP8 holds all four
    assert "0 decode graphs captured" in done.stdout  # no CUDA: the buffers run eagerly
