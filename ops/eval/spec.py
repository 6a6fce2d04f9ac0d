"""Command-line specs: a serving config (`key=value,...` -> `LLM(**kwargs)`) and thresholds."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


class SpecError(ValueError):
    """A config or threshold spec that cannot be read; the message says which part and why."""


def parse_value(raw: str) -> Any:
    """`true`/`false` -> bool, `none` -> None, then int, then float, else the string itself."""
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def parse_pairs(spec: str, what: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise SpecError(f"{what}: expected key=value, got {item!r} in {spec!r}")
        if key in pairs:
            raise SpecError(f"{what}: {key!r} is given twice in {spec!r}")
        pairs[key] = value
    return pairs


def parse_config(spec: str) -> dict[str, Any]:
    """`kv_cache_dtype=fp8,kv_cache_bytes=268435456,model=/m` -> kwargs for `runtime.LLM`.
    An empty spec is the default config."""
    return {k: parse_value(v) for k, v in parse_pairs(spec, "config").items()}


def check_kwargs(kwargs: dict[str, Any], target: Callable[..., Any]) -> None:
    """Refuse keys `target` does not take, before anything slow (loading a model) starts."""
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = [n for n, p in params.items() if n != "self" and p.kind is not p.VAR_POSITIONAL]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise SpecError(f"config: unknown key(s) {', '.join(unknown)}; "
                        f"LLM accepts {', '.join(known)}")


def parse_thresholds(spec: str, metrics: tuple[str, ...]) -> dict[str, float]:
    """`kl=0.05,top1=0.9` -> {"kl": 0.05, "top1": 0.9}; names must be in `metrics`."""
    out: dict[str, float] = {}
    for key, value in parse_pairs(spec, "thresholds").items():
        if key not in metrics:
            raise SpecError(f"thresholds: unknown metric {key!r}; known: {', '.join(metrics)}")
        try:
            out[key] = float(value)
        except ValueError:
            raise SpecError(f"thresholds: {key}={value!r} is not a number") from None
    return out
