"""The served-step account (ops/bench/bench_served_step.py) splits a level's wall and CPU from
two snapshots of the engine's counters and the processes' CPU times."""

from __future__ import annotations

import pytest

from ops.bench.bench_served_step import account, table

CPU_BEFORE = {"cpu.gateway": 1.0, "cpu.workers": 5.0, "cpu.workers_main_thread": 0.5,
              "cpu.client": 0.1}
CPU_AFTER = {"cpu.gateway": 1.5, "cpu.workers": 9.0, "cpu.workers_main_thread": 0.7,
             "cpu.client": 0.3}
ENGINE_AFTER = {"steps.decode": 10, "step_seconds.decode.compute": 1.0,
                "step_seconds.decode.host": 0.1, "step_tokens.decode.decode": 80,
                "steps.mixed": 2, "step_seconds.mixed.compute": 0.5,
                "step_seconds.mixed.host": 0.02, "step_tokens.mixed.prefill": 256,
                "step_tokens.mixed.decode": 4, "loop_seconds.publish": 0.04,
                "loop_seconds.cpu": 2.0}


def test_the_wall_per_token_adds_up_to_the_level_and_the_rest_is_waiting():
    r = account(CPU_BEFORE, {**CPU_AFTER, **ENGINE_AFTER}, wall_s=2.0, tokens=100)
    w = r["wall_ms_per_token"]
    assert w["decode_compute"] == pytest.approx(10.0) and w["mixed_host"] == pytest.approx(0.2)
    assert sum(w.values()) == pytest.approx(20.0)  # 2 s over 100 tokens
    assert w["engine_waiting"] == pytest.approx(20.0 - 10.0 - 1.0 - 5.0 - 0.2 - 0.4)
    assert r["steps"]["mixed"] == {"steps": 2, "mean_ms": pytest.approx(260.0),
                                   "mean_decode_rows": 2.0, "mean_prefill_tokens": 128.0}
    cpu = r["cpu_ms_per_token"]
    assert cpu["gateway"] == pytest.approx(5.0) and cpu["client"] == pytest.approx(2.0)
    assert cpu["worker_engine_thread"] == pytest.approx(20.0)
    assert cpu["worker_other_threads"] == pytest.approx(40.0 - 20.0 - 2.0)


def test_a_tree_without_engine_counters_reports_cpu_only():
    r = account(CPU_BEFORE, CPU_AFTER, wall_s=2.0, tokens=100)
    assert set(r["wall_ms_per_token"].values()) == {None}
    assert r["cpu_ms_per_token"]["worker_engine_thread"] is None
    assert r["cpu_ms_per_token"]["worker_other_threads"] == pytest.approx(38.0)
    r.update(output_tok_s=50.0, tpot_p50_ms=20.0)
    assert "| old | 8 | 50.0 | 20 | 20.00 | - |" in table({"old": {"8": r}}, {})
