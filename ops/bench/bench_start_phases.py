"""Where a worker's start-up goes: CPU and wall seconds and resident memory after each phase.

    PYTHONPATH=$PWD python3 -m ops.bench.bench_start_phases

One process, one torch thread, the default model: import torch, import the runtime, open the
checkpoint (GGUF reader, tokenizer), load the C++ ops, build the engine (weights, KV pool),
one warm-up step. CPU seconds are the steady number on a shared machine; wall seconds include
waiting (for the CPU, or for another process's native-op build lock).
"""

from __future__ import annotations

import resource
import time


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    marks: list[tuple[str, float, float, float]] = []
    start = (time.perf_counter(), time.process_time())

    def mark(name: str) -> None:
        marks.append((name, time.perf_counter(), time.process_time(), _rss_mb()))

    import torch

    torch.set_num_threads(1)
    mark("import torch")
    from kernels.cpu_ops import native
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.loader import open_checkpoint

    mark("import runtime")
    checkpoint = open_checkpoint(None)
    mark("open checkpoint (gguf reader, tokenizer)")
    native()
    mark("load C++ ops")
    engine = LLMEngine(checkpoint, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=8))
    mark("engine (weights, KV pool)")
    engine.warm_up()
    mark("warm-up step")
    wall, cpu = start
    print("| phase | wall s | CPU s | RSS after (MB) |\n|---|---|---|---|")
    for name, w, c, rss in marks:
        print(f"| {name} | {w - wall:.2f} | {c - cpu:.2f} | {rss:.0f} |")
        wall, cpu = w, c
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"| total | {wall - start[0]:.2f} | {cpu - start[1]:.2f} | peak {peak:.0f} |")


if __name__ == "__main__":
    main()
