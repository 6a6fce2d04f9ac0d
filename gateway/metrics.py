"""Prometheus metrics of the gateway (the default registry; `tessera serve --metrics-port`)."""

from __future__ import annotations

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
WORKERS = Gauge("tessera_gateway_workers", "Worker processes by state", ["model", "state"])
COLD_START = Histogram("tessera_gateway_worker_cold_start_seconds",
                       "Spawn to healthy, per worker", ["model"],
                       buckets=(1, 2.5, 5, 10, 20, 40, 80, 160))
