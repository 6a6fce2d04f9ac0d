"""One rank of a leader/follower pair (runtime/engine/tp_leader.py) for
test_tensor_parallel_group.py, joined by gloo through INIT_FILE and by a named pipe that
carries rank 0's step inputs to rank 1.

`python -m tests.runtime.tp_group_rank RANK INIT_FILE FIFO SCENARIO OUT_JSON`; SCENARIO:
`abort` (two requests, one aborted mid-decode, the other run to the end) or `desync` (rank 1
is sent one request rank 0 never admitted). Writes what the rank saw to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch.distributed as dist

from runtime.config import EngineConfig
from runtime.distributed import TensorParallelGroupLost, init_tensor_parallel
from runtime.engine import LLMEngine
from runtime.engine.tp_inputs import AddRequest, StopGroup, encode
from runtime.engine.tp_leader import TensorParallelLeader, follow
from runtime.loader import open_checkpoint
from runtime.sampling_params import SamplingParams

CONFIG = EngineConfig(tensor_parallel_size=2, kv_cache_bytes=16 << 20, max_num_seqs=4,
                      max_num_batched_tokens=32, num_threads=1)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def lead(scenario: str, fifo: str) -> dict[str, Any]:
    with open(fifo, "wb", buffering=0) as pipe:
        engine = TensorParallelLeader(open_checkpoint(None), CONFIG,
                                      lambda m: pipe.write(encode(m)))
        if scenario == "desync":
            pipe.write(encode(AddRequest("only-on-rank-1", [1, 2, 3], GREEDY, "t", None)))
        engine.add_request("kept", "The capital of France is", GREEDY)
        engine.add_request("aborted", "Water boils at", SamplingParams(max_tokens=50))
        tokens: list[int] = []
        try:
            steps = 0
            while engine.has_unfinished_requests():
                for out in engine.step_core():
                    if out.request_id == "kept":
                        tokens += out.new_token_ids
                steps += 1
                if steps == 3:
                    engine.abort_request_core("aborted")
        except TensorParallelGroupLost as e:
            return {"lost": str(e)}
        pipe.write(encode(StopGroup()))
        return {"tokens": tokens, "num_free_pages": engine.pool.num_free_pages,
                "num_pages": engine.pool.num_pages, "in_flight": len(engine.requests)}


def follow_rank_0(fifo: str) -> dict[str, Any]:
    with open(fifo, "rb") as stream:
        engine = LLMEngine(open_checkpoint(None), CONFIG)
        try:
            follow(engine, stream)
        except TensorParallelGroupLost as e:
            return {"lost": str(e)}
        return {"num_free_pages": engine.pool.num_free_pages,
                "num_pages": engine.pool.num_pages, "in_flight": len(engine.requests)}


def main(argv: list[str]) -> None:
    rank, init_file, fifo, scenario, out_path = argv
    init_tensor_parallel(int(rank), 2, f"file://{init_file}", backend="gloo")
    try:
        result = lead(scenario, fifo) if rank == "0" else follow_rank_0(fifo)
    finally:
        dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
