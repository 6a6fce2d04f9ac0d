"""`tessera serve`: the gateway, its workers and the REST shim on 127.0.0.1, until SIGTERM or
Ctrl-C, which drain them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gateway.pool_config import PoolConfig
from gateway.ports import PortInUse, check_free
from gateway.tp_check import check_tensor_parallel_layout, check_tensor_parallel_model
from runtime.engine_flags import add_engine_flags, engine_argv
from runtime.extras import require_extra
from runtime.threads import share_of_cores

# NOTE: the gateway's own modules (gRPC, asyncio, structlog, prometheus) are imported in
# _serve, after the pools' templates started: their import (~0.3 s of CPU) then runs beside
# the templates' import of torch instead of before it (gateway/template_launch.py).
if TYPE_CHECKING:
    from gateway.rest.http_server import RestServer
    from gateway.runner import GatewayRunner
    from gateway.template_launch import LaunchedTemplate

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
# A quarter of --max-queue's default: one tenant's flood never fills the model's whole queue.
DEFAULT_TENANT_MAX_QUEUED = 32


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="start the gRPC gateway, its worker processes and the REST shim",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address every port binds to")
    p.add_argument("--grpc-port", type=int, default=50051, help="the gRPC gateway's port")
    p.add_argument("--api-keys", default=None,
                   help="file of key=tenant[:model|model][;max_inflight=N][;max_queued=M] "
                        "lines (else $TESSERA_API_KEYS)")
    p.add_argument("--model-id", default=DEFAULT_MODEL_ID,
                   help="the model's name for clients (requests, /v1/models)")
    p.add_argument("--min-workers", type=int, default=1, help="workers kept running")
    p.add_argument("--max-workers", type=int, default=1, help="workers started under load")
    p.add_argument("--prefill-workers", type=int, default=0,
                   help="disaggregated serving: this many prefill workers, and the KV moves "
                        "to --decode-workers decode workers (0: colocated workers, as "
                        "--min-workers / --max-workers say)")
    p.add_argument("--decode-workers", type=int, default=1,
                   help="decode workers, when --prefill-workers > 0")
    p.add_argument("--prefill-pool-args", default="", metavar="FLAGS",
                   help="engine flags for prefill workers only (formats, sizes), e.g. "
                        "\"--kv-cache-dtype bf16\"")
    p.add_argument("--decode-pool-args", default="", metavar="FLAGS",
                   help="engine flags for decode workers only, e.g. "
                        "\"--kv-cache-dtype fp8 --decode-weights int4\"")
    p.add_argument("--transfer-timeout-s", type=float, default=60.0,
                   help="a request's KV transfer, reservation to commit; past it, "
                        "DEADLINE_EXCEEDED and both sides' pages freed. Also how long a "
                        "request without a deadline waits for decode-side pages (then "
                        "OVERLOADED)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: each worker spans N processes (torch.distributed: "
                        "gloo over loopback on CPU, each rank on its share of the worker's "
                        "threads; NCCL on CUDA, rank r on cuda:r); colocated workers only")
    p.add_argument("--max-inflight", type=int, default=32, help="per worker")
    p.add_argument("--max-queue", type=int, default=128, help="waiting requests per model")
    p.add_argument("--tenant-max-inflight", type=int, default=None,
                   help="requests one tenant may have running per model, for keys that set no "
                        "max_inflight (None: as many as there are slots)")
    p.add_argument("--tenant-max-queued", type=int, default=DEFAULT_TENANT_MAX_QUEUED,
                   help="requests one tenant may have waiting per model, for keys that set no "
                        "max_queued; past it, 429 TENANT_CONCURRENCY_EXCEEDED")
    p.add_argument("--no-worker-template", action="store_true",
                   help="spawn every worker afresh; by default, when --min-workers is 0 or the "
                        "pool can grow, workers are forked from a template process that has "
                        "the model open and its weights mapped")
    p.add_argument("--idle-ttl-s", type=float, default=None,
                   help="stop workers idle this long, down to --min-workers (None: never)")
    p.add_argument("--recycle-after-requests", type=int, default=None,
                   help="replace a worker after this many requests, draining it first")
    p.add_argument("--recycle-after-s", type=float, default=None,
                   help="replace a worker after this many seconds, draining it first")
    p.add_argument("--stuck-after-s", type=float, default=60.0,
                   help="replace a worker whose engine step has run this long")
    p.add_argument("--worker-start-timeout-s", type=float, default=180.0,
                   help="how long one worker may take to become ready; `serve` exits non-zero "
                        "if no worker of the model is ready this long after it starts")
    p.add_argument("--worker-start-failures", type=int, default=3,
                   help="failed worker starts in a row after which the model's requests get "
                        "503 / UNAVAILABLE WORKER_START_FAILED with the cause at once (starts "
                        "are still retried)")
    p.add_argument("--max-restart-backoff-s", type=float, default=30.0,
                   help="the longest wait between restarts of a worker that crashed or could "
                        "not start (the wait doubles from 0.5 s)")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM/Ctrl-C: how long in-flight requests may finish")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (None: no metrics server)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="REST shim: OpenAI-compatible /v1, Workers-AI-style /ai/run, status at /")
    p.add_argument("--no-http", action="store_true", help="do not start the REST shim")
    p.add_argument("--operator-key", default=None,
                   help="opens the status page and /status (else $TESSERA_OPERATOR_KEY, else a "
                        "random key printed at start)")
    add_engine_flags(p, exclude=("max-num-seqs",))  # --max-inflight sizes each worker
    p.set_defaults(fn=cmd_serve)
    return p


def worker_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine flags the user set, for every worker (the pool passes model and sizes)."""
    return tuple(engine_argv(args, exclude=("model", "kv-cache-bytes", "max-num-seqs",
                                            "worker-threads")))


