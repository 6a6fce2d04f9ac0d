"""The pieces of relaying one public request to a worker (gateway/grpc_server.py: `_relay`
keeps the loop, whose yields and cleanup must stay in one generator): the routing keys, opening
a worker's call (colocated or disaggregated), accounting each streamed response, deciding what
a failed attempt becomes, and giving an attempt's slots back."""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from gateway import metrics
from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import worker_pb2 as wpb
from gateway.errors import Unavailable, WorkerLost, from_rpc_error
from gateway.wire import MAX_NAME_BYTES, SESSION_HEADER
from runtime.errors import InvalidArgument, TesseraError

PREFIX_CHARS = 64  # prompts at least this long are routed to where their prefix last went
MAX_TRANSPARENT_RETRIES = 2


def session_key(tenant: str, session: str | None) -> str | None:
    """The router's key for a client's session id: scoped to the tenant (one tenant can never
    pin itself to another's session) and of fixed size (a client's id costs no memory)."""
    if session is None:
        return None
    if len(session.encode()) > MAX_NAME_BYTES:
        raise InvalidArgument(f"{SESSION_HEADER} over {MAX_NAME_BYTES} bytes", field=SESSION_HEADER)
    return _digest(tenant, session)


def _digest(tenant: str, text: str) -> str:
    return hashlib.blake2b(f"{tenant}\0{text}".encode(), digest_size=16).hexdigest()


def prefix_key(tenant: str, session: str | None, prefix: str) -> str | None:
    """The router's key for a prompt's prefix: a request without a session whose prompt starts
    with PREFIX_CHARS or more goes where that prefix went last (its pages may be cached there);
    None otherwise."""
    if session is not None or len(prefix) < PREFIX_CHARS:
        return None
    return _digest(tenant, prefix)


@dataclass
class Attempt:
    """One attempt's worker(s) and call; `prefiller` is None once its slot is given back."""

    pool: Any  # gateway.supervisor.WorkerPool
    worker: Any  # gateway.worker_handle.WorkerHandle
    call: Any = None
    prefill_pool: Any = None
    prefiller: Any = None


@dataclass
class Relayed:
    """What a request has streamed so far: for metrics, billing and whether it may retry."""

    start: float = field(default_factory=time.perf_counter)
    streamed: bool = False
    last: float | None = None
    final_seen: bool = False
    billed: pb.Usage = field(default_factory=pb.Usage)  # what a cut-short stream is billed


async def open_call(gw: Any, attempt: Attempt, wreq: wpb.WorkerGenerateRequest,
                    session: str | None, prefix_key: str | None, tenant: Any,
                    context: grpc.aio.ServicerContext) -> None:
    """Start `attempt`'s call: Generate on a colocated worker, or, for a disaggregated model,
    GenerateImported on the decode worker (picked and reserved first) from a prefill worker
    acquired here. On failure the decode slot is given back."""
    attempt.prefill_pool = gw.prefill_pools.get(attempt.pool.config.model_id)
    if attempt.prefill_pool is None:
        attempt.call = attempt.worker.stub.Generate(wreq, timeout=context.time_remaining())
        return
    try:
        attempt.prefiller = await attempt.prefill_pool.acquire(
            session, prefix_key, context.time_remaining(), tenant=tenant.name,
            limits=gw.limits_for(tenant))
    except BaseException:
        await attempt.pool.release(attempt.worker, tenant.name)
        raise
    attempt.call = attempt.worker.stub.GenerateImported(wpb.ImportGenerateRequest(
        request=wreq, prefill_target=f"unix:{attempt.prefiller.socket_path}",
        transfer_timeout_s=attempt.pool.config.transfer_timeout_s),
        timeout=context.time_remaining())


async def account(gw: Any, attempt: Attempt, relayed: Relayed, resp: pb.GenerateResponse,
                  model: str, tenant: str) -> None:
    """Book one response from the worker: the prefill slot back at the first one, time to
    first token or between tokens, the usage billed so far, the final's usage recorded."""
    now = time.perf_counter()
    if attempt.prefiller is not None:  # prefill done, first token out: its slot is free again
        await attempt.prefill_pool.release(attempt.prefiller, tenant)
        attempt.prefiller = None
    if resp.HasField("chunk"):
        hist = metrics.ITL if relayed.streamed else metrics.TTFT
        hist.labels(model).observe(now - (relayed.last or relayed.start))
        relayed.streamed, relayed.last = True, now
        if resp.chunk.HasField("usage"):
            relayed.billed.CopyFrom(resp.chunk.usage)
        relayed.billed.completion_tokens += len(resp.chunk.token_ids)
    else:
        relayed.final_seen = True
        gw.record_usage(tenant, resp.final.usage)


async def failed_attempt(gw: Any, attempt: Attempt, error: BaseException, relayed: Relayed,
                         number: int, cancelling: bool) -> TesseraError | None:
    """What a call that failed with `error` (an RPC error, or a cancellation that was not the
    client's: `cancelling` False) becomes: None to retry on another worker (it was lost before
    the first token, retries left), else the error to end the request with."""
    if isinstance(error, asyncio.CancelledError) and cancelling:
        raise error  # the client went away or its deadline passed
    if gw.closing:
        return Unavailable("the server shut down before this request finished",
                           retry_after_s=1)
    err = (from_rpc_error(error) if isinstance(error, grpc.aio.AioRpcError)
           else WorkerLost(f"the call to worker {attempt.worker.id} was cut off"))
    if isinstance(err, WorkerLost):
        await attempt.pool.report_lost(attempt.worker)
        if not relayed.streamed and number < MAX_TRANSPARENT_RETRIES:
            return None
    return err


async def end_attempt(gw: Any, attempt: Attempt, tenant: str) -> None:
    """Cancel the call (a no-op once finished; aborts the worker's request otherwise) and give
    every slot it held back."""
    gw._calls.discard(attempt.call)
    if attempt.call is not None:
        attempt.call.cancel()
    await attempt.pool.release(attempt.worker, tenant)
    if attempt.prefiller is not None:
        await attempt.prefill_pool.release(attempt.prefiller, tenant)
