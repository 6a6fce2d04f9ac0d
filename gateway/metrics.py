"""Prometheus metrics of the gateway (the default registry; `tessera serve --metrics-port`)."""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("tessera_gateway_requests_total", "Finished requests by model and outcome",
                   ["model", "reason"])
TOKENS = Counter("tessera_gateway_tokens_total", "Tokens by tenant and kind "
                 "(prompt, cached, completion)", ["tenant", "kind"])
TTFT = Histogram("tessera_gateway_ttft_seconds", "Time to first token", ["model"],
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
ITL = Histogram("tessera_gateway_inter_token_seconds", "Time between streamed chunks", ["model"],
                buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
QUEUE_DEPTH = Gauge("tessera_gateway_queue_depth", "Requests waiting for a worker", ["model"])
REJECTED = Counter("tessera_gateway_overloaded_total", "Requests refused: queue full", ["model"])
# NOTE: tenant labels are names from the API key file (authenticated), never client input.
TENANT_INFLIGHT = Gauge("tessera_gateway_tenant_inflight", "Requests holding a worker slot, "
                        "by tenant", ["model", "tenant"])
TENANT_QUEUED = Gauge("tessera_gateway_tenant_queued", "Requests waiting for a worker slot, "
                      "by tenant", ["model", "tenant"])
TENANT_REFUSED = Counter("tessera_gateway_tenant_refused_total", "Requests refused before a "
                         "worker slot, by tenant and reason (TENANT_CONCURRENCY_EXCEEDED, "
                         "OVERLOADED)", ["model", "tenant", "reason"])
WORKERS = Gauge("tessera_gateway_workers", "Worker processes by state", ["model", "state"])
COLD_START = Histogram("tessera_gateway_worker_cold_start_seconds",
                       "Spawn to healthy, per worker", ["model"],
                       buckets=(1, 2.5, 5, 10, 20, 40, 80, 160))
WORKERS_LOST = Counter("tessera_gateway_workers_lost_total",
                       "Workers replaced by the supervisor, by cause (engine_dead, engine_stuck, "
                       "unresponsive, exited)", ["model", "cause"])
WORKER_START_FAILURES = Counter("tessera_gateway_worker_start_failures_total",
                                "Worker starts that failed (exited or never healthy)", ["model"])
POOL_START_FAILED = Gauge("tessera_gateway_pool_start_failed",
                          "1 while a pool is failed: its last --worker-start-failures starts "
                          "all failed (requests get WORKER_START_FAILED)", ["model"])
# Read from each worker's Status RPC by the supervisor (workers have no HTTP port of their own).
WORKER_PAGES = Gauge("tessera_worker_kv_pages", "KV pages by state (free, cached, used)",
                     ["model", "worker", "state"])
WORKER_SEQS = Gauge("tessera_worker_sequences", "Sequences by state (running, waiting)",
                    ["model", "worker", "state"])
WORKER_INTEGRITY = Gauge("tessera_worker_integrity", "Integrity checks run and mismatches found",
                         ["model", "worker", "kind"])
# Disaggregated serving: KV sent (direction "export", prefill workers) and received ("import",
# decode workers); `model` is the pool (model id / role). Totals since the worker started.
WORKER_TRANSFER = Gauge("tessera_worker_kv_transfer", "KV transfers: completed, frames, pages, "
                        "bytes, pending (under way now), waiting (imports queued for free "
                        "pages)", ["model", "worker", "direction", "kind"])
WORKER_TRANSFER_SECONDS = Gauge("tessera_worker_kv_transfer_seconds", "Time spent in completed "
                                "KV transfers (first frame to commit or last frame)",
                                ["model", "worker", "direction"])
WORKER_TRANSFER_FAILURES = Gauge("tessera_worker_kv_transfer_failures", "Failed KV transfers by "
                                 "cause (checksum, sequence, malformed, incomplete, deadline, "
                                 "cancelled, sender, stale_tag, ...)",
                                 ["model", "worker", "direction", "cause"])
# Where each worker's engine time went (runtime/step_times.py): totals since it started.
WORKER_STEPS = Gauge("tessera_worker_engine_steps", "Engine steps by kind (decode: every "
                     "sequence fed one token; mixed: with a prefill chunk)",
                     ["model", "worker", "kind"])
WORKER_STEP_SECONDS = Gauge("tessera_worker_engine_step_seconds", "Engine step time by kind "
                            "and part (compute: the model and sampler; host: the rest of the "
                            "step)", ["model", "worker", "kind", "part"])
WORKER_STEP_TOKENS = Gauge("tessera_worker_engine_step_tokens", "Tokens fed to engine steps by "
                           "step kind and token kind (decode, prefill)",
                           ["model", "worker", "kind", "tokens"])
WORKER_LOOP_SECONDS = Gauge("tessera_worker_engine_loop_seconds", "The engine loop's time "
                            "outside steps (commands, publish, idle) and its thread's CPU time "
                            "(cpu)", ["model", "worker", "part"])
_STEP_KINDS = ("decode", "mixed")
_LOOP_PARTS = ("commands", "publish", "idle", "cpu")
_TRANSFER_KINDS = ("transfers", "frames", "pages", "bytes", "pending", "waiting")
_failure_labels: dict[tuple[str, str], set[tuple[str, str]]] = {}


def record_worker_status(model: str, s: Any) -> None:
    """s: a worker.proto StatusResponse."""
    w = s.worker_id
    free, cached = s.num_free_pages, s.prefix_cache.cached_pages
    for state, n in (("free", free), ("cached", cached),
                     ("used", max(0, s.num_pages - free - cached))):
        WORKER_PAGES.labels(model, w, state).set(n)
    for state, n in (("running", s.num_running), ("waiting", s.num_waiting)):
        WORKER_SEQS.labels(model, w, state).set(n)
    for kind, n in (("checks", s.integrity_checks), ("mismatches", s.integrity_mismatches)):
        WORKER_INTEGRITY.labels(model, w, kind).set(n)
    if s.HasField("times"):
        _record_engine_times(model, w, s.times)
    if s.role in ("prefill", "decode"):
        direction, t = ("export", s.exported) if s.role == "prefill" else ("import", s.imported)
        for kind in _TRANSFER_KINDS:
            WORKER_TRANSFER.labels(model, w, direction, kind).set(getattr(t, kind))
        WORKER_TRANSFER_SECONDS.labels(model, w, direction).set(t.duration_s)
        for cause, n in t.failures.items():
            WORKER_TRANSFER_FAILURES.labels(model, w, direction, cause).set(n)
            _failure_labels.setdefault((model, w), set()).add((direction, cause))


def _record_engine_times(model: str, w: str, times: Any) -> None:
    """times: a worker.proto EngineTimes."""
    for kind in _STEP_KINDS:
        t = getattr(times, kind)
        WORKER_STEPS.labels(model, w, kind).set(t.steps)
        WORKER_STEP_SECONDS.labels(model, w, kind, "compute").set(t.compute_s)
        WORKER_STEP_SECONDS.labels(model, w, kind, "host").set(max(0.0, t.wall_s - t.compute_s))
        WORKER_STEP_TOKENS.labels(model, w, kind, "decode").set(t.decode_rows)
        WORKER_STEP_TOKENS.labels(model, w, kind, "prefill").set(t.prefill_tokens)
    for part, value in zip(_LOOP_PARTS, (times.commands_s, times.publish_s, times.idle_s,
                                         times.loop_cpu_s), strict=True):
        WORKER_LOOP_SECONDS.labels(model, w, part).set(value)


def forget_worker(model: str, worker: str) -> None:
    for gauge, states in ((WORKER_PAGES, ("free", "cached", "used")),
                          (WORKER_SEQS, ("running", "waiting")),
                          (WORKER_INTEGRITY, ("checks", "mismatches"))):
        for state in states:
            try:
                gauge.remove(model, worker, state)
            except KeyError:
                pass
    for kind in _STEP_KINDS:
        with contextlib.suppress(KeyError):
            WORKER_STEPS.remove(model, worker, kind)
        for part in ("compute", "host"):
            with contextlib.suppress(KeyError):
                WORKER_STEP_SECONDS.remove(model, worker, kind, part)
        for tokens in ("decode", "prefill"):
            with contextlib.suppress(KeyError):
                WORKER_STEP_TOKENS.remove(model, worker, kind, tokens)
    for part in _LOOP_PARTS:
        with contextlib.suppress(KeyError):
            WORKER_LOOP_SECONDS.remove(model, worker, part)
    for direction in ("export", "import"):
        for kind in _TRANSFER_KINDS:
            with contextlib.suppress(KeyError):
                WORKER_TRANSFER.remove(model, worker, direction, kind)
        with contextlib.suppress(KeyError):
            WORKER_TRANSFER_SECONDS.remove(model, worker, direction)
    for direction, cause in _failure_labels.pop((model, worker), ()):
        with contextlib.suppress(KeyError):
            WORKER_TRANSFER_FAILURES.remove(model, worker, direction, cause)
