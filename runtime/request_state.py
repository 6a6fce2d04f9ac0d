"""What the engine keeps per request beside the scheduler's Sequence: the detokenizer, the
seeded sampler generator, the grammar matcher, logprobs and a teacher-forced scoring sink
(typed, not a grab-bag)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.detokenizer import IncrementalDetokenizer
from runtime.grammar import GrammarMatcher


@dataclass
class RequestState:
    detok: IncrementalDetokenizer
    generator: torch.Generator | None = None  # a per-request seed's own random stream
    logprobs: list[dict[int, float]] | None = None  # one {token_id: logprob} per output token
    # Teacher-forced scoring (`LLMEngine.prompt_logits`): each prefill chunk's float32 logits
    # [tokens, vocab] for every prompt position, appended by the model runner.
    prompt_logits: list[torch.Tensor] | None = None
    # Constrained decoding: where the output is in its grammar. It follows output tokens only,
    # so chunked prefill, recompute after preemption and prefix-cache hits leave it as it is.
    grammar: GrammarMatcher | None = None
