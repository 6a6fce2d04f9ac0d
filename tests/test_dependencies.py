"""Every third-party module the product packages import is declared by the install that needs
it (pyproject.toml), checked by deptry with the config in `[tool.deptry]`: an undeclared import
(DEP001, or DEP003 when another package happens to pull it in), a declaration nothing imports
(DEP002), or a test-extra package imported by product code (DEP004) fails the suite."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("runtime", "kernels", "gateway", "ops", "loadtest")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def deptry(root: Path) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "deptry", "."], cwd=root, capture_output=True,
                          text=True, timeout=120, env={"NO_COLOR": "1", "PATH": ""})
    return proc.returncode, _ANSI.sub("", proc.stdout + proc.stderr)


def issues(output: str) -> list[str]:
    """'DEPnnn name' for each issue deptry reported."""
    return [f"{m[1]} {m[2]}" for m in re.finditer(r"(DEP\d{3}) '([^']+)'", output)]


def test_no_installed_distribution_claims_a_product_package_name():
    """Another distribution with a top-level module named like one of ours (Hugging Face's
    `kernels`, which transformers 5.25 requires) shadows it or is shadowed by it: whichever
    comes first on sys.path wins the import for every caller, so both break."""
    from importlib.metadata import packages_distributions

    claimed = {name: [d for d in dists if d != "tessera"]
               for name, dists in packages_distributions().items() if name in PRODUCT}
    clashes = {name: dists for name, dists in claimed.items() if dists}
    assert not clashes, f"installed distributions that claim tessera's packages: {clashes}"


def test_every_product_import_is_declared_and_every_declaration_used():
    code, output = deptry(REPO)
    assert code == 0, f"dependency issues (declare them in pyproject.toml):\n{output}"


@pytest.fixture
def product_copy(tmp_path: Path) -> Path:
    """The product packages' Python files and pyproject.toml, to plant a mistake in."""
    files = subprocess.run(["git", "ls-files", *PRODUCT], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in [*(f for f in files if f.endswith(".py")), "pyproject.toml"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / name, tmp_path / name)
    return tmp_path


def plant(root: Path, module: str, line: str) -> None:
    path = root / module
    path.write_text(path.read_text() + f"\n{line}\n")


def test_an_undeclared_import_in_product_code_is_reported(product_copy):
    plant(product_copy, "gateway/errors.py", "import yaml")
    code, output = deptry(product_copy)
    # NOTE: yaml is here only as someone else's dependency, as msgpack was (through locust)
    assert code != 0 and issues(output) in (["DEP001 yaml"], ["DEP003 yaml"]), output


def test_a_test_only_package_imported_by_product_code_is_reported(product_copy):
    plant(product_copy, "runtime/sampler.py", "import hypothesis")
    code, output = deptry(product_copy)
    assert code != 0 and issues(output) == ["DEP004 hypothesis"], output


def test_a_declared_dependency_nothing_imports_is_reported(product_copy):
    path = product_copy / "runtime/disagg/frames.py"
    path.write_text(path.read_text().replace("import msgpack\n", ""))
    code, output = deptry(product_copy)
    assert code != 0 and issues(output) == ["DEP002 msgpack"], output
