"""The worker side of disaggregated serving (runtime/disagg over gRPC between worker processes).

A decode worker's `GenerateImported` reserves the prompt's pages first, then calls `Prefill` on
the prefill worker the gateway named. When the pages are not free, the request waits for them
in arrival order (as vLLM's and SGLang's decode sides queue a transfer until their KV cache has
room) while the prefill side holds nothing for it: past the request's deadline it ends
DEADLINE_EXCEEDED (without one, OVERLOADED after the transfer timeout), and no byte moved.
The prefill worker prefills, samples the first token and sends its chunk (relayed to the
client at once), then the request's KV as checksummed frames. Each frame is gathered on the
prefill engine's thread and verified and written on the decode engine's thread one at a time,
so at most one frame (at most `max_frame_bytes`) is in the making on each side beyond gRPC's
flow-controlled window: a slow decode side stalls the sender instead of queueing pages in
memory. When the prefill worker is on this host (a unix socket), frames move through a
shared-memory ring the decode side creates (runtime/disagg/shm.py, at most RING_SLOTS frames
in flight) and the stream carries only (slot, length): the same bytes, the same checks.
Only after the end frame and every (layer, page) are verified does the import commit: fresh
tags, then the request decodes. Any failure frees both sides' pages and ends this
request only, typed: KV_INTEGRITY_VIOLATION (cause `transfer`) for a frame that fails
verification, DEADLINE_EXCEEDED for a transfer past its deadline, UNAVAILABLE when the
prefill worker is lost, CANCELLED when the client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc

from gateway import wire
from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import worker_pb2 as wpb
from gateway._proto.tessera.v1 import worker_pb2_grpc
from gateway.errors import Unavailable, WorkerLost, from_rpc_error
from gateway.logprobs import TokenLogprobs
from gateway.page_wait import PageWait
from runtime.async_engine import AsyncLLM
from runtime.disagg.export import DEFAULT_FRAME_BYTES, KVExport
from runtime.disagg.frames import FrameError
from runtime.disagg.importer import KVImport
from runtime.disagg.metrics import TransferCounters
from runtime.disagg.shm import FrameRing
from runtime.errors import InvalidArgument, RequestCancelled, TransferDeadlineExceeded
from runtime.input_processor import ProcessedPrompt
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

ROLES = ("both", "prefill", "decode")
TRANSPORTS = ("auto", "grpc")  # auto: a shared-memory ring when the prefill worker is local
DEFAULT_TRANSFER_TIMEOUT_S = 60.0
MAX_FRAME_BYTES = 8 << 20  # a frame's byte budget, whatever the caller asks
RING_SLOTS = 4  # frames in flight through shared memory, each at most a frame's budget
RING_SLACK_BYTES = 64 << 10  # a frame's header beside its payload budget
RING_POLL_S = 0.001  # how often a sender with every ring slot in flight looks again
# gRPC's per-message limit on the worker-to-worker channel: a frame plus its envelope.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_FRAME_BYTES + (1 << 20))]


def corrupt_frame(frame_seq: int, data: bytes) -> bytes:
    """Drills (--fault-transfer corrupt:TENANT): flip one payload bit of the first pages frame,
    as a bad NIC or a buggy copy would; the checksum must catch it on import."""
    if frame_seq != 1:
        return data
    bad = bytearray(data)
    bad[-7] ^= 0x10  # inside the payload (msgpack puts it last)
    return bytes(bad)


def transfer_stats(c: TransferCounters, pending: int, waiting: int = 0) -> wpb.TransferStats:
    return wpb.TransferStats(transfers=c.transfers, frames=c.frames, pages=c.pages,
                             bytes=c.bytes, duration_s=c.duration_s,
                             failures=dict(c.failures), pending=pending, waiting=waiting,
                             shm_frames=c.shm_frames)


class TransferService:
    """Both halves of a transfer for one worker; the WorkerServicer delegates to it."""

    def __init__(self, llm: AsyncLLM, served: wire.ServedInfo, role: str = "both",
                 faults: dict[str, str] | None = None, transport: str = "auto") -> None:
        if role not in ROLES:
            raise InvalidArgument(f"unknown worker role {role!r}", field="role")
        self.llm = llm
        self.engine = llm.engine
        self.served = served
        self.role = role
        if transport not in TRANSPORTS:
            raise InvalidArgument(f"unknown KV transport {transport!r}", field="transport")
        self.transport = transport
        # tenant -> "corrupt" | "stall" | "hold" (drills only, on the prefill side)
        self.faults = dict(faults or {})
        self.exported = TransferCounters()
        self.imported = TransferCounters()
        self.pending_exports = 0
        self.pending_imports = 0
        self.page_wait = PageWait(llm)
        self.logprobs = TokenLogprobs(self.engine.tokenizer)
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}

    def _logprobs(self, out: RequestOutput, params: SamplingParams) -> list[pb.TokenLogprob]:
        return [] if params.logprobs is None else self.logprobs.delta(out, params.logprobs)

    def _require(self, *roles: str) -> None:
        if self.role not in roles:
            raise InvalidArgument(f"this worker's role is {self.role!r}", field="role")

    # -- prefill side ---------------------------------------------------------------------

    async def prefill(self, request: wpb.PrefillRequest) -> AsyncIterator[wpb.PrefillResponse]:
        """Prefill, the first token's chunk, then the KV frames; pages freed however it ends."""
        self._require("prefill", "both")
        rid, tenant = request.request_id, request.tenant or "default"
        params = wire.sampling_params(request.sampling)
        ids = await asyncio.to_thread(self.engine.processor.process, list(request.token_ids.ids))
        budget = min(request.max_frame_bytes or DEFAULT_FRAME_BYTES, MAX_FRAME_BYTES)
        held: list[KVExport] = []

        def admit() -> None:
            held.append(KVExport.start(self.engine, rid, ids, params, tenant,
                                       counters=self.exported))

        fault = self.faults.get(tenant)
        ring: FrameRing | None = None
        self.pending_exports += 1
        try:
            async for out in self.llm.stream(rid, admit):
                if out.error is not None:
                    raise out.error
                if out.finished and out.outputs[0].finish_reason == "abort":
                    raise RequestCancelled("the request was aborted", request_id=rid)
                if fault == "hold":  # prompt computed, first token not out: both sides hold
                    await asyncio.Event().wait()  # pages until the call ends
                chunk = wire.chunk_response(out, first=True, served=self.served,
                                            logprobs=self._logprobs(out, params))
                if chunk is not None:
                    yield wpb.PrefillResponse(out=chunk)
                if out.finished:
                    break
            export = held[0]
            if not await self.llm.call(lambda: export.needs_transfer):
                # The first token ended it (eos, a stop, max_tokens 1): nothing to move.
                yield wpb.PrefillResponse(out=wire.final_response([out], self.served))
                return
            if fault == "stall":
                await asyncio.Event().wait()  # a sender that never sends: the deadline ends it
            frames = export.frames(request.first_page, budget,
                                   corrupt_frame if fault == "corrupt" else None)
            ring = _attach(request.shm_ring)
            while (data := await self.llm.call(lambda: next(frames, None))) is not None:
                if ring is None or not ring.fits(len(data)):
                    yield wpb.PrefillResponse(frame=data)
                    continue
                while (slot := ring.try_put(data)) is None:  # every slot still in flight
                    await asyncio.sleep(RING_POLL_S)
                self.exported.shm_frames += 1
                yield wpb.PrefillResponse(shm_frame=wpb.ShmFrame(slot=slot, nbytes=len(data)))
        finally:
            if ring is not None:
                ring.close()
            self.pending_exports -= 1
            if held:
                self.llm.submit(held[0].release)

    # -- decode side ----------------------------------------------------------------------

    def _stub(self, target: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(target)
        if stub is None:
            channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
            stub = self._stubs[target] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    async def generate_imported(
            self, request: wpb.ImportGenerateRequest,
            prompt_of: Callable[[wpb.WorkerGenerateRequest], ProcessedPrompt],
            time_left_s: float | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Reserve (waiting for pages up to `time_left_s`, the call's deadline, and the transfer
        timeout), pull from the prefill worker, verify, import, decode; see the module doc."""
        self._require("decode", "both")
        wreq = request.request
        rid, tenant = wreq.request_id, wreq.tenant or "default"
        if not request.prefill_target:
            raise InvalidArgument("no prefill worker named", field="prefill_target")
        prompt = await asyncio.to_thread(prompt_of, wreq)  # processed once, there
        params = wire.sampling_params(wreq.sampling)
        if params.n != 1:  # one KV transfer per request: candidates would need n
            raise InvalidArgument("n > 1 is not served by prefill/decode pools; serve it from "
                                  "a colocated pool", field="n")
        timeout_s = request.transfer_timeout_s or DEFAULT_TRANSFER_TIMEOUT_S
        imp = await self.page_wait.reserve(lambda: KVImport.reserve(
            self.engine, rid, prompt, params, tenant, counters=self.imported,
            deadline_s=timeout_s), timeout_s, time_left_s)
        self.pending_imports += 1
        cause = "cancelled"
        call = None
        prefill_cached = 0
        ring = None
        try:
            budget = min(request.max_frame_bytes or DEFAULT_FRAME_BYTES, MAX_FRAME_BYTES)
            if self.transport == "auto" and request.prefill_target.startswith("unix:"):
                ring = _ring(budget + RING_SLACK_BYTES)  # one host
            call = self._stub(request.prefill_target).Prefill(
                wpb.PrefillRequest(request_id=rid, tenant=tenant,
                                   token_ids=wpb.TokenIds(ids=prompt.token_ids),
                                   sampling=wreq.sampling,
                                   first_page=imp.first_page,
                                   max_frame_bytes=request.max_frame_bytes,
                                   shm_ring=ring.name if ring is not None else ""),
                timeout=timeout_s)
            try:
                async for msg in call:
                    if msg.HasField("frame") or msg.HasField("shm_frame"):
                        data = await self._frame_bytes(msg, ring, imp)
                        await self.llm.call(lambda d=data: imp.accept(d))
                        continue
                    if msg.out.HasField("chunk") and msg.out.chunk.HasField("usage"):
                        prefill_cached = msg.out.chunk.usage.cached_tokens
                    yield msg.out
                    if msg.out.HasField("final"):
                        return  # the first token ended the request
            except grpc.aio.AioRpcError as e:
                cause, err = _sender_failure(e)
                if cause == "deadline":
                    with contextlib.suppress(TransferDeadlineExceeded):
                        await self.llm.call(imp.check_deadline)
                raise err from None
            async for out in self.llm.stream(rid, imp.commit):
                if out.error is not None:
                    raise out.error
                if out.finished and out.outputs[0].finish_reason == "abort":
                    raise RequestCancelled("the request was aborted", request_id=rid)
                chunk = wire.chunk_response(out, logprobs=self._logprobs(out, params))
                if chunk is not None:
                    yield chunk
                if out.finished:
                    final = wire.final_response([out], self.served)
                    usage = final.final.usage
                    usage.cached_tokens = max(usage.cached_tokens, prefill_cached)
                    yield final
        finally:
            self.pending_imports -= 1
            if call is not None:
                call.cancel()  # a no-op once finished; frees the prefill side's pages otherwise
            if ring is not None:
                ring.close()
            self.llm.submit(lambda: imp.abort(cause))  # a no-op once committed or failed


    async def _frame_bytes(self, msg: wpb.PrefillResponse, ring: FrameRing | None,
                           imp: KVImport) -> bytes:
        """A frame as sent: in the stream, or copied out of the shared-memory ring."""
        if msg.HasField("frame"):
            return msg.frame
        try:
            if ring is None:
                raise FrameError("a ring frame, but no ring was offered")
            data = ring.take(msg.shm_frame.slot, msg.shm_frame.nbytes)
        except FrameError as e:
            detail = str(e)
            await self.llm.call(lambda: imp.reject("sequence", detail))
            raise AssertionError("unreachable") from None
        self.imported.shm_frames += 1
        return data


def _ring(slot_bytes: int) -> FrameRing | None:
    """A new ring for one transfer, or None when shared memory is short (use the stream)."""
    try:
        return FrameRing.create(RING_SLOTS, slot_bytes)
    except OSError:
        return None


def _attach(name: str) -> FrameRing | None:
    """The receiver's ring, or None (none offered, or not on this host: use the stream)."""
    if not name:
        return None
    try:
        return FrameRing.attach(name)
    except OSError:
        return None


def _sender_failure(e: grpc.aio.AioRpcError) -> tuple[str, Exception]:
    """(failure cause, the error for this request) for a Prefill call that failed."""
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "deadline", TransferDeadlineExceeded(
            "the KV transfer stalled past its deadline; its pages were freed")
    err = from_rpc_error(e)
    if isinstance(err, WorkerLost):  # the prefill worker, not this one: never WORKER_LOST here
        return "sender", Unavailable("the prefill worker was lost during this request's "
                                     "prefill or KV transfer", retry_after_s=1)
    return "sender", err
