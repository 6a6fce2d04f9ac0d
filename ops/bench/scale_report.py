"""The markdown tables of ops/bench/bench_scale_from_zero.py, from its results dict."""

from __future__ import annotations

import statistics
from typing import Any

# (row, where it comes from): the template's load phases (gateway/template_process.py), once;
# a worker's start phases (gateway/readiness.py: start_phases), median per start.
_TEMPLATE_ROWS = [
    ("import torch + tessera", ("import",)),
    ("native ops", ("native_ops",)),
    ("tokenizer: GGUF reader + tokenizer", ("checkpoint",)),
    ("map weights", ("map_weights",)),
    ("engine (weights, KV pool) + warm-up", ("engine_warm_up",)),
    ("after ready, once idle: grammar + text tokenizers, chat template",
     ("grammar_tokenizer", "text_tokenizer")),
]
_WORKER_ROWS = [
    ("fork (request, fork, child set-up) / spawn", ("process", "forked", "setup")),
    ("worker main (spawned: interpreter + imports)", ("main",)),
    ("KV pool: engine built (spawned: checkpoint, weights, KV pool)", ("engine",)),
    ("KV pool: engine adopted (threads, seed, weights paged in)", ("adopt_engine",)),
    ("warm-up", ("warm_up",)),
    ("gRPC server", ("serve",)),
    ("readiness round trip (push, Status)", ("ready",)),
]


def _ms(phases: dict[str, float], names: tuple[str, ...]) -> str:
    if not any(n in phases for n in names):
        return "-"
    return f"{sum(phases.get(n, 0.0) for n in names) * 1e3:.0f}"


def _s(phases: dict[str, float], names: tuple[str, ...]) -> str:
    if not any(n in phases for n in names):
        return "-"
    return f"{sum(phases.get(n, 0.0) for n in names):.2f}"


def _cpu_ms(cold: dict[str, Any]) -> str:
    cpu = cold.get("worker_cpu_p50_s")
    return "-" if cpu is None or cpu != cpu else f"{cpu * 1e3:.0f}"


_SERVE_MARKS = ("template_launched", "gateway_up", "template_ready", "worker_ready",
                "first_token")


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]  # NaN: not measured
    return statistics.median(xs) if xs else float("nan")


