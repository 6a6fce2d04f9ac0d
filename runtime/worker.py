"""One worker process = one engine, served over a unix socket (proto/tessera/v1/worker.proto).

`python -m runtime.worker --socket PATH [--model M] [--kv-cache-bytes N] ...`. The servicer is
thin: proto in, AsyncLLM call, proto out; errors become rich statuses in gateway.errors.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator

import grpc

from gateway import convert
from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import worker_pb2 as wpb
from gateway._proto.tessera.v1 import worker_pb2_grpc
from gateway.errors import to_status
from gateway.logs import configure, get_logger
from runtime.async_engine import AsyncLLM
from runtime.errors import RequestCancelled, TesseraError

log = get_logger("tessera.worker")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, llm: AsyncLLM, served: convert.ServedInfo,
                 fault_tenant: str | None = None) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.served = served
        self.fault_tenant = fault_tenant
        self.requests_served = 0

    async def Generate(self, request: wpb.WorkerGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request_id or f"w-{uuid.uuid4().hex[:12]}"
        self.requests_served += 1
        try:
            prompt = self._prompt(request)
            params = convert.sampling_params(request.sampling)
            first = True
            async for out in self.llm.generate(prompt, params, request_id=rid,
                                               tenant=request.tenant or "default"):
                if out.error is not None:
                    raise out.error
                if out.finished and out.outputs[0].finish_reason == "abort":
                    raise RequestCancelled("the request was aborted", request_id=rid)
                chunk = convert.chunk_response(out)
                if chunk is not None:
                    yield chunk
                if first and request.tenant == self.fault_tenant and not out.finished:
                    await self._inject_fault(rid)
                first = False
                if out.finished:
                    yield convert.final_response(out, self.served)
        except TesseraError as e:
            log.info("request failed", request_id=rid, tenant=request.tenant, reason=e.reason)
            await context.abort_with_status(to_status(e))

    def _prompt(self, request: wpb.WorkerGenerateRequest) -> str | list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            return self.engine.tokenizer.encode_chat(messages)
        if request.split_special_tokens and request.text:
            return self.engine.tokenizer.encode(request.text, split_special_tokens=True)
        return request.text

    async def _inject_fault(self, request_id: str) -> None:
        """Operator drill (--fault-tenant): corrupt this tenant's live request's page table
        (first and last entries swapped; a prompt of two pages or more) so the integrity check
        must catch it. Nothing leaks: the pages it recorded are still the ones it releases."""
        from runtime.faults import FaultInjector

        def swap() -> None:
            try:
                FaultInjector(self.engine).swap_entries(request_id, 0, -1)
            except LookupError:
                pass  # already finished

        await self.llm.call(swap)

    async def Abort(self, request: wpb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> wpb.AbortResponse:
        rid = request.request_id
        live = await self.llm.call(lambda: rid in self.engine.requests)
        if live:
            await self.llm.abort(rid)
        return wpb.AbortResponse(aborted=bool(live))

    async def Health(self, request: wpb.HealthRequest,
                     context: grpc.aio.ServicerContext) -> wpb.HealthResponse:
        return wpb.HealthResponse(serving=self.llm._thread.is_alive(),
                                  worker_id=self.served.worker_id, pid=os.getpid())

    async def Status(self, request: wpb.StatusRequest,
                     context: grpc.aio.ServicerContext) -> wpb.StatusResponse:
        def read() -> wpb.StatusResponse:
            e = self.engine
            stats = e.stats()
            cache = e.prefix_cache
            summary = wpb.PrefixCacheSummary(
                enabled=cache is not None, cached_pages=0 if cache is None else len(cache),
                evictable_pages=0 if cache is None else cache.num_evictable)
            counters = e.tracker.counters
            return wpb.StatusResponse(
                worker_id=self.served.worker_id, served=self.served.to_proto(),
                num_pages=stats.num_pages, num_free_pages=stats.num_free_pages,
                page_size=stats.page_size, num_running=stats.num_running,
                num_waiting=stats.num_waiting, num_preemptions=stats.num_preemptions,
                max_model_len=e.max_model_len, prefix_cache=summary,
                requests_served=self.requests_served,
                integrity_checks=counters.checks_run,
                integrity_mismatches=counters.num_mismatches)

        return await self.llm.call(read)


def _served(engine, model: str | None, worker_id: str) -> convert.ServedInfo:
    name = engine.checkpoint.revision.split(":")[0].removesuffix(".gguf") if model is None \
        else os.path.basename(os.path.normpath(model))
    f = engine.formats
    return convert.ServedInfo(name, engine.checkpoint.revision, f.prefill.weights.label,
                              f.prefill.kv.name, f.decode.weights.label, f.decode.kv.name,
                              worker_id)


async def _exit_with_parent(stop: asyncio.Event, period_s: float = 1.0) -> None:
    """A worker outlives no gateway: when its parent goes, it stops too."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(period_s)
    stop.set()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.worker", description=__doc__)
    p.add_argument("--socket", required=True, help="unix socket path to listen on")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--tenant-page-quota", type=float, default=1.0)
    p.add_argument("--integrity", default="tags", choices=["tags", "off"])
    fmts = p.add_argument_group("serving formats, as in `tessera generate`")
    fmts.add_argument("--kv-cache-dtype", default="auto")
    fmts.add_argument("--prefill-kv-cache-dtype", default="auto")
    fmts.add_argument("--prefill-weights", default="auto")
    fmts.add_argument("--decode-weights", default="auto")
    fmts.add_argument("--weight-group-size", type=int, default=128)
    fmts.add_argument("--weight-asymmetric", action="store_true")
    fmts.add_argument("--serving-config", default=None, metavar="FILE")
    p.add_argument("--fault-tenant", default=None,
                   help="drills only: corrupt the page table of each request of this tenant")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    from runtime.cli import format_kwargs
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine

    worker_id = args.worker_id or f"worker-{os.getpid()}"
    config = EngineConfig(kv_cache_bytes=args.kv_cache_bytes, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs, dtype=args.dtype,
                          tenant_page_quota=args.tenant_page_quota, integrity=args.integrity,
                          **format_kwargs(args))
    engine = LLMEngine.from_path(args.model, config)
    llm = AsyncLLM(engine)
    served = _served(engine, args.model, worker_id)
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(
        WorkerServicer(llm, served, args.fault_tenant), server)
    server.add_insecure_port(f"unix:{args.socket}")
    await server.start()
    log.info("worker serving", worker=worker_id, socket=args.socket, model=served.model,
             revision=served.revision, pid=os.getpid())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(_exit_with_parent(stop))
    await stop.wait()
    watcher.cancel()
    log.info("worker stopping", worker=worker_id)
    await server.stop(grace=5)
    llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    configure()
    args = parse_args(argv)
    try:
        asyncio.run(serve(args))
    except TesseraError as e:
        log.error("worker failed to start", reason=e.reason, error=e.message)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
