"""Pass/fail against thresholds, decided by the confidence bound on the unfavourable side.

A metric where lower is better (KL, the perplexity ratio) passes when its CI *upper* bound is at
most the threshold; one where higher is better (top-1 agreement, greedy match) passes when its
CI *lower* bound is at least the threshold. So a pass means the data rule out a breach at 95%,
not merely that the point estimate happened to land on the right side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ops.eval.stats import Estimate

# metric -> True where lower is better (judged by the upper bound).
LOWER_IS_BETTER: dict[str, bool] = {
    "kl": True,
    "top1": False,
    "ppl_ratio": True,
    "match": False,
}
METRICS = tuple(LOWER_IS_BETTER)


@dataclass(frozen=True)
class Check:
    metric: str
    bound: str  # "upper" | "lower": which end of the CI was compared
    observed: float  # that end's value
    threshold: float
    passed: bool

    @property
    def rule(self) -> str:
        op = "<=" if self.bound == "upper" else ">="
        return f"{self.bound} {op} {self.threshold:g}"

    def as_dict(self) -> dict[str, object]:
        observed = None if math.isnan(self.observed) else self.observed  # JSON has no NaN
        return {"metric": self.metric, "bound": self.bound, "observed": observed,
                "threshold": self.threshold, "passed": self.passed}


def judge(estimates: dict[str, Estimate], thresholds: dict[str, float]) -> list[Check]:
    """One check per threshold, in the order given. A metric that was not measured (e.g. greedy
    match with no prompts) fails its check: an unmeasured claim is not a pass."""
    checks = []
    for metric, threshold in thresholds.items():
        lower_is_better = LOWER_IS_BETTER[metric]
        bound = "upper" if lower_is_better else "lower"
        est = estimates.get(metric)
        if est is None:
            checks.append(Check(metric, bound, float("nan"), threshold, False))
            continue
        observed = est.hi if lower_is_better else est.lo
        passed = observed <= threshold if lower_is_better else observed >= threshold
        checks.append(Check(metric, bound, observed, threshold, bool(passed)))
    return checks
