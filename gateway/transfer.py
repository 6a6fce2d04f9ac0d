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
memory. Only after the end frame and every (layer, page) are verified does the import commit:
fresh tags, then the request decodes. Any failure frees both sides' pages and ends this
request only, typed: KV_INTEGRITY_VIOLATION (cause `transfer`) for a frame that fails
verification, DEADLINE_EXCEEDED for a transfer past its deadline, UNAVAILABLE when the
prefill worker is lost, CANCELLED when the client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import grpc

from gateway import wire
from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import worker_pb2 as wpb
from gateway._proto.tessera.v1 import worker_pb2_grpc
from gateway.errors import DeadlineExceeded, Unavailable, WorkerLost, from_rpc_error
from runtime.async_engine import AsyncLLM
from runtime.disagg.export import DEFAULT_FRAME_BYTES, KVExport
from runtime.disagg.importer import KVImport
from runtime.disagg.metrics import TransferCounters
from runtime.errors import (
    InvalidArgument,
    KVPoolExhausted,
    RequestCancelled,
    TransferDeadlineExceeded,
)

ROLES = ("both", "prefill", "decode")
DEFAULT_TRANSFER_TIMEOUT_S = 60.0
MAX_FRAME_BYTES = 8 << 20  # a frame's byte budget, whatever the caller asks
RESERVE_POLL_S = 0.02  # how often a request waiting for pages looks at the engine's snapshot
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
                             failures=dict(c.failures), pending=pending, waiting=waiting)


