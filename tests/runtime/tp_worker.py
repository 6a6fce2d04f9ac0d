"""One rank of a tensor-parallel group, as its own process, for test_tensor_parallel.py.

`python -m tests.runtime.tp_worker RANK SIZE INIT_FILE OUT_JSON JOB_JSON`: joins the gloo group
through INIT_FILE, and for each model of the job builds an engine with tensor_parallel_size
SIZE, generates greedily, and (where the job says so) runs a victim and a bystander request
while planting a tag bump on one rank's pool. Writes what it saw to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch.distributed as dist

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.distributed import init_tensor_parallel
from runtime.faults import FaultInjector


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)


def planted_fault(llm: LLM, job: dict[str, Any], rank: int) -> dict[str, Any]:
    """Victim and bystander decode together; after `bump_after_steps` steps, the victim's
    first page's tag moves on in `bump_rank`'s pool only."""
    engine = llm.engine
    fault = job["fault"]
    engine.add_request("victim", fault["victim"], greedy(fault["max_tokens"]))
    engine.add_request("bystander", fault["bystander"], greedy(fault["max_tokens"]))
    done: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == fault["bump_after_steps"] and rank == fault["bump_rank"]:
            FaultInjector(engine).bump_tag("victim")
        for out in engine.step():
            if out.finished:
                err = out.error
                done[out.request_id] = {
                    "tokens": out.outputs[0].token_ids,
                    "error": None if err is None else {"type": type(err).__name__,
                                                      "reason": err.reason,
                                                      "cause": err.metadata.get("cause")}}
        steps += 1
    done["num_free_pages"] = engine.pool.num_free_pages
    return done


def run_model(job: dict[str, Any], size: int, rank: int) -> dict[str, Any]:
    config = EngineConfig(tensor_parallel_size=size, kv_cache_bytes=job["kv_cache_bytes"],
                          max_num_batched_tokens=job["max_num_batched_tokens"], max_num_seqs=8)
    llm = LLM.from_config(job["path"], config)
    outs = llm.generate(job["prompts"], greedy(job["max_tokens"]))
    stats = llm.engine.stats()
    result: dict[str, Any] = {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[next(iter(lp.values())) for lp in o.outputs[0].logprobs or []]
                     for o in outs],
        "num_pages": stats.num_pages, "kv_bytes_per_token": stats.kv_bytes_per_token,
        "kv_heads": llm.engine.kv_cache.spec.num_kv_heads}
    if "fault" in job:
        result["fault"] = planted_fault(llm, job, rank)
    return result


def main(argv: list[str]) -> None:
    rank, size, init_file, out_path, job_path = argv
    with open(job_path) as f:
        jobs = json.load(f)
    init_tensor_parallel(int(rank), int(size), f"file://{init_file}", backend="gloo")
    try:
        results = {name: run_model(job, int(size), int(rank)) for name, job in jobs.items()}
    finally:
        dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
