"""Runs both serving configs over the same windows and greedy prompts; returns estimates.

Both configs stay loaded and see each window in turn, so only one window's logits (two
[window, vocab] float32 tensors) is ever held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ops.eval.metrics import (
    KL_SUM,
    NLL_A,
    NLL_B,
    TOKENS,
    TOP1_AGREE,
    matched_prefix_length,
    window_stats,
)
from ops.eval.stats import Estimate, bootstrap, exp_diff_ratio, exp_ratio, ratio


class ServingModel(Protocol):
    """What the harness needs of `runtime.LLM`."""

    @property
    def tokenizer(self) -> Any: ...

    def prompt_logits(self, token_ids: list[int], *, tenant: str = ...) -> torch.Tensor: ...

    def generate(self, prompts: Any, sampling_params: Any = ..., *,
                 tenant: str = ...) -> list[Any]: ...


@dataclass(frozen=True)
class EvalSettings:
    window: int = 256
    max_windows: int = 32
    prompt_tokens: int = 32  # greedy prompts are the first prompt_tokens of a window
    max_tokens: int = 32  # greedy continuation length
    num_prompts: int | None = None  # None: one greedy prompt per window; 0: no greedy check
    resamples: int = 1000
    seed: int = 0
    tenant: str = "default"

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_tokens < self.window:
            raise ValueError(f"prompt_tokens must be in [1, window={self.window}), "
                             f"got {self.prompt_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.num_prompts is not None and self.num_prompts < 0:
            raise ValueError(f"num_prompts must be >= 0, got {self.num_prompts}")
        if self.resamples < 1:
            raise ValueError(f"resamples must be at least 1, got {self.resamples}")


@dataclass
class Comparison:
    windows: int
    tokens: int  # next-token predictions scored
    prompts: int
    continuation_tokens: int  # greedy tokens A produced, the match denominator
    estimates: dict[str, Estimate]
    match_prefixes: list[int] = field(default_factory=list)  # per prompt, tokens before divergence
    seconds: dict[str, float] = field(default_factory=dict)  # time inside each config's calls


def tokenize(llm_a: ServingModel, llm_b: ServingModel, text: str) -> list[int]:
    """The text as token ids; both configs must read it identically (the same model)."""
    ids = llm_a.tokenizer.encode(text, add_special_tokens=False)
    if llm_b.tokenizer.encode(text, add_special_tokens=False) != ids:
        raise ValueError("configs A and B tokenize the text differently; both must serve the "
                         "same model")
    return list(ids)


def compare(llm_a: ServingModel, llm_b: ServingModel, windows: list[list[int]],
            settings: EvalSettings,
            progress: Callable[[str], None] | None = None) -> Comparison:
    seconds = {"a": 0.0, "b": 0.0}

    def timed(side: str, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return call()
        finally:
            seconds[side] += time.perf_counter() - start

    rows = []
    for i, ids in enumerate(windows):
        logits_a = timed("a", lambda ids=ids: llm_a.prompt_logits(ids, tenant=settings.tenant))
        logits_b = timed("b", lambda ids=ids: llm_b.prompt_logits(ids, tenant=settings.tenant))
        rows.append(window_stats(logits_a.float().cpu(), logits_b.float().cpu(), ids).row())
        if progress:
            progress(f"window {i + 1}/{len(windows)}")
    units = np.array(rows, dtype=np.float64)
    boot = {"resamples": settings.resamples, "seed": settings.seed}
    estimates = {
        "kl": bootstrap(units, ratio(KL_SUM, TOKENS), **boot),
        "top1": bootstrap(units, ratio(TOP1_AGREE, TOKENS), **boot),
        "ppl_a": bootstrap(units, exp_ratio(NLL_A, TOKENS), **boot),
        "ppl_b": bootstrap(units, exp_ratio(NLL_B, TOKENS), **boot),
        "ppl_ratio": bootstrap(units, exp_diff_ratio(NLL_B, NLL_A, TOKENS), **boot),
    }
    n_prompts = len(windows) if settings.num_prompts is None else settings.num_prompts
    prompts = [ids[: settings.prompt_tokens] for ids in windows[:n_prompts]]
    continuation_tokens = 0
    match_units = np.zeros((0, 2))
    if prompts:
        conts_a = timed("a", lambda: greedy(llm_a, prompts, settings))
        conts_b = timed("b", lambda: greedy(llm_b, prompts, settings))
        match_units = np.array([(matched_prefix_length(a, b), len(a))
                                for a, b in zip(conts_a, conts_b, strict=True)], dtype=np.float64)
        continuation_tokens = int(match_units[:, 1].sum())
        estimates["match"] = bootstrap(match_units, ratio(0, 1), **boot)
        if progress:
            progress(f"greedy {len(prompts)} prompts x {settings.max_tokens} tokens")
    prefixes = [int(x) for x in match_units[:, 0]]
    return Comparison(len(windows), int(units[:, TOKENS].sum()), len(prompts),
                      continuation_tokens, estimates, prefixes, seconds)


def greedy(llm: ServingModel, prompts: list[list[int]], settings: EvalSettings) -> list[list[int]]:
    """Greedy continuations of exactly max_tokens (EOS ignored, so both sides run as long)."""
    from runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=settings.max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, tenant=settings.tenant)
    conts = []
    for i, out in enumerate(outs):
        if out.error is not None:
            raise RuntimeError(f"greedy prompt {i} failed: {out.error}")
        conts.append(list(out.outputs[0].token_ids))
    return conts
