"""The scale-from-zero benchmark's measures and table (ops/bench/start_measures.py,
ops/bench/scale_report.py): a process tree's CPU counts its children's, a missing llama-server
is said, not guessed, and the table carries every row the issue asks for."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops.bench.scale_report import report
from ops.bench.start_measures import llama_server_start, tree_cpu_s


def test_a_process_trees_cpu_includes_its_live_childrens() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n" \
           "print('', flush=True)\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        child.stdout.readline()  # it has burnt its 0.4 s
        assert tree_cpu_s(child.pid) >= 0.35  # clock ticks: 10 ms steps
        assert tree_cpu_s(os.getpid()) >= tree_cpu_s(child.pid) + time.process_time() - 0.05
    finally:
        child.kill()
        child.wait()


def test_a_missing_llama_server_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no llama-server at"):
        llama_server_start(str(tmp_path / "llama-server"), "m.gguf", "hi")


def _results() -> dict:
    cold = {"p50_s": 0.1, "p99_s": 0.3, "trials": 20, "warm_p50_s": 0.07,
            "worker_ready_p50_s": 0.08, "worker_cpu_p50_s": 0.03,
            "worker_phases_p50_s": {"process": 0.02, "adopt_engine": 0.02, "serve": 0.01,
                                    "ready": 0.01},
            "template_phases_s": {"import": 1.2, "checkpoint": 0.3, "map_weights": 0.02,
                                  "engine_warm_up": 0.14},
            "template_cpu_phases_s": {"import": 1.1, "checkpoint": 0.3, "map_weights": 0.02,
                                      "engine_warm_up": 0.14}}
    spawn = {**cold, "worker_phases_p50_s": {"main": 1.5, "engine": 0.4, "warm_up": 0.3}}
    memory = [{"worker": "1 alone", "pss_mib": 150.0, "private_mib": 19.0, "rss_mib": 300.0}]
    return {"loadavg_1m": 1.0, "cores": 2, "kv_bytes": 32 << 20, "cold_template": cold,
            "cold_spawn": spawn, "serve_template": [{"wall_s": 2.1, "cpu_s": 2.5}],
            "serve_spawn": [{"wall_s": 3.0, "cpu_s": 3.4}], "memory_template": memory,
            "memory_spawn": memory, "llama_server": [{"wall_s": 0.8, "cpu_s": 0.9}],
            "kv_pool": {"allocate_s": 0.0004, "touch_all_s": 0.06}}


def test_the_table_has_the_issues_rows() -> None:
    table = report(_results())
    assert "| template | 100 / 300 | 20 | 70 | 80 | 2.10 | 2.50 |" in table
    assert "| llama-server | - | - | - | - | 0.80 | 0.90 |" in table
    assert "| template | 1 alone | 150 | 19 | 300 |" in table
    for phase in ("fork", "map weights", "tokenizer", "KV pool", "warm-up"):
        assert phase in table, phase
    assert "| KV pool: engine adopted (threads, seed, weights paged in) | 20 | - |" in table
