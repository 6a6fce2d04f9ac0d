"""ops/bench/gpu_check_moe_engine.py: without CUDA it measures nothing and exits 2; `--tiny`
runs the MoE engine section (a random GLM-4-MoE built twice, INT4 and block-FP8, each served a
first request, then decode at each concurrency and a prefill, interleaved) in Triton's
interpreter, every phase on its Triton weight kernels, and prints the table."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import tests.kernels.triton_pools  # noqa: F401  sets TRITON_INTERPRET=1 (before triton) on CPU

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.environ.get("TESSERA_TRITON_NATIVE") == "1",
                                reason="a CUDA run: gpu_check.sh runs the script itself")


def test_without_cuda_it_exits_2_and_measures_nothing():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "ops.bench.gpu_check_moe_engine"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert "no CUDA device" in done.stderr


@pytest.mark.slow
def test_tiny_serves_int4_and_fp8_on_the_triton_weight_kernels(capsys, monkeypatch,
                                                               one_torch_thread):
    pytest.importorskip("triton")
    from kernels.triton import launch_gemm, launch_moe
    from ops.bench import gpu_check_moe_engine

    launches: Counter = Counter()

    def counting(name: str, fn):
        def counted(*args, **kwargs):
            launches[name] += 1
            launches[name + " w8a8"] += bool(kwargs.get("fp8_activations"))
            return fn(*args, **kwargs)
        return counted

    for module, name in ((launch_gemm, "w4a16_linear"), (launch_gemm, "fp8_block_linear"),
                         (launch_moe, "fused_moe")):
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    assert gpu_check_moe_engine.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "int4: weights int4-g32 / int4-g32" in out
    assert "fp8-block: weights fp8-block / fp8-block" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| decode")
            or line.startswith("| prefill")]
    assert [r[0] for r in rows] == ["| decode tok/s, concurrency 1", "| decode tok/s, "
                                    "concurrency 2", "| prefill tok/s, 2 x 24 tokens"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), rows
    # both engines ran their Triton kernels: INT4 linears, W8A8 FP8 linears and experts
    assert launches["w4a16_linear"] > 0 and launches["fp8_block_linear"] > 0
    assert 0 < launches["fused_moe w8a8"] < launches["fused_moe"]
