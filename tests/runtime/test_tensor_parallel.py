"""Tensor parallelism across two real processes (torch.distributed, gloo on CPU): greedy tokens
match the single-process engine for the default model (9 query / 3 KV heads, split 6+3 / 2+1)
and for GLM-4-MoE and DeepSeek-V3 (MLA, latent replicated), and a tag mismatch planted in one
rank's pool aborts the sequence on both ranks with a typed KV integrity error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import LLM, SamplingParams
from tests.runtime.moe_models import build_tiny_moe

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "The capital of France is",
    # longer than one 32-token chunk: chunked prefill across ranks
    "Write a short story about a robot who learns to paint. Once upon a time, in a small town "
    "by the sea, there lived a robot named Pixel. Every morning, Pixel",
    "def fibonacci(n):",
]
FAULT = {"victim": "The quick brown fox jumps over", "bystander": "Water boils at a temperature of",
         "max_tokens": 6, "bump_after_steps": 3, "bump_rank": 1}
MAX_TOKENS = 8
MOE_ARCHS = {"glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
TIMEOUT_S = 600


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)


def reference(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(max_tokens))]


def assert_matches_single_process(result: dict, llm: LLM, tolerance: float) -> None:
    """Same greedy tokens as `llm` (one process), and each chosen token's logprob within
    `tolerance`: the ranks sum partial products in another order, nothing more."""
    want = [o.outputs[0] for o in llm.generate(PROMPTS, greedy(MAX_TOKENS))]
    assert result["tokens"] == [o.token_ids for o in want]
    for got, ref in zip(result["logprobs"], want, strict=True):
        ref_lp = [lp[t] for lp, t in zip(ref.logprobs, ref.token_ids, strict=True)]
        assert got == pytest.approx(ref_lp, abs=tolerance)


def launch(tmp_path: Path, jobs: dict, size: int = 2) -> list[dict]:
    """Run `size` ranks of tests/runtime/tp_worker.py to completion; their results."""
    job_path = tmp_path / "jobs.json"
    job_path.write_text(json.dumps(jobs))
    env = {**os.environ, "TESSERA_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.runtime.tp_worker", str(rank),
                               str(size), str(tmp_path / "rendezvous"),
                               str(tmp_path / f"rank{rank}.json"), str(job_path)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(size)]
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
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory, hf_tokenizer):
    pytest.importorskip("transformers")
    paths = {}
    for name, arch in MOE_ARCHS.items():
        paths[name] = tmp_path_factory.mktemp(name)
        build_tiny_moe(arch, paths[name], hf_tokenizer)
    return paths


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, moe_checkpoints):
    """Both ranks' results: the default model (with the planted fault) and the MoE families."""
    jobs = {"dense": {"path": None, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                      "kv_cache_bytes": 16 << 20, "max_num_batched_tokens": 32, "fault": FAULT}}
    for name, path in moe_checkpoints.items():
        jobs[name] = {"path": str(path), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                      "kv_cache_bytes": 4 << 20, "max_num_batched_tokens": 32}
    return launch(tmp_path_factory.mktemp("tp"), jobs)


def test_default_model_tp2_gives_tp1_greedy_tokens(ranks, llm):
    for rank in ranks:
        assert_matches_single_process(rank["dense"], llm, 1e-3)
    # 3 KV heads over 2 ranks: 2 + 1, each rank with the same page count
    assert [r["dense"]["kv_heads"] for r in ranks] == [2, 1]
    assert ranks[0]["dense"]["num_pages"] == ranks[1]["dense"]["num_pages"]


@pytest.mark.parametrize("family", sorted(MOE_ARCHS))
def test_moe_family_tp2_gives_tp1_greedy_tokens(ranks, moe_checkpoints, family):
    single = LLM(str(moe_checkpoints[family]), kv_cache_bytes=4 << 20,
                 max_num_batched_tokens=32)
    for rank in ranks:
        assert_matches_single_process(rank[family], single, 1e-4)
    if family == "deepseek_v3":  # the MLA latent is replicated, not split
        assert ranks[0][family]["kv_bytes_per_token"] == single.engine.stats().kv_bytes_per_token


def test_tag_mismatch_on_one_rank_aborts_the_sequence_on_both(ranks, llm):
    faults = [r["dense"]["fault"] for r in ranks]
    for rank, fault in enumerate(faults):
        error = fault["victim"]["error"]
        assert error["type"] == "KVIntegrityViolation", rank
        assert error["reason"] == "KV_INTEGRITY_VIOLATION"
        assert error["cause"].startswith("stale_tag")
        assert len(fault["victim"]["tokens"]) < FAULT["max_tokens"]
    assert faults[0]["victim"]["error"]["cause"] == "stale_tag on tensor-parallel rank 1"
    assert faults[1]["victim"]["error"]["cause"] == "stale_tag"
    assert faults[0]["victim"]["tokens"] == faults[1]["victim"]["tokens"]
    # the bystander is untouched, and both pools retired the same page
    bystander = reference(llm, [FAULT["bystander"]], FAULT["max_tokens"])[0]
    for fault in faults:
        assert fault["bystander"]["error"] is None
        assert fault["bystander"]["tokens"] == bystander
    assert faults[0]["num_free_pages"] == faults[1]["num_free_pages"]


def test_tensor_parallel_size_is_checked_before_any_weight_is_read(llm):
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="tensor_parallel_size must be a positive"):
        EngineConfig(tensor_parallel_size=0)
    checkpoint = llm.engine.checkpoint  # already open: only the engine's checks run
    with pytest.raises(InvalidArgument, match=r"needs torch\.distributed initialized"):
        LLMEngine(checkpoint, EngineConfig(tensor_parallel_size=2))  # no group in this process
    with pytest.raises(InvalidArgument, match="float weights only"):
        LLMEngine(checkpoint, EngineConfig(tensor_parallel_size=2, decode_weights="int4"))
