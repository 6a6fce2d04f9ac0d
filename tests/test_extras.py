"""A command that needs an optional extra which is not installed says, in one line and before
doing any work, which extra to install, and exits non-zero (runtime/extras.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Runs a module as `python3 -m` would, with the named top-level packages made unimportable.
_WITHOUT = """
import runpy, sys
HIDDEN = sys.argv[1].split(",")
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Hide())
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def run_without(hidden: str, module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", _WITHOUT, hidden, module, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("hidden", "module", "extra"), [
    ("transformers", "ops.bench.bench_moe", "compare"),
    ("transformers", "ops.bench.bench_engine", "compare"),
    ("grpc_tools", "gateway.protos", "protos"),
])
def test_a_command_without_its_extra_names_the_extra_in_one_line(hidden, module, extra, tmp_path):
    proc = run_without(hidden, module, *(["--out", str(tmp_path / "x.json")]
                                         if module.endswith("engine") else [str(tmp_path)]
                                         if module == "gateway.protos" else []))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert f"needs the '{extra}' extra" in lines[0] and f'pip install -e ".[{extra}]"' in lines[0]
    assert not proc.stdout and not list(tmp_path.iterdir())  # nothing done


def test_importing_the_load_tests_without_locust_names_the_load_extra():
    proc = run_without("locust,gevent,geventhttpclient", "loadtest.locustfile")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "loadtest/ needs the 'load' extra (locust is not installed): pip install -e \".[load]\""]
