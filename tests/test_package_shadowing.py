"""A same-named package earlier on sys.path (Hugging Face's `kernels`, which transformers >= 5.25
requires, installed beside tessera) makes `import kernels` get that one: tessera says so in one
line at its entry points instead of failing at some later `from kernels import ...`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, code: list[str], shadow: str | None) -> subprocess.CompletedProcess:
    """`python code...` from tmp_path, with a fake top-level `shadow` package ahead of ours."""
    path = [str(ROOT)]
    if shadow is not None:
        fake = tmp_path / "site" / shadow
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("class CUDAProperties: ...\n")
        path.insert(0, str(tmp_path / "site"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, *code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("shadow", ["kernels", "gateway", "ops"])
def test_the_offline_api_names_the_shadowing_package(tmp_path, shadow):
    done = _run(tmp_path, ["-c", "from runtime import LLM"], shadow)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("runtime.ShadowedPackageError: tessera's `" + shadow), last
    assert str(tmp_path / "site" / shadow) in last and f"pip uninstall {shadow}" in last


def test_the_command_says_so_in_one_line_and_exits_2(tmp_path):
    done = _run(tmp_path, ["-m", "ops.cli", "generate", "Hi"], "kernels")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "Hugging Face's `kernels`" in done.stderr


def test_without_a_shadow_the_check_passes_and_the_exports_resolve(tmp_path):
    done = _run(tmp_path, ["-c", "import runtime; runtime.check_packages(); "
                                 "from runtime import SamplingParams; print(SamplingParams)"],
                None)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SamplingParams" in done.stdout
