"""The C++ build's name: one build folder per (CPU features, torch installation, sources), so two
virtual environments with the same checkout never rebuild each other's library (found in a
new-user trial: each start rebuilt it for a minute, while the other venv's processes loaded
it)."""

from __future__ import annotations

import torch

from kernels.cpu_ops import build_tag


def test_another_torch_installation_gets_another_build(monkeypatch, tmp_path):
    here = build_tag()
    assert build_tag() == here  # stable for one installation
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv2" / "torch" / "__init__.py"))
    assert build_tag() != here


def test_another_torch_version_gets_another_build(monkeypatch):
    here = build_tag()
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert build_tag() != here
