"""Reading `tessera bench serve` JSON back and printing it: one markdown table with the runs side
by side at each level (the first run is the baseline of the ratio column)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def load_runs(paths: Sequence[str | Path]) -> dict[str, list[dict]]:
    """Records by run name, in file order: the endpoint's label, prefixed with the file's stem
    when several files are compared."""
    runs: dict[str, list[dict]] = {}
    for path in paths:
        report = json.loads(Path(path).read_text())
        for record in report["records"]:
            name = record["endpoint"]["label"]
            if len(paths) > 1:
                name = f"{Path(path).stem}:{name}"
            runs.setdefault(name, []).append(record)
    return runs


def _ms(d: dict, *keys: str) -> str:
    vals = [d.get(k) for k in keys]
    return " / ".join("-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"
                      for v in vals)


def level_key(record: dict) -> tuple[str, float]:
    level = record["level"]
    return (level["kind"], float(level["value"]))


def markdown_table(runs: dict[str, list[dict]]) -> str:
    """Rows grouped by level; output tok/s also as a ratio to the first run's."""
    names = list(runs)
    by_level: dict[tuple[str, float], dict[str, dict]] = {}
    for name in names:
        for record in runs[name]:
            by_level.setdefault(level_key(record), {})[name] = record
    head = ("| level | run | done / failed | req/s | output tok/s | vs first | TTFT ms p50 / p95 / "
            "p99 | TPOT ms p50 / p95 / p99 | ITL ms p50 / p99 | E2E ms p50 / p99 | cached | "
            "goodput req/s | errors |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for (kind, value), records in sorted(by_level.items()):
        base = records.get(names[0])
        for name in names:
            if name not in records:
                continue
            m = records[name]["metrics"]
            ratio = "-"
            if base is not None and base["metrics"]["output_throughput"] > 0:
                ratio = f"{m['output_throughput'] / base['metrics']['output_throughput']:.2f}x"
            cached = "-" if m["cached_token_ratio"] is None else f"{m['cached_token_ratio']:.0%}"
            goodput = "-" if m["goodput"] is None else f"{m['goodput']:.2f}"
            errors = ", ".join(f"{k} {v}" for k, v in sorted(m["errors"].items())) or "-"
            label = f"c={value:g}" if kind == "concurrency" else f"{value:g} req/s"
            lines.append(
                f"| {label} | {name} | {m['completed']} / {m['failed']} | "
                f"{m['request_throughput']:.2f} | {m['output_throughput']:.1f} | {ratio} | "
                f"{_ms(m['ttft_ms'], 'median', 'p95', 'p99')} | "
                f"{_ms(m['tpot_ms'], 'median', 'p95', 'p99')} | "
                f"{_ms(m['itl_ms'], 'median', 'p99')} | {_ms(m['e2e_ms'], 'median', 'p99')} | "
                f"{cached} | {goodput} | {errors} |")
    return "\n".join(lines)
