"""One worker process = one engine, served over a unix socket (proto/tessera/v1/worker.proto).

`python -m gateway.worker --socket PATH [engine flags, as in `tessera generate`]`. The servicer
is thin: proto in, AsyncLLM call, proto out; errors become rich statuses in gateway.errors.
"""

from __future__ import annotations

import gc

# NOTE: a spawned worker (`python -m gateway.worker`) collects no cyclic garbage until it has
# started: the collector's passes over what importing torch and tessera allocates cost ~0.25 s
# of CPU of its start; then the start's objects are frozen and collection turned on (serve()).
# A worker forked from a template starts with it on already, its template's objects frozen.
if __name__ == "__main__":
    gc.disable()

import argparse
import asyncio
import contextlib
import dataclasses
import os
import select
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from gateway import wire
from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import worker_pb2 as wpb
from gateway._proto.tessera.v1 import worker_pb2_grpc
from gateway.errors import to_status
from gateway.logs import configure, get_logger
from gateway.readiness import notify_ready
from gateway.tp_group import rendezvous_folder
from gateway.transfer import CHANNEL_OPTIONS, ROLES, TRANSPORTS, TransferService, transfer_stats
from runtime.async_engine import AsyncLLM
from runtime.candidates import generate_candidates
from runtime.engine_flags import add_engine_flags, engine_config
from runtime.errors import InvalidArgument, RequestCancelled, TesseraError
from runtime.input_processor import ProcessedPrompt
from runtime.loader.checkpoint import Checkpoint
from runtime.outputs import RequestOutput
from runtime.threads import release_openmp_pool

if TYPE_CHECKING:
    from runtime.engine import LLMEngine

