"""ops/bench/sass_mix.py: the decode attention kernel's sm_90 instructions counted without a
GPU, one row per page format, its page loads pipelined (cp.async: LDGSTS) as a launch's are;
under the interpreter it refuses with one line."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the test extra installs it)")


def _run(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**env, "TRITON_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "ops.bench.sass_mix"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_each_page_format_compiles_with_pipelined_page_loads(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = _run(env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {r[0]: dict(zip(header[1:], map(int, r[1:]), strict=True))
            for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert list(rows) == ["bf16", "fp8", "int8"]
    assert all(r["LDGSTS"] > 0 and r["HMMA"] > 0 for r in rows.values()), rows
    assert rows["bf16"]["F2F"] == 0  # 2-byte pages feed the dot as they are


def test_under_the_interpreter_it_refuses_in_one_line(tmp_path):
    done = _run({**os.environ, "TRITON_INTERPRET": "1"}, tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert "unset TRITON_INTERPRET" in done.stderr
