"""The public gRPC server: authenticate, route to a worker pool, relay the stream, map errors.

Servicers are thin: requests are forwarded to workers as worker.proto messages; every failure
leaves through gateway.errors.to_status, so the SDK sees one ErrorInfo per status.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway import metrics
from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import gateway_pb2_grpc
from gateway._proto.tessera.v1 import worker_pb2 as wpb
from gateway.auth import ApiKeys, Tenant
from gateway.errors import Unavailable, to_status
from gateway.fairness import NO_LIMITS, TenantLimits
from gateway.interceptors import MalformedRequestInterceptor
from gateway.logs import get_logger
from gateway.ports import GRPC_EXCLUSIVE, PortInUse
from gateway.relay import (
    MAX_TRANSPARENT_RETRIES,
    PREFIX_CHARS,
    Attempt,
    Relayed,
    account,
    end_attempt,
    failed_attempt,
    open_call,
    prefix_key,
    session_key,
)
from gateway.supervisor import WorkerPool
from gateway.wire import MAX_NAME_BYTES, SESSION_HEADER
from runtime.errors import InvalidArgument, ModelNotFound, TesseraError

log = get_logger("tessera.gateway")
DEADLINE_SLACK_S = 0.05  # a cancel this close to the deadline is the deadline
# Sizes refused at the edge, as INVALID_ARGUMENT whatever the excess (docs/api.md, "Limits").
MAX_PROMPT_BYTES = 1 << 20  # prompt text, or all chat message contents together
MAX_PROMPT_TOKEN_IDS = 1 << 18
# gRPC's own limit sits above ours, so a big prompt meets our typed refusal first.
MAX_MESSAGE_BYTES = 8 << 20


class Gateway:
    """State shared by the servicers: pools by model id, keys, per-tenant usage totals."""

    def __init__(self, pools: dict[str, WorkerPool], keys: ApiKeys,
                 default_model: str | None = None,
                 tenant_limits: TenantLimits = NO_LIMITS,
                 prefill_pools: dict[str, WorkerPool] | None = None) -> None:
        self.pools = pools  # colocated or decode workers, by model id
        # Disaggregated models: their prefill pool (the model's entry in `pools` decodes).
        self.prefill_pools = prefill_pools or {}
        self.keys = keys
        self.tenant_limits = tenant_limits  # for keys that set none of their own
        self.default_model = default_model or next(iter(pools))
        self.usage: dict[str, Counter[str]] = defaultdict(Counter)
        self.draining = False  # refuse new requests (UNAVAILABLE); in-flight ones go on
        self.closing = False  # in-flight requests are being ended (UNAVAILABLE)
        self.inflight = 0
        self.health: tuple[health.aio.HealthServicer, tuple[str, ...]] | None = None
        self._calls: set[grpc.aio.Call] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def pool_for(self, tenant: Tenant, model: str) -> WorkerPool:
        if len(model.encode()) > MAX_NAME_BYTES:
            raise InvalidArgument(f"model id over {MAX_NAME_BYTES} bytes", field="model")
        model = model or self.default_model
        pool = self.pools.get(model)
        if pool is None:
            raise ModelNotFound(f"no model {model!r} is served here", model=model)
        self.keys.authorize(tenant, model)
        return pool

    def limits_for(self, tenant: Tenant) -> TenantLimits:
        return tenant.limits.over(self.tenant_limits)

    def record_usage(self, tenant: str, usage: pb.Usage) -> None:
        totals = self.usage[tenant]
        for kind in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            n = getattr(usage, kind)
            totals[kind] += n
            metrics.TOKENS.labels(tenant, kind.removesuffix("_tokens")).inc(n)

    def serving(self) -> bool:
        """Ready for traffic: not draining, and every pool has a ready worker (or may start
        one on demand)."""
        return not self.draining and all(
            p.ready() or p.config.min_workers == 0
            for p in (*self.pools.values(), *self.prefill_pools.values()))

    async def refresh_health(self) -> None:
        """grpc.health.v1 follows `serving()`, so a readiness probe holds traffic back until
        workers are up and while the gateway drains."""
        if self.health is None:
            return
        servicer, services = self.health
        status = (health_pb2.HealthCheckResponse.SERVING if self.serving()
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in services:
            await servicer.set(service, status)

    async def drain(self, grace_s: float) -> None:
        """Graceful shutdown: refuse new requests at once, let in-flight ones finish for up to
        grace_s, then end the rest with a typed UNAVAILABLE."""
        self.draining = True
        await self.refresh_health()
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            pass
        if self.inflight:
            log.warning("ending requests still in flight after the grace period",
                        inflight=self.inflight, grace_s=grace_s)
            self.closing = True
            for call in list(self._calls):
                call.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 5)

    def _enter(self) -> None:
        if self.draining:
            raise Unavailable("the server is shutting down; retry on another replica",
                              retry_after_s=1)
        self.inflight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()


def _check_prompt_size(nbytes: int, ntokens: int = 0) -> None:
    if nbytes > MAX_PROMPT_BYTES or ntokens > MAX_PROMPT_TOKEN_IDS:
        raise InvalidArgument(f"prompt over the limit of {MAX_PROMPT_BYTES} bytes "
                              f"({MAX_PROMPT_TOKEN_IDS} token ids)", field="prompt")


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        def build() -> tuple[wpb.WorkerGenerateRequest, str]:
            _check_prompt_size(len(request.prompt.encode()), len(request.prompt_token_ids))
            if request.prompt_token_ids:
                wreq = wpb.WorkerGenerateRequest(
                    token_ids=wpb.TokenIds(ids=request.prompt_token_ids))
                prefix = ",".join(map(str, request.prompt_token_ids[:PREFIX_CHARS // 4]))
            else:
                wreq = wpb.WorkerGenerateRequest(text=request.prompt)
                prefix = request.prompt[:PREFIX_CHARS]
            wreq.sampling.CopyFrom(request.sampling)
            wreq.split_special_tokens = request.split_special_tokens
            return wreq, prefix

        async for resp in self._stream(request.model, build, context):
            yield resp

    async def Chat(self, request: pb.ChatRequest,
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        def build() -> tuple[wpb.WorkerGenerateRequest, str]:
            _check_prompt_size(sum(len(m.content.encode()) + len(m.role.encode())
                                   for m in request.messages))
            wreq = wpb.WorkerGenerateRequest(chat=wpb.ChatMessages(messages=request.messages),
                                             sampling=request.sampling)
            prefix = "".join(f"{m.role}:{m.content}" for m in request.messages)[:PREFIX_CHARS]
            return wreq, prefix

        async for resp in self._stream(request.model, build, context):
            yield resp

    async def _stream(self, model: str,
                      build: Callable[[], tuple[wpb.WorkerGenerateRequest, str]],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """`_relay`, closed as soon as this handler's generator is: grpc leaves a handler it
        cancels suspended at its `yield`, and without the close `_relay` (suspended at its own)
        would end only when collected, its slots held until then."""
        async with contextlib.aclosing(self._relay(model, build, context)) as stream:
            async for resp in stream:
                yield resp

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        try:
            tenant = self.gw.keys.authenticate(context.invocation_metadata())
        except TesseraError as e:
            await context.abort_with_status(to_status(e))
        models = []
        for model_id, pool in self.gw.pools.items():
            if not tenant.may_use(model_id):
                continue
            ready = pool.ready()
            status = next((w.status for w in ready if w.status is not None), None)
            failed = pool.start_failures.failed and not ready
            models.append(pb.ModelInfo(
                id=model_id, ready_workers=len(ready),
                revision=status.served.revision if status else "",
                max_model_len=status.max_model_len if status else 0,
                state="ready" if ready else "failed" if failed else "starting",
                start_error=(pool.start_failures.cause or "") if failed else ""))
        return pb.ListModelsResponse(models=models)

    async def _relay(self, model: str,
                     build: Callable[[], tuple[wpb.WorkerGenerateRequest, str]],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """Authenticate, admit to the model's pool, relay the worker's stream (retried on
        another worker when one is lost before the first token), map every failure to a
        status; the pieces are gateway/relay.py. NOTE: the loop and its cleanup stay in this
        one generator, so that a client gone mid-stream gives the slots back at once."""
        rid = f"req-{uuid.uuid4().hex[:16]}"
        bound = log.bind(request_id=rid)
        reason, label = "OK", "?"  # NOTE: only served model ids become metric labels
        entered = False
        relayed = Relayed()
        tenant_name: str | None = None
        try:
            self.gw._enter()
            entered = True
            tenant = self.gw.keys.authenticate(context.invocation_metadata())
            bound = bound.bind(tenant=tenant.name)
            pool = self.gw.pool_for(tenant, model)
            label = model = pool.config.model_id
            metadata = dict(context.invocation_metadata() or ())
            session = session_key(tenant.name, metadata.get(SESSION_HEADER) or None)
            wreq, prefix = build()
            by_prefix = prefix_key(tenant.name, session, prefix)
            wreq.request_id, wreq.tenant = rid, tenant.name
            tenant_name = tenant.name
            for number in range(MAX_TRANSPARENT_RETRIES + 1):
                # NOTE: each attempt is its own request on the workers: a retry never meets
                # its lost attempt's export (or import), still being freed on a live worker.
                wreq.request_id = rid if number == 0 else f"{rid}.{number}"
                attempt = Attempt(pool, await pool.acquire(
                    session, by_prefix, context.time_remaining(), tenant=tenant.name,
                    limits=self.gw.limits_for(tenant)))
                bound = bound.bind(worker=attempt.worker.id)
                await open_call(self.gw, attempt, wreq, session, by_prefix, tenant, context)
                if attempt.prefiller is not None:
                    bound = bound.bind(prefill_worker=attempt.prefiller.id)
                self.gw._calls.add(attempt.call)
                try:
                    async for resp in attempt.call:
                        await account(self.gw, attempt, relayed, resp, model, tenant.name)
                        yield resp
                    break
                except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
                    err = await failed_attempt(self.gw, attempt, e, relayed, number,
                                               _cancelling())
                    if err is not None:
                        raise err from None
                    bound.warning("worker lost before the first token; retrying")
                finally:
                    await end_attempt(self.gw, attempt, tenant.name)
        except TesseraError as e:
            reason = e.reason
            bound.info("request failed", reason=e.reason, error=e.message)
            await context.abort_with_status(to_status(e))
        except (asyncio.CancelledError, GeneratorExit):
            # GeneratorExit: closed while suspended at a `yield` (the client left between
            # two responses): as much a cancel as a CancelledError inside an await
            reason = _cancel_reason(context)
            raise
        except Exception as e:  # never leak a traceback to the client
            reason = "INTERNAL"
            bound.exception("request failed")
            await context.abort_with_status(to_status(e))
        finally:
            if entered:
                self.gw._leave()
            if tenant_name is not None and not relayed.final_seen \
                    and relayed.billed.prompt_tokens:
                self.gw.record_usage(tenant_name, relayed.billed)  # cut short: bill what it cost
            metrics.REQUESTS.labels(label, reason).inc()
            bound.info("request done", reason=reason,
                       elapsed_s=round(time.perf_counter() - relayed.start, 4))


def _cancel_reason(context: grpc.aio.ServicerContext) -> str:
    """Why the call was cancelled: its deadline passed, or the client left."""
    remaining_s = context.time_remaining()
    # NOTE: grpc cancels the handler at the deadline; the clock read here lags it slightly.
    if remaining_s is not None and remaining_s <= DEADLINE_SLACK_S:
        return "DEADLINE_EXCEEDED"
    return "CANCELLED"


def _cancelling() -> bool:
    """Whether this task itself is being cancelled (not a call it awaited)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return True if cancelling is None else cancelling() > 0


async def build_server(gateway: Gateway, host: str = "127.0.0.1",
                       port: int = 0) -> tuple[grpc.aio.Server, int]:
    """A started-ready (not yet started) server with the gateway, health and reflection."""
    server = grpc.aio.server(
        interceptors=[MalformedRequestInterceptor()],
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), GRPC_EXCLUSIVE])
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(gateway), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    name = pb.DESCRIPTOR.services_by_name["Gateway"].full_name
    gateway.health = (health_servicer, ("", name))
    await gateway.refresh_health()
    reflection.enable_server_reflection((name, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                        server)
    try:
        bound_port = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises this when the address cannot be bound
        bound_port = 0
    if bound_port == 0:
        raise PortInUse(port, "--grpc-port")
    return server, bound_port