def serve_phases(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """`tessera serve`'s start by phase, one column per run label ({label: its trials}): each
    mark's seconds since exec (median), the gateway process's own CPU at it, the template's
    CPU at its ready and the whole tree's at the first token."""
    labels = [label for label, trials in rows.items() if trials]
    if not labels:
        return []
    lines = ["| serve start, median s since exec (gateway's own CPU s then) | "
             + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for mark in _SERVE_MARKS:
        cells = []
        for label in labels:
            trials = rows[label]
            wall = _median([t.get("marks_s", {}).get(mark, float("nan")) for t in trials])
            cpu = _median([t.get("gateway_cpu_s", {}).get(mark, float("nan")) for t in trials])
            cells.append("-" if wall != wall else f"{wall:.2f}" + (
                "" if cpu != cpu else f" ({cpu:.2f})"))
        lines.append(f"| {mark.replace('_', ' ')} | " + " | ".join(cells) + " |")
    for row, key in (("template's CPU at its ready (s)", "template_cpu_at_ready_s"),
                     ("process tree's CPU at first token (s)", "cpu_s")):
        cells = []
        for label in labels:
            v = _median([float("nan") if t.get(key) is None else t[key] for t in rows[label]])
            cells.append("-" if v != v else f"{v:.2f}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return lines


def report(results: dict[str, Any]) -> str:
    """The run's tables: start, memory, phases (or, for a --serve-root run, serve's start by
    phase per checkout)."""
    lines = [f"load average {results['loadavg_1m']:.1f} on {results['cores']} cores "
             "(1 min, at the start)", ""]
    if "serve_ab" in results:
        for variant in ("template", "spawn"):
            lines += [f"workers from the {variant}:" if variant == "template"
                      else "workers spawned:", ""]
            lines += serve_phases({label: runs[variant]
                                   for label, runs in results["serve_ab"].items()})
            lines.append("")
        return "\n".join(lines)
    lines += ["| workers from | cold penalty p50 / p99 (ms) | trials | warm TTFT p50 (ms) | "
              "worker ready p50 (ms) | serve start to first token (s, median) | its CPU (s) |",
              "|---|---|---|---|---|---|---|"]
    for name in ("template", "spawn"):
        c, serve = results.get(f"cold_{name}"), results.get(f"serve_{name}")
        if c is None:
            continue
        wall = f"{statistics.median(r['wall_s'] for r in serve):.2f}" if serve else "-"
        cpu = f"{statistics.median(r['cpu_s'] for r in serve):.2f}" if serve else "-"
        lines.append(f"| {name} | {c['p50_s'] * 1e3:.0f} / {c['p99_s'] * 1e3:.0f} | "
                     f"{c['trials']} | {c['warm_p50_s'] * 1e3:.0f} | "
                     f"{c['worker_ready_p50_s'] * 1e3:.0f} | {wall} | {cpu} |")
    llama = results.get("llama_server")
    if isinstance(llama, list) and llama:
        wall = statistics.median(r["wall_s"] for r in llama)
        cpu = statistics.median(r["cpu_s"] for r in llama)
        lines.append(f"| llama-server | - | - | - | - | {wall:.2f} | {cpu:.2f} |")
    elif isinstance(llama, str):
        lines.append(f"\nllama-server not measured: {llama}")
    memory = [(name, m) for name in ("template", "spawn")
              for m in results.get(f"memory_{name}", [])]
    if memory:
        lines += ["", "| workers from | worker | PSS (MiB) | private (MiB, touched KV "
                  f"included; pool {results['kv_bytes'] >> 20} MiB) | RSS (MiB) |",
                  "|---|---|---|---|---|"]
    lines += [f"| {name} | {m['worker']} | {m['pss_mib']:.0f} | {m['private_mib']:.0f} | "
              f"{m['rss_mib']:.0f} |" for name, m in memory]
    cold_t, cold_s = results.get("cold_template", {}), results.get("cold_spawn", {})
    wall, cpu = cold_t.get("template_phases_s", {}), cold_t.get("template_cpu_phases_s", {})
    lines += ["", "| template load, once | wall (s) | CPU (s) | CPU share |", "|---|---|---|---|"]
    total = sum(cpu.values()) or float("nan")
    for row, names in _TEMPLATE_ROWS:
        share = sum(cpu.get(n, 0.0) for n in names) / total
        lines.append(f"| {row} | {_s(wall, names)} | {_s(cpu, names)} | {share:.0%} |")
    forked, spawned = cold_t.get("worker_phases_p50_s", {}), cold_s.get("worker_phases_p50_s", {})
    lines += ["", "| a worker's start, by phase (wall, median) | forked (ms) | spawned (ms) |",
              "|---|---|---|"]
    lines += [f"| {row} | {_ms(forked, names)} | {_ms(spawned, names)} |"
              for row, names in _WORKER_ROWS]
    lines.append(f"| whole start, its own CPU (median) | {_cpu_ms(cold_t)} | {_cpu_ms(cold_s)} |")
    phases = serve_phases({name: results.get(f"serve_{name}") or []
                           for name in ("template", "spawn")})
    if phases:
        lines += ["", *phases]
    kv = results.get("kv_pool")
    if kv:
        lines.append(f"\nKV pool of {results['kv_bytes'] >> 20} MiB: allocated (lazily "
                     f"committed) in {kv['allocate_s'] * 1e3:.2f} ms; touching every page "
                     f"would cost {kv['touch_all_s'] * 1e3:.1f} ms")
    return "\n".join(lines)
