"""Every Triton kernel variant compiles for sm_90 (H100/H200) on this CPU-only machine: the
interpreter accepts code the GPU compiler rejects (a plain float global; `.to()` on a scalar
argument Triton specialised to the constexpr 1), so the compiler itself runs here too. Each
family's script (tests/kernels/triton_compile_*sm90*.py) runs in a subprocess without
TRITON_INTERPRET and prints one `ok` line per variant."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# NOTE: not importorskip: triton must not be imported in this process before the interpreter
# tests set TRITON_INTERPRET (tests/kernels/triton_pools.py)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the test extra installs it)")

ROOT = Path(__file__).resolve().parents[2]


SCRIPTS = ("triton_compile_sm90.py", "triton_compile_gemm_sm90.py",
           "triton_compile_sm90_moe_mla.py")


@pytest.fixture(scope="module")
def compiles(tmp_path_factory) -> dict[str, subprocess.Popen]:
    """Every family's script started at once (each its own Triton cache), so the compilers
    share the cores; the tests below wait for theirs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    running = {script: subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name(script))], cwd=ROOT, text=True,
        env={**env, "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton-cache"))},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for script in SCRIPTS}
    yield running
    for proc in running.values():
        proc.kill()
        proc.wait()


def _compile(compiles: dict[str, subprocess.Popen], script: str) -> str:
    """tests/kernels/`script`'s stdout for sm_90 once it exits 0 (else the test fails with its
    output's tail)."""
    stdout, stderr = compiles[script].communicate(timeout=900)
    assert compiles[script].returncode == 0, stdout[-2000:] + stderr[-4000:]
    return stdout


def test_every_paged_kv_kernel_variant_compiles_to_an_sm90_cubin(compiles):
    assert _compile(compiles, "triton_compile_sm90.py").count("ok ") == 19


def test_every_matmul_variant_compiles_to_a_pipelined_sm90_cubin(compiles):
    # W4A16 at each row bucket and offset kind, block-FP8 with both scale forms, the FP8
    # quantizer, the split reduce: K loops software-pipelined, the FP8 dot on wgmma
    assert _compile(compiles, "triton_compile_gemm_sm90.py").count("ok ") == 23


def test_every_moe_and_mla_kernel_variant_compiles_to_an_sm90_cubin(compiles):
    assert _compile(compiles, "triton_compile_sm90_moe_mla.py").count("ok ") == 18
