"""Helpers shared by test modules."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.config import ModelConfig
from runtime.loader.checkpoint import Checkpoint
from runtime.scheduler import Scheduler, SchedulerOutput
from runtime.sequence import Sequence

_fake_tokens = itertools.count(1000)


def capture_logits(engine, monkeypatch) -> dict[str, list[torch.Tensor]]:
    """Record, per request id, the logits row the engine samples from at every step."""
    captured: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def capturing(batch):
        samplers, logits = execute(batch)
        for item, row in zip(samplers, logits, strict=True):
            captured.setdefault(item.seq.request_id, []).append(row.clone())
        return samplers, logits

    monkeypatch.setattr(engine.runner, "execute", capturing)
    return captured


def engine_step(sched: Scheduler, stop: set[Sequence] | None = None) -> SchedulerOutput:
    """One engine step without a model; sequences in `stop` finish when they next sample."""
    out = sched.schedule()
    # NOTE: `samples` reads num_computed_tokens, so it is taken before the advance (as the
    # model runner does).
    samplers = [item.seq for item in out.scheduled if item.samples]
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_tokens
    for seq in samplers:
        seq.output_token_ids.append(next(_fake_tokens))
        if len(seq.output_token_ids) >= seq.max_tokens or (stop and seq in stop):
            sched.finish(seq)
    return out


@dataclass
class RandomCheckpoint(Checkpoint):
    """A random Llama in memory (HF tensor names), with the default model's tokenizer."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.config
        g = torch.Generator().manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return 0.05 * torch.randn(*shape, generator=g)

        yield "model.embed_tokens.weight", rand(c.vocab_size, c.hidden_size)
        yield "model.norm.weight", 1 + rand(c.hidden_size)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", 1 + rand(c.hidden_size)
            yield p + "post_attention_layernorm.weight", 1 + rand(c.hidden_size)
            for name, rows, cols in (("q", c.q_size, c.hidden_size),
                                     ("k", c.kv_size, c.hidden_size),
                                     ("v", c.kv_size, c.hidden_size),
                                     ("o", c.hidden_size, c.q_size)):
                yield p + f"self_attn.{name}_proj.weight", rand(rows, cols)
            for name in ("gate", "up"):
                yield p + f"mlp.{name}_proj.weight", rand(c.intermediate_size, c.hidden_size)
            yield p + "mlp.down_proj.weight", rand(c.hidden_size, c.intermediate_size)


def tiny_random_checkpoint(num_layers: int = 2) -> Checkpoint:
    """A tiny random Llama (hidden 64, GQA 4/2 heads of 16, SmolLM2's vocabulary)."""
    from runtime.loader import open_checkpoint

    config = ModelConfig("LlamaForCausalLM", 49152, 64, 96, num_layers, 4, 2, 16, 1e-5, 10000.0,
                         512, tie_word_embeddings=True, eos_token_ids=(2,))
    tokenizer = open_checkpoint(None).tokenizer  # reads the GGUF's metadata, not its tensors
    return RandomCheckpoint(config, tokenizer, Path("tiny-random"), "tiny-random")


def perturbed_model_copy(source: Path, target: Path) -> None:
    """`source` (a GGUF file) copied to `target` with its final norm's weights reversed:
    another model of the same size and layout, whose greedy output differs."""
    import shutil

    import numpy as np
    from gguf import GGUFReader

    shutil.copyfile(source, target)
    reader = GGUFReader(str(target))
    tensor = next(t for t in reader.tensors if t.name == "output_norm.weight")
    weights = np.array(tensor.data, dtype=np.float32)[::-1].copy()
    offset = tensor.data_offset
    del reader
    with open(target, "r+b") as f:
        f.seek(offset)
        f.write(weights.tobytes())
