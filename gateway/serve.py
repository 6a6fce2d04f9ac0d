"""`tessera serve`: the gateway and its worker supervisor on 127.0.0.1, plus a runner that
hosts the same stack on a background event loop (tests, benchmarks)."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import signal
import sys
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from gateway.auth import ApiKeys
from gateway.logs import configure, get_logger
from gateway.server import Gateway, build_server
from gateway.supervisor import PoolConfig, WorkerPool

log = get_logger("tessera.serve")
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
_FORMAT_FLAGS = ("--kv-cache-dtype", "--prefill-kv-cache-dtype", "--prefill-weights",
                 "--decode-weights", "--serving-config")


class GatewayRunner:
    """The gateway on its own event loop thread; `call` runs a coroutine there."""

    def __init__(self, pools: Sequence[PoolConfig], keys: ApiKeys, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.pool_configs, self.keys, self.host, self.port = list(pools), keys, host, port
        self.loop = asyncio.new_event_loop()
        self.gateway: Gateway | None = None
        self._server: Any = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="tessera-gateway",
                                        daemon=True)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self, wait_ready: bool = True) -> GatewayRunner:
        configure()
        self._thread.start()
        self.call(self._start(wait_ready))
        return self

    async def _start(self, wait_ready: bool) -> None:
        pools = {c.model_id: WorkerPool(c) for c in self.pool_configs}
        self.gateway = Gateway(pools, self.keys)
        self._server, self.port = await build_server(self.gateway, self.host, self.port)
        await self._server.start()
        for pool in pools.values():
            await pool.start()
        if wait_ready:
            await self.wait_ready()

    async def wait_ready(self, timeout_s: float = 300) -> None:
        """Until every pool has its minimum of ready workers."""
        assert self.gateway is not None
        deadline = self.loop.time() + timeout_s
        while any(len(p.ready()) < p.config.min_workers for p in self.gateway.pools.values()):
            if self.loop.time() > deadline:
                raise TimeoutError(f"workers not ready after {timeout_s} s")
            await asyncio.sleep(0.1)

    def stop(self, grace_s: float = 0.0) -> None:
        """Drain (new requests get UNAVAILABLE; in-flight ones have grace_s to finish, then
        end with UNAVAILABLE), stop the server, stop every worker."""
        if not self._thread.is_alive():
            return
        try:
            self.call(self._stop(grace_s), timeout_s=grace_s + 60)
        except concurrent.futures.TimeoutError:
            log.warning("gateway did not stop in time")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    async def drain(self, grace_s: float) -> None:
        if self.gateway is not None:
            await self.gateway.drain(grace_s)

    async def _stop(self, grace_s: float) -> None:
        await self.drain(grace_s)
        if self._server is not None:
            await self._server.stop(grace=1)
        if self.gateway is not None:
            await asyncio.gather(*(p.close() for p in self.gateway.pools.values()))

    def __enter__(self) -> GatewayRunner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="start the gRPC gateway and its worker processes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--api-keys", default=None,
                   help="file of key=tenant[:model|model] lines (else $TESSERA_API_KEYS)")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    p.add_argument("--model-id", default=DEFAULT_MODEL_ID)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--max-workers", type=int, default=1)
    p.add_argument("--max-inflight", type=int, default=32, help="per worker")
    p.add_argument("--max-queue", type=int, default=128, help="waiting requests per model")
    p.add_argument("--idle-ttl-s", type=float, default=None)
    p.add_argument("--recycle-after-requests", type=int, default=None)
    p.add_argument("--recycle-after-s", type=float, default=None)
    p.add_argument("--stuck-after-s", type=float, default=60.0,
                   help="replace a worker whose engine step has run this long")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM/Ctrl-C: how long in-flight requests may finish")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics")
    p.add_argument("--http-port", type=int, default=8000,
                   help="REST shim: OpenAI-compatible /v1, Workers-AI-style /ai/run, status at /")
    p.add_argument("--no-http", action="store_true", help="do not start the REST shim")
    p.add_argument("--operator-key", default=None,
                   help="opens the status page and /status (else $TESSERA_OPERATOR_KEY, else a "
                        "random key printed at start)")
    fmts = p.add_argument_group("serving formats, passed to every worker")
    for flag in _FORMAT_FLAGS:
        fmts.add_argument(flag, default=None)
    p.set_defaults(fn=cmd_serve)
    return p


def _worker_format_args(args: argparse.Namespace) -> tuple[str, ...]:
    out: list[str] = []
    for flag in _FORMAT_FLAGS:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None:
            out += [flag, value]
    return tuple(out)


def cmd_serve(args: argparse.Namespace) -> int:
    configure()
    keys, dev_key = ApiKeys.load(args.api_keys)
    pool = PoolConfig(args.model_id, args.model, min_workers=args.min_workers,
                      max_workers=args.max_workers, max_inflight=args.max_inflight,
                      max_queue=args.max_queue, kv_cache_bytes=args.kv_cache_bytes,
                      idle_ttl_s=args.idle_ttl_s,
                      recycle_after_requests=args.recycle_after_requests,
                      recycle_after_s=args.recycle_after_s, stuck_after_s=args.stuck_after_s,
                      worker_args=_worker_format_args(args))
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.host)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    runner = GatewayRunner([pool], keys, args.host, args.grpc_port).start(wait_ready=False)
    print(f"tessera gateway on {runner.target} serving {args.model_id}; starting workers",
          flush=True)
    # NOTE: waiting in slices, so a Ctrl-C or SIGTERM before the workers are ready stops
    # everything it started (workers, sockets) instead of leaving them behind.
    give_up_at = time.monotonic() + pool.start_timeout_s + 60
    while not done.is_set():
        try:
            runner.call(runner.wait_ready(timeout_s=1.0), timeout_s=5)
            break
        except TimeoutError:
            if time.monotonic() > give_up_at:
                print("no worker became ready; see the log above", file=sys.stderr, flush=True)
                runner.stop()
                return 1
    if done.is_set():
        runner.stop()
        return 0
    print("workers ready", flush=True)
    rest = None
    if not args.no_http:
        from gateway.rest.server import serve_rest

        operator_key = args.operator_key or os.environ.get("TESSERA_OPERATOR_KEY") or None
        rest = serve_rest(runner, args.host, args.http_port, operator_key=operator_key)
        print(f"REST shim on {rest.url} (OpenAI /v1, Workers AI /ai/run); status page: "
              f"{rest.url}/#key={rest.operator_key}", flush=True)
    if dev_key is not None:
        print(f"dev API key (tenant 'dev'): {dev_key}", flush=True)
        key_hint = dev_key
    else:
        key_hint = "YOUR_KEY"
    print("call it:\n  python3 -c \"from gateway.client import Client; "
          f"s = Client('{runner.target}', api_key='{key_hint}').generate('Hello', "
          "max_tokens=32); print(''.join(c.text for c in s), s.usage)\"", flush=True)
    done.wait()
    print(f"draining (up to {args.shutdown_grace_s:g} s)", flush=True)
    # NOTE: the gateway drains first while the shim still relays: new HTTP requests get a
    # typed 503 from it, and requests cut at the end of the grace period end in their own
    # protocol's error shape (JSON body, SSE error event) instead of a dropped connection.
    runner.call(runner.drain(args.shutdown_grace_s), timeout_s=args.shutdown_grace_s + 30)
    if rest is not None:
        runner.call(rest.stop(grace_s=5), timeout_s=30)
    runner.stop()
    return 0
