"""Per-window sums from two configs' teacher-forced logits, and greedy-continuation agreement.

Everything here is a sum over tokens (or a count), so windows combine by adding and the
bootstrap in `stats.py` can resample them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Column order of `WindowStats.row()`, used by the statistics in `compare.py`.
TOKENS, KL_SUM, TOP1_AGREE, NLL_A, NLL_B = range(5)


@dataclass(frozen=True)
class WindowStats:
    tokens: int  # next-token predictions scored in this window
    kl_sum: float  # sum over those positions of KL(A || B), nats
    top1_agree: int  # positions where argmax A == argmax B
    nll_a: float  # sum of -log p_A(actual next token)
    nll_b: float

    def row(self) -> tuple[float, ...]:
        return (self.tokens, self.kl_sum, self.top1_agree, self.nll_a, self.nll_b)


def kl_per_position(logits_a: torch.Tensor, logits_b: torch.Tensor) -> torch.Tensor:
    """KL(A || B) = sum_v p_A(v) (log p_A(v) - log p_B(v)) for each row; [T, V] -> [T]. In
    float64: the KL of close formats is ~1e-4 and float32 log-probs would bury it in rounding."""
    log_a = torch.log_softmax(logits_a.double(), dim=-1)
    log_b = torch.log_softmax(logits_b.double(), dim=-1)
    p_a = log_a.exp()
    # NOTE: 0 * log 0 is 0; where p_A underflows, a -inf in log_b must not make it NaN.
    terms = torch.where(p_a > 0, p_a * (log_a - log_b), torch.zeros_like(p_a))
    return terms.sum(dim=-1)


def nll_per_position(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) for each row; [T, V], [T] -> [T]."""
    log_p = torch.log_softmax(logits.double(), dim=-1)
    return -log_p.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def window_stats(logits_a: torch.Tensor, logits_b: torch.Tensor,
                 token_ids: Sequence[int]) -> WindowStats:
    """`logits_*`: [len(token_ids), V], row i predicting token i+1 (`LLM.prompt_logits`). The
    last row predicts past the window and has no target, so every metric uses rows 0..T-2."""
    n = len(token_ids)
    for name, logits in (("A", logits_a), ("B", logits_b)):
        if logits.ndim != 2 or logits.shape[0] != n:
            raise ValueError(f"config {name} returned logits of shape {tuple(logits.shape)} "
                             f"for {n} tokens; expected [{n}, vocab]")
    if logits_a.shape != logits_b.shape:
        raise ValueError(f"configs disagree on vocabulary: logits {tuple(logits_a.shape)} vs "
                         f"{tuple(logits_b.shape)}; both must serve the same model")
    a, b = logits_a[:-1], logits_b[:-1]
    targets = torch.tensor(list(token_ids[1:]), dtype=torch.long)
    return WindowStats(
        tokens=n - 1,
        kl_sum=float(kl_per_position(a, b).sum()),
        top1_agree=int((a.argmax(dim=-1) == b.argmax(dim=-1)).sum()),
        nll_a=float(nll_per_position(a, targets).sum()),
        nll_b=float(nll_per_position(b, targets).sum()),
    )


def matched_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading tokens on which two continuations agree, up to their first divergence. After it
    the two contexts differ, so agreement further on says nothing about the formats."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
