"""ops/bench/bench_weight_op_dispatch.py runs without a GPU (every Triton kernel stubbed) and
counts each weight op's launches at M = 1: split-K plus its reduction for W4A16, the activation
quantizer plus the matmul for block FP8, two grouped launches for fused MoE (four with W8A8's
two activation quantizers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_it_counts_each_weight_ops_host_work_and_launches():
    pytest.importorskip("triton")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "ops.bench.bench_weight_op_dispatch",
                           "--calls", "5"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r[0].strip("| "): r[1:] for r in (line.split(" | ")
                                              for line in done.stdout.splitlines())
            if len(r) == 6 and r[1][:1].isdigit()}
    launches = {name: int(cells[-1].strip(" |")) for name, cells in rows.items()}
    assert launches == {"w4a16_linear 7168x2048 g32": 2, "fp8_block_linear 7168x2048": 2,
                        "fused_moe int4 g32, top-8 of 64": 2,
                        "fused_moe fp8 W8A8, top-8 of 64": 4, "(for scale: one aten.add)": 0}
    assert all(float(cells[0]) > 0 for cells in rows.values())
