"""Imports run one way (kernels <- runtime <- gateway <- ops, loadtest, the command) and never
round in a cycle; the checker (`tests/import_graph.py`) reads source, it runs nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import Violation, find_violations

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def violations() -> list[Violation]:
    return find_violations(REPO)


def test_no_import_goes_up_a_floor_or_rounds_a_cycle(violations):
    assert not violations, "imports that break the one-way rule:\n" + "\n".join(
        str(v) for v in violations)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_planted_upward_import_and_cycle_are_reported_exactly(tmp_path):
    write(tmp_path, {
        "kernels/__init__.py": "",
        "kernels/x.py": "import torch\n\nfrom runtime import y\n",
        "runtime/__init__.py": "",
        "runtime/y.py": "import runtime.z\n",
        "runtime/z.py": "def f():\n    from . import y\n",
        "gateway/__init__.py": "",
        "gateway/g.py": "from runtime.y import f\nfrom kernels import x\n",
    })
    assert [str(v) for v in find_violations(tmp_path)] == [
        "upward: kernels/x.py:3 kernels.x -> runtime.y",
        "cycle: runtime/y.py:1 runtime.y -> runtime.z",
        "cycle: runtime/z.py:2 runtime.z -> runtime.y",
    ]


def test_relative_imports_resolve_from_a_package_and_from_a_module(tmp_path):
    write(tmp_path, {
        "runtime/__init__.py": "",
        "runtime/kv/__init__.py": "from . import pages\nfrom .pages import Pool\n",
        "runtime/kv/pages.py": "from ..config import C\n",
        "runtime/config.py": "def load():\n    from .kv.pages import Pool\n",
    })
    assert [str(v) for v in find_violations(tmp_path)] == [
        "cycle: runtime/config.py:2 runtime.config -> runtime.kv.pages",
        "cycle: runtime/kv/pages.py:1 runtime.kv.pages -> runtime.config",
    ]
