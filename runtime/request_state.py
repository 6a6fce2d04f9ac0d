"""What the engine keeps per request beside the scheduler's Sequence: the detokenizer, the
seeded sampler generator, logprobs and a teacher-forced scoring sink (typed, not a grab-bag)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.detokenizer import IncrementalDetokenizer


@dataclass
class RequestState:
    detok: IncrementalDetokenizer
    generator: torch.Generator | None = None  # a per-request seed's own random stream
    logprobs: list[dict[int, float]] | None = None  # one {token_id: logprob} per output token
    # Teacher-forced scoring (`LLMEngine.prompt_logits`): each prefill chunk's float32 logits
    # [tokens, vocab] for every prompt position, appended by the model runner.
    prompt_logits: list[torch.Tensor] | None = None