class TransferService:
    """Both halves of a transfer for one worker; the WorkerServicer delegates to it."""

    def __init__(self, llm: AsyncLLM, served: wire.ServedInfo, role: str = "both",
                 faults: dict[str, str] | None = None) -> None:
        if role not in ROLES:
            raise InvalidArgument(f"unknown worker role {role!r}", field="role")
        self.llm = llm
        self.engine = llm.engine
        self.served = served
        self.role = role
        # tenant -> "corrupt" | "stall" | "hold" (drills only, on the prefill side)
        self.faults = dict(faults or {})
        self.exported = TransferCounters()
        self.imported = TransferCounters()
        self.pending_exports = 0
        self.pending_imports = 0
        self._waiting: deque[object] = deque()  # imports waiting for pages, oldest first
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}

    @property
    def waiting_imports(self) -> int:
        """Imports waiting for free pages now (the decode side's queue depth)."""
        return len(self._waiting)

    def _require(self, *roles: str) -> None:
        if self.role not in roles:
            raise InvalidArgument(f"this worker's role is {self.role!r}", field="role")

    # -- prefill side ---------------------------------------------------------------------

    async def prefill(self, request: wpb.PrefillRequest) -> AsyncIterator[wpb.PrefillResponse]:
        """Prefill, the first token's chunk, then the KV frames; pages freed however it ends."""
        self._require("prefill", "both")
        rid, tenant = request.request_id, request.tenant or "default"
        params = wire.sampling_params(request.sampling)
        ids = list(request.token_ids.ids)
        budget = min(request.max_frame_bytes or DEFAULT_FRAME_BYTES, MAX_FRAME_BYTES)
        held: list[KVExport] = []

        def admit() -> None:
            held.append(KVExport.start(self.engine, rid, ids, params, tenant,
                                       counters=self.exported))

        fault = self.faults.get(tenant)
        self.pending_exports += 1
        try:
            async for out in self.llm.stream(rid, admit):
                if out.error is not None:
                    raise out.error
                if out.finished and out.outputs[0].finish_reason == "abort":
                    raise RequestCancelled("the request was aborted", request_id=rid)
                if fault == "hold":  # prompt computed, first token not out: both sides hold
                    await asyncio.Event().wait()  # pages until the call ends
                chunk = wire.chunk_response(out, first=True, served=self.served)
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
            while (data := await self.llm.call(lambda: next(frames, None))) is not None:
                yield wpb.PrefillResponse(frame=data)
        finally:
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
            prompt_of: Callable[[wpb.WorkerGenerateRequest], str | list[int]],
            time_left_s: float | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Reserve (waiting for pages up to `time_left_s`, the call's deadline, and the transfer
        timeout), pull from the prefill worker, verify, import, decode; see the module doc."""
        self._require("decode", "both")
        wreq = request.request
        rid, tenant = wreq.request_id, wreq.tenant or "default"
        if not request.prefill_target:
            raise InvalidArgument("no prefill worker named", field="prefill_target")
        prompt = await asyncio.to_thread(prompt_of, wreq)
        text, ids = await asyncio.to_thread(self.engine.tokenize_prompt, prompt)
        params = wire.sampling_params(wreq.sampling)
        if params.n != 1 or params.logprobs is not None:
            raise InvalidArgument("n > 1 and logprobs are not served by prefill/decode pools "
                                  "yet", field="n" if params.n != 1 else "logprobs")
        timeout_s = request.transfer_timeout_s or DEFAULT_TRANSFER_TIMEOUT_S
        imp = await self._reserve_queued(lambda: KVImport.reserve(
            self.engine, rid, ids, params, tenant, prompt_text=text, counters=self.imported,
            deadline_s=timeout_s), timeout_s, time_left_s)
        self.pending_imports += 1
        cause = "cancelled"
        call = None
        prefill_cached = 0
        try:
            call = self._stub(request.prefill_target).Prefill(
                wpb.PrefillRequest(request_id=rid, tenant=tenant,
                                   token_ids=wpb.TokenIds(ids=ids), sampling=wreq.sampling,
                                   first_page=imp.first_page,
                                   max_frame_bytes=request.max_frame_bytes),
                timeout=timeout_s)
            try:
                async for msg in call:
                    if msg.HasField("frame"):
                        await self.llm.call(lambda d=msg.frame: imp.accept(d))
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
                chunk = wire.chunk_response(out)
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
            self.llm.submit(lambda: imp.abort(cause))  # a no-op once committed or failed


    async def _reserve_queued(self, reserve: Callable[[], KVImport], timeout_s: float,
                              time_left_s: float | None) -> KVImport:
        """The reservation, first come first served: while the pool lacks the pages, wait
        until the caller's deadline (then DEADLINE_EXCEEDED), or for a caller without one
        `timeout_s` (then OVERLOADED, retryable). Only the oldest waiter tries, and only once
        the engine's last snapshot shows room, so a large prompt is not starved by smaller
        ones behind it."""
        started = time.monotonic()
        bound_s = timeout_s if time_left_s is None else time_left_s
        ticket = object()
        self._waiting.append(ticket)
        needed = 0
        refused = KVPoolExhausted("no KV pages free for this request's import")
        try:
            while True:
                if self._waiting[0] is ticket and self._room() >= needed:
                    try:
                        return await self._reserve(reserve)
                    except KVPoolExhausted as e:
                        needed = int(e.metadata.get("needed_pages", 1))
                        refused = e
                if time.monotonic() - started >= bound_s:
                    if time_left_s is not None:
                        raise DeadlineExceeded("the deadline passed while this request waited "
                                               "for free KV pages on the decode side")
                    refused.metadata["retry_after_s"] = "1"
                    raise refused
                await asyncio.sleep(RESERVE_POLL_S)
        finally:
            self._waiting.remove(ticket)

    def _room(self) -> int:
        """Pages a reservation could take now, as of the engine's last published pass."""
        stats = self.llm.snapshot.stats
        return stats.num_free_pages + stats.num_evictable_pages

    async def _reserve(self, reserve: Callable[[], KVImport]) -> KVImport:
        """The reservation, made on the engine thread. NOTE: a caller cancelled while it is
        being made must not leak it: the call runs on, shielded, and what it took is freed."""
        fut = asyncio.ensure_future(self.llm.call(reserve))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            def free(f: asyncio.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    self.llm.submit(f.result().abort)
            fut.add_done_callback(free)
            raise


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