def pool_configs(base: PoolConfig, args: argparse.Namespace) -> list[PoolConfig]:
    """One colocated pool, or (--prefill-workers > 0) a prefill pool and a decode pool of fixed
    sizes, each with the shared engine flags followed by its own (the later flag wins)."""
    if args.prefill_workers < 0 or args.decode_workers < 1:
        raise SystemExit("--prefill-workers must be >= 0 and --decode-workers >= 1")
    if args.prefill_workers == 0:
        return [base]
    # Both pools share this host's cores: split them over every worker of both, or each pool
    # would take them all for itself and the two would oversubscribe.
    threads = base.worker_threads or share_of_cores(args.prefill_workers + args.decode_workers)
    return [dataclasses.replace(base, role=role, min_workers=n, max_workers=n,
                                worker_args=base.worker_args + tuple(shlex.split(extra)),
                                transfer_timeout_s=args.transfer_timeout_s,
                                worker_threads=threads)
            for role, n, extra in (("decode", args.decode_workers, args.decode_pool_args),
                                   ("prefill", args.prefill_workers, args.prefill_pool_args))]


POOL_ARG_FLAGS = ("--prefill-pool-args", "--decode-pool-args")
# Parses each (flag, words) pair with the worker's own parser, in a child process: the worker
# module imports torch, which the gateway process never loads.
_PARSE_WITH_WORKER = """
import contextlib, io, json, sys
from gateway.worker import parse_args
for flag, words in json.loads(sys.argv[1]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse_args(["--socket", "check.sock", *words])
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        why = lines[-1].split("error: ", 1)[-1] if lines else "not a worker flag"
        print(f"{flag}: {why}")
        sys.exit(2)
"""


def check_pool_args(args: argparse.Namespace) -> None:
    """Exit with one line naming the flag if a pool's extra engine flags would not parse in its
    workers (a worker that cannot parse its flags would be restarted forever)."""
    given: list[tuple[str, list[str]]] = []
    for flag in POOL_ARG_FLAGS:
        text = getattr(args, flag[2:].replace("-", "_"))
        try:
            words = shlex.split(text)
        except ValueError as e:
            raise SystemExit(f"tessera serve: {flag}: {e}") from None
        if words:
            given.append((flag, words))
    if not given:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", _PARSE_WITH_WORKER, json.dumps(given)],
                          capture_output=True, text=True, timeout=120, env=env)
    if proc.returncode != 0:
        why = proc.stdout.strip() or (proc.stderr.strip().splitlines()
                                      or [f"the worker's parser exited {proc.returncode}"])[-1]
        raise SystemExit(f"tessera serve: {why}")


