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
    ("after ready, once idle: grammar + text tokenizers", ("grammar_tokenizer",
                                                           "text_tokenizer")),
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


def report(results: dict[str, Any]) -> str:
    """The run's tables: start, memory, phases."""
    lines = [f"load average {results['loadavg_1m']:.1f} on {results['cores']} cores "
             "(1 min, at the start)", ""]
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
    kv = results.get("kv_pool")
    if kv:
        lines.append(f"\nKV pool of {results['kv_bytes'] >> 20} MiB: allocated (lazily "
                     f"committed) in {kv['allocate_s'] * 1e3:.2f} ms; touching every page "
                     f"would cost {kv['touch_all_s'] * 1e3:.1f} ms")
    return "\n".join(lines)
