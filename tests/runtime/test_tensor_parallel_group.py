"""Rank 0's engine inputs drive a follower's engine (runtime/engine/tp_leader.py), in two real
processes over gloo and a pipe: an abort mid-decode frees the same pages on both ranks, and a
follower that was told of a request rank 0 never admitted stops the group on both ranks with
TensorParallelGroupLost instead of computing on mismatched KV."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600


def run_pair(tmp_path: Path, scenario: str) -> list[dict]:
    fifo = tmp_path / "inputs"
    os.mkfifo(fifo)
    env = {**os.environ, "TESSERA_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.runtime.tp_group_rank", str(rank),
                               str(tmp_path / "rendezvous"), str(fifo), scenario,
                               str(tmp_path / f"rank{rank}.json")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-4000:]}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_abort_mid_decode_frees_the_same_pages_on_the_follower(tmp_path):
    leader, follower = run_pair(tmp_path, "abort")
    assert len(leader["tokens"]) == 6
    for rank in (leader, follower):  # short prompts: nothing left in the prefix cache
        assert rank["in_flight"] == 0
        assert rank["num_free_pages"] == rank["num_pages"]


def test_a_follower_out_of_step_stops_the_group_on_both_ranks(tmp_path):
    leader, follower = run_pair(tmp_path, "desync")
    for rank in (leader, follower):
        assert "is about to run another batch than its peers" in rank["lost"]