def check_engine_choices(args: argparse.Namespace) -> None:
    """Exit with one line, before any worker starts, for an engine choice no worker could ever
    start with (its workers would fail and be restarted until --worker-start-timeout-s): a
    backend whose extra is missing, CUDA asked of a CPU build of torch. Reads package metadata
    only: the gateway does not import torch."""
    import importlib.metadata

    if getattr(args, "attention_backend", None) == "triton":
        require_extra("cuda", "triton", what="attention_backend 'triton'")
    device = getattr(args, "device", None) or "auto"
    if device.split(":", 1)[0] == "cuda":
        try:
            torch_version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch_version = ""
        if "+cpu" in torch_version:
            raise SystemExit(f"tessera serve: --device {device}: torch {torch_version} is a CPU "
                             "build and sees no CUDA device; use --device cpu or auto")


def serve_rest(runner: GatewayRunner, host: str = "127.0.0.1", port: int = 8000, *,
               operator_key: str | None = None) -> RestServer:
    """The shim on a started runner's event loop, its status page reading that gateway;
    `/status` opens to `operator_key` (None: a random one, `server.operator_key`)."""
    # NOTE: imported here, after the runner started the pool (and its template): FastAPI's
    # import (~0.4 s of CPU) then runs beside the template's load instead of before it.
    from gateway.rest.http_server import RestServer
    from gateway.rest.status import GatewayView

    assert runner.gateway is not None, "start the runner first"
    server = RestServer(runner.target, host, port,
                        view=GatewayView(runner.gateway, runner.loop),
                        operator_key=operator_key)
    return runner.call(server.start())


def pool_config(args: argparse.Namespace) -> PoolConfig:
    """The one pool `serve` runs, from its flags."""
    return PoolConfig(args.model_id, args.model, min_workers=args.min_workers,
                      max_workers=args.max_workers, max_inflight=args.max_inflight,
                      max_queue=args.max_queue, kv_cache_bytes=args.kv_cache_bytes,
                      idle_ttl_s=args.idle_ttl_s,
                      recycle_after_requests=args.recycle_after_requests,
                      recycle_after_s=args.recycle_after_s, stuck_after_s=args.stuck_after_s,
                      worker_args=worker_args(args), worker_threads=args.worker_threads,
                      start_timeout_s=args.worker_start_timeout_s,
                      max_start_failures=args.worker_start_failures,
                      max_restart_backoff_s=args.max_restart_backoff_s,
                      template=False if args.no_worker_template else None,
                      tensor_parallel_size=args.tp)


def wait_for_workers(runner: GatewayRunner, done: threading.Event, timeout_s: float) -> bool:
    """True once every pool has its minimum of ready workers; False if `done` is set first, or
    (the cause printed) when timeout_s passes with none of them ready."""
    # NOTE: waiting in slices, so a Ctrl-C or SIGTERM before the workers are ready stops
    # everything it started (workers, sockets) instead of leaving them behind.
    give_up_at = time.monotonic() + timeout_s
    while not done.is_set():
        try:
            runner.call(runner.wait_ready(timeout_s=1.0), timeout_s=5)
            return True
        except TimeoutError:
            if time.monotonic() > give_up_at:
                assert runner.gateway is not None
                pool = runner.gateway.pools[runner.gateway.default_model]
                why = pool.start_failures.cause or "see the log above"
                print(f"tessera serve: no worker of {pool.config.pool_label!r} became ready in "
                      f"{timeout_s:g} s: {why}", file=sys.stderr, flush=True)
                return False
    return False


class _StopNow(Exception):
    """A second SIGINT / SIGTERM during the drain: stop without waiting for it."""


def _stop_now(*_: object) -> None:
    raise _StopNow


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        return _serve(args)
    except PortInUse as e:
        print(f"tessera serve: {e}", file=sys.stderr, flush=True)
        return 1


def launch_templates(pools: Sequence[PoolConfig]) -> dict[str, LaunchedTemplate]:
    """The templates of those `pools` that keep one, started now, by pool label. One that
    cannot start is left to its pool, which tries again and spawns its workers (warning) when
    it cannot."""
    from gateway.template_launch import launch_pool_template

    templates = {}
    for config in pools:
        try:
            template = launch_pool_template(config)
        except OSError:
            continue
        if template is not None:
            templates[config.pool_label] = template
    return templates


