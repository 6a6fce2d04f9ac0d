"""A worker pool's configuration (sizes, limits, timeouts, how its workers start) and its
counters; the pool itself is gateway/supervisor.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.errors import InvalidArgument


@dataclass(frozen=True)
class PoolConfig:
    model_id: str
    model_path: str | None = None  # None: the embedded default model
    min_workers: int = 1
    max_workers: int = 2
    max_inflight: int = 16  # per worker
    max_queue: int = 64  # requests waiting for a worker, per pool
    kv_cache_bytes: int | None = None  # None: each worker sizes its pool from free memory
    idle_ttl_s: float | None = None  # reap workers idle this long, down to min_workers
    recycle_after_requests: int | None = None
    recycle_after_s: float | None = None
    start_timeout_s: float = 180.0
    # A worker whose engine loop died, whose current step has run this long, or that missed
    # this many health probes in a row, is treated as crashed and replaced.
    stuck_after_s: float = 60.0
    max_missed_health: int = 3
    restart_backoff_s: float = 0.5
    max_restart_backoff_s: float = 30.0
    # this many failed starts in a row fail the pool: requests get WORKER_START_FAILED at once
    # (gateway/start_failures.py) while starts are still retried on the back-off above
    max_start_failures: int = 3
    worker_args: tuple[str, ...] = ()
    worker_env: tuple[tuple[str, str], ...] = ()
    # CPU threads per worker; None: this host's cores split evenly among max_workers
    worker_threads: int | None = None
    # "both": colocated workers; "prefill" / "decode": one pool of disaggregated serving, its
    # formats in worker_args (gateway/transfer.py). A decode pool bounds each KV transfer.
    role: str = "both"
    transfer_timeout_s: float = 60.0
    # fork workers from a template process (gateway/template.py); None: when the pool scales
    # from zero or can grow
    template: bool | None = None
    # ranks per worker (gateway/tp_group.py); its worker_threads are split between them
    tensor_parallel_size: int = 1

    @property
    def pool_label(self) -> str:
        """The pool's name in metrics and worker ids: the model id, plus the role if any."""
        return self.model_id if self.role == "both" else f"{self.model_id}/{self.role}"

    def __post_init__(self) -> None:
        if self.role not in ("both", "prefill", "decode") or self.transfer_timeout_s <= 0:
            raise InvalidArgument("role must be both, prefill or decode, and "
                                  "transfer_timeout_s > 0", field="role")
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise InvalidArgument("need 0 <= min_workers <= max_workers, max_workers >= 1",
                                  field="min_workers")
        if self.stuck_after_s <= 0 or self.max_missed_health < 1:
            raise InvalidArgument("stuck_after_s must be > 0 and max_missed_health >= 1",
                                  field="stuck_after_s")
        if self.worker_threads is not None and self.worker_threads < 1:
            raise InvalidArgument("worker_threads must be >= 1", field="worker_threads")
        if self.max_start_failures < 1 or self.max_restart_backoff_s < self.restart_backoff_s:
            raise InvalidArgument("max_start_failures must be >= 1 and max_restart_backoff_s "
                                  ">= restart_backoff_s", field="max_start_failures")
        if self.tensor_parallel_size < 1:
            raise InvalidArgument("tensor_parallel_size must be >= 1",
                                  field="tensor_parallel_size")
        if self.tensor_parallel_size > 1 and self.role != "both":
            raise InvalidArgument("tensor parallelism serves colocated pools only: a prefill or "
                                  "decode pool's KV transfer does not split KV heads across "
                                  "ranks yet", field="tensor_parallel_size")
        if self.max_inflight < 1 or self.max_queue < 0:
            raise InvalidArgument("max_inflight must be >= 1 and max_queue >= 0",
                                  field="max_inflight")


@dataclass
class PoolStats:
    spawned: int = 0
    crashed: int = 0
    reaped: int = 0
    recycled: int = 0
    cold_starts_s: list[float] = field(default_factory=list)
