"""ops/bench/gpu_check.py and gpu_check_moe_mla.py: without CUDA they measure nothing and exit 2
with one line (their shared start, `check_device`, as the engine, MoE-engine and matmul checks
do)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.environ.get("TESSERA_TRITON_NATIVE") == "1",
                                reason="a CUDA run: gpu_check.sh runs the scripts itself")


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


@pytest.mark.parametrize("module", ["ops.bench.gpu_check", "ops.bench.gpu_check_moe_mla"])
def test_without_cuda_it_exits_2_and_measures_nothing(module):
    done = _run(module)
    assert done.returncode == 2 and done.stdout == ""
    assert "no CUDA device" in done.stderr

