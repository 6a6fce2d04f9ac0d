"""The CI quality gate: every format in ops/eval/quality_gate.toml passes its thresholds on the
held-out text, through the harness's own command (ops.eval), against float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from ops.eval.cli import main

ROOT = Path(__file__).resolve().parents[2]
GATE = tomllib.loads((ROOT / "ops/eval/quality_gate.toml").read_text())


def test_gate_file_names_a_held_out_text_and_thresholds_per_format():
    assert (ROOT / GATE["text"]).is_file()
    assert GATE["formats"]
    for spec in GATE["formats"].values():
        assert set(spec) == {"config", "kl", "top1"}
        assert 0 < spec["kl"] < 0.1 and 0.5 < spec["top1"] < 1


def test_every_1_byte_kv_format_is_gated_and_int8_more_tightly_than_fp8():
    formats = {spec["config"]: spec for spec in GATE["formats"].values()}
    fp8, int8 = formats["kv_cache_dtype=fp8"], formats["kv_cache_dtype=int8"]
    assert int8["kl"] < fp8["kl"] and int8["top1"] > fp8["top1"]


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("name", sorted(GATE["formats"]))
def test_format_passes_the_quality_gate(name, capsys):
    spec = GATE["formats"][name]
    rc = main(["--a", "", "--b", spec["config"], "--text", str(ROOT / GATE["text"]),
               "--max-windows", str(GATE["windows"]), "--prompts", "0",
               "--thresholds", f"kl={spec['kl']},top1={spec['top1']}"])
    assert rc == 0, capsys.readouterr().out