log = get_logger("tessera.worker")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, llm: AsyncLLM, served: wire.ServedInfo,
                 fault_tenant: str | None = None, fault_loop: list[str] | None = None,
                 native_ops: str = "", role: str = "both",
                 fault_transfer: list[str] | None = None, kv_transport: str = "auto") -> None:
        self.llm = llm
        self.engine = llm.engine
        self.served = served
        self.fault_tenant = fault_tenant
        # tenant -> loop fault kind (drills): fired once that tenant's request has streamed
        self.loop_faults = {t: k for k, t in (f.split(":", 1) for f in fault_loop or ())}
        self.native_ops = native_ops
        self.requests_served = 0
        # tenant -> transfer fault kind (drills): corrupt a frame, or stall the sender
        faults = {t: k for k, t in (f.split(":", 1) for f in fault_transfer or ())}
        self.transfer = TransferService(llm, served, role, faults, kv_transport)
        self.logprobs = self.transfer.logprobs

    async def Generate(self, request: wpb.WorkerGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request_id or f"w-{uuid.uuid4().hex[:12]}"
        self.requests_served += 1
        try:
            if self.transfer.role == "prefill":
                raise InvalidArgument("a prefill worker serves only Prefill", field="role")
            # NOTE: chat templates and tokenizers run in a pool thread, never on this event
            # loop (other streams' writes) or the engine thread (everyone's steps).
            prompt = await asyncio.to_thread(self._prompt, request)
            params = wire.sampling_params(request.sampling)
            sent = False
            started: set[int] = set()
            finals: dict[int, RequestOutput] = {}
            async for index, out in generate_candidates(self.llm, prompt, params,
                                                        request_id=rid,
                                                        tenant=request.tenant or "default"):
                if out.error is not None:
                    raise out.error
                if out.finished and out.outputs[0].finish_reason == "abort":
                    raise RequestCancelled("the request was aborted", request_id=rid)
                lps = (None if params.logprobs is None
                       else self.logprobs.delta(out, params.logprobs))
                chunk = wire.chunk_response(out, first=not sent, served=self.served, index=index,
                                            logprobs=lps)
                if chunk is not None:
                    sent = True
                    yield chunk
                first = index not in started
                started.add(index)
                if first and index == 0 and request.tenant == self.fault_tenant \
                        and not out.finished:
                    await self._inject_fault(rid)
                if sent and request.tenant in self.loop_faults and not out.finished:
                    self.llm.inject_loop_fault(self.loop_faults.pop(request.tenant))
                if out.finished:
                    finals[index] = out
            yield wire.final_response([finals[i] for i in range(params.n)], self.served)
        except TesseraError as e:
            log.info("request failed", request_id=rid, tenant=request.tenant, reason=e.reason)
            await context.abort_with_status(to_status(e))
        except Exception as e:  # a bug: typed INTERNAL, never gRPC's UNKNOWN with a class name
            log.exception("request failed", request_id=rid, tenant=request.tenant)
            await context.abort_with_status(to_status(e))

    async def Prefill(self, request: wpb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[wpb.PrefillResponse]:
        """Prefill side of a disaggregated request (gateway/transfer.py)."""
        async for resp in self._guarded(self.transfer.prefill(request), request.request_id,
                                        request.tenant, context):
            yield resp

    async def GenerateImported(
            self, request: wpb.ImportGenerateRequest,
            context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """Decode side of a disaggregated request (gateway/transfer.py)."""
        self.requests_served += 1
        stream = self.transfer.generate_imported(request, self._prompt,
                                                 context.time_remaining())
        async for resp in self._guarded(stream, request.request.request_id,
                                        request.request.tenant, context):
            yield resp

    async def _guarded(self, stream: AsyncIterator, rid: str, tenant: str,
                       context: grpc.aio.ServicerContext) -> AsyncIterator:
        """Relay a stream; its failure becomes the call's rich status."""
        try:
            async for resp in stream:
                yield resp
        except TesseraError as e:
            log.info("request failed", request_id=rid, tenant=tenant, reason=e.reason,
                     detail=e.metadata.get("detail", ""))
            await context.abort_with_status(to_status(e))
        except Exception as e:  # a bug: typed INTERNAL
            log.exception("request failed", request_id=rid, tenant=tenant)
            await context.abort_with_status(to_status(e))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def _prompt(self, request: wpb.WorkerGenerateRequest) -> ProcessedPrompt:
        """The request's prompt through the engine's input processor (call it off the loop)."""
        processor = self.engine.processor
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return processor.process(list(request.token_ids.ids))
        if kind == "chat":
            return processor.process_chat([wire.message_dict(m) for m in request.chat.messages])
        return processor.process(request.text, split_special_tokens=request.split_special_tokens)

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
        return wpb.AbortResponse(aborted=await self.llm.abort(request.request_id))

    async def Health(self, request: wpb.HealthRequest,
                     context: grpc.aio.ServicerContext) -> wpb.HealthResponse:
        """Answered here, never through the engine thread: a long step cannot delay it."""
        pulse = self.llm.liveness()
        return wpb.HealthResponse(serving=pulse.alive, worker_id=self.served.worker_id,
                                  pid=os.getpid(), engine_alive=pulse.alive,
                                  last_step_age_s=pulse.last_pass_age_s,
                                  step_running_s=pulse.step_running_s)

    async def Status(self, request: wpb.StatusRequest,
                     context: grpc.aio.ServicerContext) -> wpb.StatusResponse:
        """The snapshot the engine loop published after its last pass (no engine call)."""
        snap = self.llm.snapshot
        stats = snap.stats
        summary = wpb.PrefixCacheSummary(enabled=stats.prefix_cache_enabled,
                                         cached_pages=stats.num_cached_pages,
                                         evictable_pages=stats.num_evictable_pages)
        return wpb.StatusResponse(
            worker_id=self.served.worker_id, served=self.served.to_proto(),
            num_pages=stats.num_pages, num_free_pages=stats.num_free_pages,
            page_size=stats.page_size, num_running=stats.num_running,
            num_waiting=stats.num_waiting, num_preemptions=stats.num_preemptions,
            max_model_len=self.engine.max_model_len, prefix_cache=summary,
            requests_served=self.requests_served, integrity_checks=snap.integrity_checks,
            integrity_mismatches=snap.integrity_mismatches, native_ops=self.native_ops,
            role=self.transfer.role,
            exported=transfer_stats(self.transfer.exported, self.transfer.pending_exports),
            imported=transfer_stats(self.transfer.imported, self.transfer.pending_imports,
                                    self.transfer.page_wait.waiting),
            num_threads=self.engine.num_threads, times=wire.engine_times(snap.times))


def _served(engine, model: str | None, worker_id: str,
            served_name: str | None = None) -> wire.ServedInfo:
    name = served_name or (
        engine.checkpoint.revision.split(":")[0].removesuffix(".gguf") if model is None
        else os.path.basename(os.path.normpath(model)))
    f = engine.formats
    prefill, decode = engine.weight_labels
    return wire.ServedInfo(name, engine.checkpoint.revision, prefill, f.prefill.kv.name,
                           decode, f.decode.kv.name, worker_id)


def _exit_with_parent(socket_path: str, period_s: float = 0.5,
                      parent_pidfd: int | None = None, ready_socket: str | None = None) -> None:
    """A worker outlives no gateway, whatever phase it is in (loading, warming up, serving):
    when its parent goes (even by SIGKILL), it removes its socket, a tensor-parallel group's
    rendezvous folder, the pool's readiness socket (nobody listens on it any more), and the
    gateway's socket folder once empty, and
    exits. A worker forked from a template (gateway/template_process.py)
    watches the gateway through `parent_pidfd` instead: its parent is the template, which may
    go first without taking the worker with it."""
    parent = os.getppid()

    def gone() -> None:
        for path in (socket_path, ready_socket):
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        shutil.rmtree(rendezvous_folder(socket_path), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(socket_path))
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        gone()

    def watch_pidfd() -> None:
        select.select([parent_pidfd], [], [])  # readable once the gateway has exited
        gone()

    threading.Thread(target=watch if parent_pidfd is None else watch_pidfd,
                     name="tessera-parent-watch", daemon=True).start()


def _core_list(value: str) -> tuple[int, ...]:
    parts = value.split(",")
    if not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"want CPU numbers separated by commas, got {value!r}")
    return tuple(int(p) for p in parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gateway.worker", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--socket", required=True, help="unix socket path to listen on")
    p.add_argument("--worker-id", default=None, help="name in logs and metrics "
                   "(default: worker-PID)")
    p.add_argument("--ready-socket", default=None,
                   help="a unix datagram socket told once this worker serves (the gateway's)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients use (the gateway passes its pool's id)")
    add_engine_flags(p)
    p.add_argument("--role", default="both", choices=ROLES,
                   help="both: colocated; prefill / decode: one side of disaggregated serving")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: this worker spans N rank processes (torch."
                        "distributed: gloo on CPU, NCCL on CUDA, rank r on cuda:r); this "
                        "process is rank 0 and spawns the others")
    p.add_argument("--kv-transport", default="auto", choices=TRANSPORTS,
                   help="how a decode worker receives KV frames: auto, through a shared-memory "
                        "ring when the prefill worker is on this host (a unix socket), else in "
                        "the gRPC stream; grpc, always in the stream")
    p.add_argument("--fault-transfer", action="append", default=None, metavar="KIND:TENANT",
                   help="drills only, on a prefill worker: corrupt a KV frame (corrupt), stall "
                        "the transfer after the first token (stall), or hold the request after "
                        "its prefill, before the first token (hold), for each request of "
                        "TENANT; repeatable")
    p.add_argument("--compute-cores", type=_core_list, default=None, metavar="CPU,CPU,...",
                   help="pin this worker's threads to these CPUs (the gateway passes them where "
                        "runtime/platform.py's compute_cores decides to pin)")
    p.add_argument("--fault-tenant", default=None,
                   help="drills only: corrupt the page table of each request of this tenant")
    p.add_argument("--fault-loop", action="append", default=None, metavar="KIND:TENANT",
                   help="drills only: once a request of TENANT has streamed, kill (kill) or "
                        "wedge (wedge) the engine loop; repeatable")
    args = p.parse_args(argv)
    if args.tp < 1:
        p.error("--tp must be at least 1")
    if args.tp > 1 and args.role != "both":
        p.error("--tp serves colocated workers only (not yet a prefill or decode role)")
    return args


async def serve(args: argparse.Namespace, checkpoint: Checkpoint | None = None,
                marks: dict[str, float] | None = None, engine: LLMEngine | None = None) -> None:
    """Serve until SIGTERM. `checkpoint`: one opened already (by a template this process was
    forked from), else `args.model` is opened here. `marks`: phase name -> time.monotonic()
    at its end, so far (a forked child's), extended here and sent with the readiness.
    `engine`: the template's engine, built and warmed for this configuration, adopted here
    (gateway/template_warm.py)."""
    marks = {} if marks is None else marks
    marks["main"] = time.monotonic()
    from kernels.cpu_ops import native_status
    from runtime.engine import LLMEngine
    from runtime.loader import open_checkpoint

    worker_id = args.worker_id or f"worker-{os.getpid()}"
    started = time.monotonic()
    # NOTE: unseeded requests draw from the engine's default generator; a fixed seed would give
    # every worker (forked from one template or spawned) the same unseeded samples.
    config = dataclasses.replace(engine_config(args),
                                 seed=int.from_bytes(os.urandom(8), "little") >> 1)
    adopted = engine is not None and args.tp == 1
    group = None
    if args.tp > 1:  # NOTE: spawned, never forked from a template (gateway/template.py)
        from gateway.tp_group import start_leader

        group, engine = start_leader(config, args.model, args.tp, worker_id,
                                     rendezvous_folder(args.socket))
    elif engine is None:
        engine = LLMEngine(checkpoint or open_checkpoint(args.model), config)
    else:
        from gateway.template_warm import adopt_engine

        adopt_engine(engine, config)
    engine_s = time.monotonic() - started
    marks["adopt_engine" if adopted else "engine"] = time.monotonic()
    if args.compute_cores:
        engine.platform.pin_compute_threads(args.compute_cores)
    # NOTE: before the socket exists, so the gateway never routes to a worker that would pay
    # a native build or a first-use cost on a client's request (an adopted engine has paid).
    started = time.monotonic()
    if not adopted:
        # NOTE: first-use costs (~0.55 s of CPU) wait until the worker is idle after it reports
        # ready, as an idle template's finish_load does: a plain first request never needs them
        engine.warm_up(first_use=False)
        marks["warm_up"] = time.monotonic()
    native_ops = native_status() if engine.device.type == "cpu" else ""
    log.info("worker warmed up", worker=worker_id, native_ops=native_ops,
             engine_s=round(engine_s, 3), warm_up_s=round(time.monotonic() - started, 3),
             forked=checkpoint is not None, adopted=adopted)
    if not gc.isenabled():  # NOTE: a spawned worker started without it (top of this file)
        gc.freeze()
        gc.enable()
    # NOTE: the engine steps on AsyncLLM's thread from here; a second OpenMP pool left on this
    # one would halve its speed (runtime/threads.py)
    release_openmp_pool()
    llm = AsyncLLM(engine, when_idle=None if adopted else engine.prepare_first_use)
    if group is not None:
        group.stop_with_engine(llm)
    served = _served(engine, args.model, worker_id, args.served_model_name)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    worker_pb2_grpc.add_WorkerServicer_to_server(
        WorkerServicer(llm, served, args.fault_tenant, args.fault_loop, native_ops, args.role,
                       args.fault_transfer, args.kv_transport), server)
    server.add_insecure_port(f"unix:{args.socket}")
    await server.start()
    log.info("worker serving", worker=worker_id, socket=args.socket, model=served.model,
             revision=served.revision, pid=os.getpid(),
             prefill=f"{served.prefill_weights}/{served.prefill_kv_cache}",
             decode=f"{served.decode_weights}/{served.decode_kv_cache}")
    marks["serve"] = time.monotonic()
    if args.ready_socket:
        # NOTE: a forked child's CPU clock starts at its fork (POSIX times() are reset)
        notify_ready(args.ready_socket, worker_id, marks, time.process_time())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("worker stopping", worker=worker_id)
    await server.stop(grace=5)
    if group is not None:
        group.begin_stop()  # the engine loop's end below is expected
    llm.shutdown()
    if group is not None:
        group.close()


def main(argv: list[str] | None = None, *, checkpoint: Checkpoint | None = None,
         parent_pidfd: int | None = None, marks: dict[str, float] | None = None,
         engine: LLMEngine | None = None) -> int:
    """The worker's process entry; a template's forked child passes its opened `checkpoint`,
    a pidfd of the gateway to exit with, the marks of its phases so far and its warmed engine,
    when it has one for this worker's configuration."""
    configure()
    args = parse_args(argv)
    _exit_with_parent(args.socket, parent_pidfd=parent_pidfd, ready_socket=args.ready_socket)
    try:
        asyncio.run(serve(args, checkpoint, marks, engine))
    except TesseraError as e:
        log.error("worker failed to start", reason=e.reason, error=e.message)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
