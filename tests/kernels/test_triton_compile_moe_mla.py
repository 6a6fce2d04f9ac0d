"""Every fused-MoE, MLA-decode and latent-store kernel variant compiles for sm_90 (H100/H200)
on this CPU-only machine (tests/kernels/triton_compile_sm90_moe_mla.py, in a subprocess without
TRITON_INTERPRET): the interpreter accepts code the GPU compiler rejects, e.g. `.to()` on a
scalar argument that Triton specialised to the constexpr 1."""

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

SCRIPT = Path(__file__).with_name("triton_compile_sm90_moe_mla.py")


def test_every_moe_and_mla_kernel_variant_compiles_to_an_sm90_cubin(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok ") == 16
