"""Bootstrap confidence intervals over independent units (windows of text, greedy prompts).

Tokens inside one window share context and are correlated, so the unit resampled is the window:
each unit contributes a row of sums (e.g. [KL sum, tokens]) and a statistic is computed from the
column totals of a resample. Percentile intervals, a fixed seed: the same inputs, the same CI.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# A statistic maps column totals [..., k] to values [...]; it must broadcast over leading axes.
Statistic = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Estimate:
    value: float
    lo: float
    hi: float

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "lo": self.lo, "hi": self.hi}


def bootstrap(units: np.ndarray, statistic: Statistic, *, resamples: int = 1000, seed: int = 0,
              level: float = 0.95) -> Estimate:
    """`units`: [n, k] per-unit sums. Returns the statistic on all units and its percentile CI
    over `resamples` resamples of n units drawn with replacement."""
    units = np.asarray(units, dtype=np.float64)
    if units.ndim != 2 or len(units) == 0:
        raise ValueError(f"units must be a non-empty [n, k] array, got shape {units.shape}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    value = float(statistic(units.sum(axis=0)))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(units), size=(resamples, len(units)))
    draws = statistic(units[picks].sum(axis=1))
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(draws, [tail, 1.0 - tail])
    return Estimate(value, float(lo), float(hi))


def ratio(num: int, den: int) -> Statistic:
    """Column `num` total over column `den` total: a token-weighted mean."""
    return lambda totals: totals[..., num] / totals[..., den]


def exp_ratio(num: int, den: int) -> Statistic:
    return lambda totals: np.exp(totals[..., num] / totals[..., den])


def exp_diff_ratio(plus: int, minus: int, den: int) -> Statistic:
    """exp((plus - minus) / den): e.g. perplexity B over perplexity A from NLL sums."""
    return lambda totals: np.exp((totals[..., plus] - totals[..., minus]) / totals[..., den])
