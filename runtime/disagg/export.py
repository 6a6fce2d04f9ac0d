"""The prefill side of a KV transfer: compute the prompt, sample the first token, keep the pages
until their frames are out, then release them.

`KVExport.start` admits the request to the prefill engine with one output token; the engine's
ordinary steps prefill it (its own prefix cache included) and sample the first token, and the
scheduler keeps the pages of a sequence marked `export_kv` when it finishes for length (to its
client it has not finished: `LLMEngine.hands_over`). The begin frame carries what else the
decode side must continue from: the seeded generator's state and the first token's logprobs.
`frames` then checks the pages' tags (fail-closed, the engine's own integrity tracker), and
yields the encoded frames; `release` gives the pages back, whatever happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from runtime.disagg import frames as wire
from runtime.disagg.codec import gather_payload, page_token_bytes_per_layer
from runtime.disagg.metrics import TransferCounters
from runtime.engine import LLMEngine
from runtime.errors import InvalidArgument, KVIntegrityViolation
from runtime.input_processor import Prompt
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence

DEFAULT_FRAME_BYTES = 1 << 20

# A sender-side fault hook (tests, drills): (frame sequence number, its bytes) -> bytes sent.
FrameFault = Callable[[int, bytes], bytes]


class KVExport:
    def __init__(self, engine: LLMEngine, seq: Sequence, max_tokens: int,
                 counters: TransferCounters | None = None) -> None:
        self.engine = engine
        self.seq = seq
        self.max_tokens = max_tokens  # the client's limit, first token included
        self.counters = counters if counters is not None else TransferCounters()
        self._released = False

    @classmethod
    def start(cls, engine: LLMEngine, request_id: str, prompt: Prompt,
              params: SamplingParams, tenant: str = "default", *,
              prompt_text: str | None = None,
              counters: TransferCounters | None = None) -> KVExport:
        """Admit the request for its prefill and first token only (validated in full, as the
        colocated engine would validate it)."""
        seq = engine.add_request(request_id, prompt, params, tenant, prompt_text=prompt_text)
        out = cls(engine, seq, seq.max_tokens, counters)
        seq.export_kv = seq.max_tokens > 1  # a limit of one token is a colocated request's
        seq.max_tokens = 1
        return out

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def prefilled(self) -> bool:
        """The prompt is computed and the first token sampled (or the request ended)."""
        return self.seq.is_finished

    @property
    def first_token(self) -> int:
        return self.seq.output_token_ids[0]

    @property
    def needs_transfer(self) -> bool:
        """Whether decoding continues elsewhere: not when the first token already ended it."""
        return (self.seq.is_finished and self.engine.hands_over(self.seq)
                and bool(self.seq.recorded_pages) and not self._released)

    def frames(self, first_page: int = 0, max_frame_bytes: int = DEFAULT_FRAME_BYTES,
               fault: FrameFault | None = None) -> Iterator[bytes]:
        """The transfer's encoded frames: begin, the pages from logical page `first_page` on
        (the decode side holds those before), end. Run it on the engine's thread."""
        if not self.needs_transfer:
            raise InvalidArgument(f"request {self.request_id!r} has no KV to transfer",
                                  field="request_id")
        seq, engine = self.seq, self.engine
        spec, ps = engine.kv_cache.spec, engine.pool.page_size
        num_tokens = seq.num_computed_tokens
        num_pages = engine.pool.pages_for_tokens(num_tokens)
        if not 0 <= first_page <= num_pages:
            raise InvalidArgument(f"first_page {first_page} outside [0, {num_pages}]",
                                  field="first_page")
        self._verify()
        start = time.perf_counter()
        fmt = spec.format.name
        rid = seq.request_id
        yield self._emit(wire.begin_frame(
            rid, num_tokens=num_tokens, page_size=ps, kv_format=fmt, num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, latent=spec.latent,
            rope_dim=spec.rope_dim, first_token=self.first_token, first_page=first_page,
            **handover_state(seq)), fault)
        seq_no = 1
        page_layer_bytes = page_token_bytes_per_layer(spec) * ps
        for layers, pages in _chunks(spec.num_layers, first_page, num_pages, page_layer_bytes,
                                     max_frame_bytes):
            self._verify()  # between frames the engine may have run: pages must still be ours
            slots = [seq.page_table[t // ps].page_id * ps + t % ps
                     for p in pages for t in range(p * ps, min((p + 1) * ps, num_tokens))]
            payload = gather_payload(engine.kv_cache, layers,
                                     torch.tensor(slots, dtype=torch.long))
            yield self._emit(wire.pages_frame(rid, seq_no, layers, pages, payload), fault)
            seq_no += 1
        yield self._emit(wire.end_frame(rid, seq_no, seq_no - 1), fault)
        c = self.counters
        c.transfers += 1
        c.pages += num_pages - first_page
        c.duration_s += time.perf_counter() - start

    def _emit(self, frame: wire.Frame, fault: FrameFault | None) -> bytes:
        data = wire.encode(frame)
        if fault is not None:
            data = fault(frame.seq, data)
        self.counters.frames += 1
        self.counters.bytes += len(data)
        return data

    def _verify(self) -> None:
        if self._released:
            raise InvalidArgument(f"export of {self.request_id!r} was released",
                                  field="request_id")
        violations = self.engine.tracker.verify_batch([self.seq])
        if violations:
            v = violations[0]
            self.counters.failures[v.cause] += 1
            self.release()
            raise KVIntegrityViolation(
                f"KV page {v.page_id} changed under its export ({v.cause}); nothing more sent",
                page_id=v.page_id, expected_tag=v.expected_tag, found_tag=v.found_tag,
                cause=v.cause)

    def release(self) -> None:
        """Give the pages back (idempotent). Prefix-cache holds on full pages stay."""
        if self._released:
            return
        self._released = True
        self.engine.scheduler.free_pages(self.seq)
        if self.engine.requests.get(self.request_id) is self.seq:  # released before prefill ran
            self.engine.abort_request(self.request_id)


def handover_state(seq: Sequence) -> dict[str, object]:
    """What the decode side needs beyond the KV to go on exactly as this engine would have:
    the seeded generator's state after the first draw (CPU `torch.Generator.get_state()`
    bytes, None when unseeded) and the first token's logprobs ([[token id, logprob], ...],
    None when not asked for)."""
    state = seq.state
    assert state is not None
    gen = None if state.generator is None else state.generator.get_state().numpy().tobytes()
    lps = None if state.logprobs is None else [[t, lp] for t, lp in state.logprobs[0].items()]
    return {"generator_state": gen, "first_logprobs": lps}


def _chunks(num_layers: int, first_page: int, num_pages: int, page_layer_bytes: int,
            budget: int) -> Iterator[tuple[tuple[int, int], list[int]]]:
    """(layer range, pages) per frame: as many pages and layers as fit in `budget` bytes,
    never less than one page of one layer."""
    pages = list(range(first_page, num_pages))
    if not pages:
        return
    per_frame_pages = max(1, min(len(pages), budget // page_layer_bytes))
    per_frame_layers = max(1, budget // (page_layer_bytes * per_frame_pages))
    for p0 in range(0, len(pages), per_frame_pages):
        for lo in range(0, num_layers, per_frame_layers):
            yield (lo, min(num_layers, lo + per_frame_layers)), pages[p0 : p0 + per_frame_pages]