def _serve(args: argparse.Namespace) -> int:
    check_tensor_parallel_layout(args)
    pool = pool_config(args)
    pools = pool_configs(pool, args)
    # NOTE: every port before any worker starts, so a taken one costs no model load
    check_free(args.host, {"--grpc-port": args.grpc_port,
                           "--http-port": None if args.no_http else args.http_port,
                           "--metrics-port": args.metrics_port})
    check_pool_args(args)
    check_engine_choices(args)
    check_tensor_parallel_model(args, [*worker_args(args), *(
        ["--model", args.model] if args.model else [])])
    # NOTE: the templates first, so their load (import torch, open and map the model, warm
    # the engine) runs beside the gateway's own start; the first worker is forked from one as
    # soon as it is ready, and the first request waits for that worker.
    templates = launch_templates(pools)
    try:
        return _serve_pools(args, pool, pools, templates)
    finally:
        for template in templates.values():  # those no pool adopted (an early exit)
            template.close()


def _serve_pools(args: argparse.Namespace, pool: PoolConfig, pools: list[PoolConfig],
                 templates: dict[str, LaunchedTemplate]) -> int:
    from gateway.auth import ApiKeys
    from gateway.fairness import TenantLimits
    from gateway.logs import configure
    from gateway.runner import GatewayRunner

    configure()
    keys, dev_key = ApiKeys.load(args.api_keys)
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        try:
            start_http_server(args.metrics_port, addr=args.host)
        except OSError:
            raise PortInUse(args.metrics_port, "--metrics-port") from None
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    limits = TenantLimits(args.tenant_max_inflight, args.tenant_max_queued)
    runner = GatewayRunner(pools, keys, args.host, args.grpc_port, tenant_limits=limits,
                           templates=templates)
    try:
        runner.start(wait_ready=False)
    except PortInUse:
        runner.stop()
        raise
    print(f"tessera gateway on {runner.target} serving {args.model_id}; starting workers",
          flush=True)
    # NOTE: before the workers are ready, so a client can be told why none can start (503)
    if dev_key is not None:
        print(f"dev API key (tenant 'dev'): {dev_key}", flush=True)
    rest = None
    if not args.no_http:  # up before the workers: while none can start, it says why (503)
        operator_key = args.operator_key or os.environ.get("TESSERA_OPERATOR_KEY") or None
        try:
            rest = serve_rest(runner, args.host, args.http_port, operator_key=operator_key)
        except OSError:
            runner.stop()
            raise PortInUse(args.http_port, "--http-port") from None
        print(f"REST shim on {rest.url} (OpenAI /v1, Workers AI /ai/run); status page: "
              f"{rest.url}/#key={rest.operator_key}", flush=True)
    if not wait_for_workers(runner, done, pool.start_timeout_s):
        if rest is not None:
            runner.call(rest.stop(grace_s=1), timeout_s=30)
        runner.stop()
        return 0 if done.is_set() else 1
    print("workers ready" if pool.min_workers > 0 else
          "workers ready (--min-workers 0: none runs until the first request starts one)",
          flush=True)
    key_hint = dev_key if dev_key is not None else "YOUR_KEY"
    print("call it:\n  python3 -c \"from gateway.client import Client; "
          f"s = Client('{runner.target}', api_key='{key_hint}').generate('Hello', "
          "max_tokens=32); print(''.join(c.text for c in s), s.usage)\"", flush=True)
    if rest is not None:
        body = json.dumps({"model": pool.model_id, "max_tokens": 32,
                           "messages": [{"role": "user", "content": "Hello"}]})
        print(f"  curl -s {rest.url}/v1/chat/completions -H 'Authorization: Bearer {key_hint}' "
              f"-H 'Content-Type: application/json' -d '{body}'", flush=True)
    done.wait()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop_now)
    print(f"draining (up to {args.shutdown_grace_s:g} s; Ctrl-C again stops at once)",
          flush=True)
    # NOTE: the gateway drains first while the shim still relays: new HTTP requests get a
    # typed 503 from it, and requests cut at the end of the grace period end in their own
    # protocol's error shape (JSON body, SSE error event) instead of a dropped connection.
    try:
        runner.call(runner.drain(args.shutdown_grace_s), timeout_s=args.shutdown_grace_s + 30)
        if rest is not None:
            runner.call(rest.stop(grace_s=5), timeout_s=30)
    except _StopNow:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # stopping already: the last steps run through
        print("stopping now: requests still running end with UNAVAILABLE", flush=True)
        if rest is not None:
            runner.call(rest.stop(grace_s=0), timeout_s=30)
        runner.stop()
        return 130
    runner.stop()
    return 0
