"""The decode side of a KV transfer: reserve, verify every frame, convert, publish, or free.

`KVImport.reserve` validates the request as the engine would admit it and takes its pages
before any byte moves: prefix-cache hits the decode engine already holds (same tenant salt;
those pages are not sent again) and fresh pages for the rest, which no sequence maps, so
nothing can read them mid-transfer. `accept` takes frames in order; each is checked (checksum,
sequence number, request id, shape, layer range, logical positions inside the reservation,
no position twice) before its payload is converted to this engine's KV format and written
into the reserved pages. `commit` checks that every (layer, page) arrived and the end frame
counted the frames sent, gives each imported page a new generation tag, records those tags as
the sequence's, and only then hands the sequence to the scheduler as a decode, its first token
already in its detokenizer, grammar, logprobs and seeded generator (as the prefill engine left
them), so it goes on as a colocated engine would. Any failure
frees the whole reservation and raises a typed error: `KV_INTEGRITY_VIOLATION` with cause
`transfer` for frames that cannot be trusted, `DEADLINE_EXCEEDED` for a stalled transfer.
Follows the shape of vLLM's and SGLang's P/D connectors (decode-side pre-allocation, then
pull), with the tag/owner ledger of this engine carried across.
"""

from __future__ import annotations

import time
from typing import NoReturn

import torch

from runtime.disagg import frames as wire
from runtime.disagg.codec import write_payload
from runtime.disagg.metrics import TransferCounters
from runtime.engine import LLMEngine
from runtime.errors import (
    ContextLengthExceeded,
    InvalidArgument,
    KVIntegrityViolation,
    KVPoolExhausted,
    TesseraError,
    TransferDeadlineExceeded,
)
from runtime.formats import KV_FORMATS
from runtime.input_processor import ProcessedPrompt, Prompt
from runtime.kv.pages import PageRef
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence


class KVImport:
    def __init__(self, engine: LLMEngine, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, tenant: str, prompt_text: str | None,
                 counters: TransferCounters, deadline_s: float | None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.tenant = tenant
        self.prompt_text = prompt_text
        self.counters = counters
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self.hits: list[PageRef] = []  # prefix pages this engine already held
        self.reserved: list[PageRef] = []  # one per logical page from first_page on
        self.page_keys: list[bytes] = []
        self.state = "reserved"  # -> receiving -> committed | failed
        self._next_seq = 0
        self._format = ""
        self._first_token = -1
        self._generator: torch.Generator | None = None
        self._first_logprobs: dict[int, float] | None = None
        self._received: list[set[int]] = []  # per layer: logical pages received
        self._page_frames = 0
        self._ended = False
        self._started = 0.0

    # -- reservation --------------------------------------------------------------------------

    @classmethod
    def reserve(cls, engine: LLMEngine, request_id: str, prompt: Prompt,
                params: SamplingParams, tenant: str = "default", *,
                prompt_text: str | None = None, counters: TransferCounters | None = None,
                deadline_s: float | None = None) -> KVImport:
        """Take the pages for the prompt's KV now; raise KVPoolExhausted when they are not free
        (nothing is held then). Run it on the engine's thread."""
        if request_id in engine.requests:
            raise InvalidArgument(f"request id {request_id!r} is already in flight",
                                  field="request_id")
        processed = engine.processor.process(prompt)  # a ProcessedPrompt passes unchecked
        text, ids = processed.text, processed.token_ids
        if len(ids) >= engine.max_model_len:
            raise ContextLengthExceeded(
                f"prompt has {len(ids)} tokens; this model serves at most "
                f"{engine.max_model_len} (prompt and output together)",
                prompt_tokens=len(ids), max_model_len=engine.max_model_len)
        out = cls(engine, request_id, ids, params, tenant,
                  text if prompt_text is None else prompt_text,
                  counters if counters is not None else TransferCounters(), deadline_s)
        out._take_pages()
        return out

    def _take_pages(self) -> None:
        engine, pool, cache = self.engine, self.engine.pool, self.engine.prefix_cache
        num_pages = pool.pages_for_tokens(len(self.prompt_ids))
        ns, shared = engine._shared_prefix_for(self.tenant, self.prompt_ids)
        shared_prefix = (ns, shared) if ns else None
        if cache is not None:
            full = len(self.prompt_ids) // pool.page_size
            self.page_keys = cache.page_keys(self.tenant, self.prompt_ids, full,
                                             shared=shared_prefix)
            self.hits = [pool.share(ref) for ref in cache.lookup(self.page_keys)
                         if pool.is_live(ref)]
        need = num_pages - len(self.hits)
        if need > pool.num_free_pages and cache is not None:
            cache.evict(need - pool.num_free_pages, keep={r.page_id for r in self.hits})
        if not pool.can_allocate(need):
            self._release()
            raise KVPoolExhausted(f"{need} KV pages needed for the import, "
                                  f"{pool.num_free_pages} free", needed_pages=need)
        for i in range(len(self.hits), num_pages):
            self.reserved.append(pool.allocate(ns if ns and i < shared else self.tenant))

    @property
    def first_page(self) -> int:
        """The first logical page the sender must send (those before are held here)."""
        return len(self.hits)

    @property
    def num_pages(self) -> int:
        return len(self.hits) + len(self.reserved)

    # -- frames -------------------------------------------------------------------------------

    def accept(self, data: bytes) -> None:
        """Verify one frame and write its pages (still unreadable). Raises the typed error of
        a failed transfer, after freeing the reservation."""
        if self.state not in ("reserved", "receiving"):
            raise InvalidArgument(f"transfer for {self.request_id!r} is {self.state}",
                                  field="request_id")
        self.check_deadline()
        if self.state == "reserved":
            self.state, self._started = "receiving", time.perf_counter()
        try:
            frame = wire.decode(data)
        except wire.FrameError as e:
            self._fail("checksum" if "checksum" in str(e) else "malformed", str(e))
        if frame.request_id != self.request_id:
            self._fail("malformed", "frame of another request")
        if frame.seq != self._next_seq:
            self._fail("sequence", f"frame {frame.seq} where {self._next_seq} was due")
        self._next_seq += 1
        self.counters.frames += 1
        self.counters.bytes += len(data)
        if frame.kind == "begin":
            self._begin(frame)
        elif frame.kind == "pages":
            self._pages(frame)
        else:
            self._end(frame)

    def _begin(self, frame: wire.Frame) -> None:
        h, spec = frame.header, self.engine.kv_cache.spec
        want = {"num_tokens": len(self.prompt_ids), "page_size": self.engine.pool.page_size,
                "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
                "head_dim": spec.head_dim, "latent": spec.latent, "rope_dim": spec.rope_dim,
                "first_page": self.first_page}
        wrong = [k for k, v in want.items() if h.get(k) != v]
        if wrong or h.get("format") not in KV_FORMATS:
            self._fail("malformed", f"begin frame disagrees on {', '.join(wrong) or 'format'}")
        token = h.get("first_token")
        if not isinstance(token, int) or not 0 <= token < self.engine.model_config.vocab_size:
            self._fail("malformed", "first token out of the vocabulary")
        self._format, self._first_token = h["format"], token
        self._generator = self._begin_generator(h.get("generator_state"))
        self._first_logprobs = self._begin_logprobs(h.get("first_logprobs"), token)
        self._received = [set() for _ in range(spec.num_layers)]

    def _begin_generator(self, state: object) -> torch.Generator | None:
        """The seeded generator as the prefill side left it (None for an unseeded request)."""
        if (state is None) != (self.params.seed is None) or not isinstance(state, bytes | None):
            self._fail("malformed", "generator state does not match the request's seed")
        if state is None:
            return None
        gen = torch.Generator()
        try:
            gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        except (RuntimeError, ValueError):
            self._fail("malformed", "generator state is not a CPU generator's")
        return gen

    def _begin_logprobs(self, pairs: object, token: int) -> dict[int, float] | None:
        """The first token's {token id: logprob} (None when the request asks for none)."""
        if (pairs is None) != (self.params.logprobs is None):
            self._fail("malformed", "first token's logprobs do not match the request")
        if pairs is None:
            return None
        try:
            entry = {int(t): float(lp) for t, lp in pairs}  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            self._fail("malformed", "first token's logprobs are not [id, logprob] pairs")
        if token not in entry:
            self._fail("malformed", "first token's logprobs lack the token")
        return entry

    def _pages(self, frame: wire.Frame) -> None:
        if not self._format or self._ended:
            self._fail("sequence", "pages frame outside begin..end")
        lo, hi = frame.layers
        pages = frame.pages
        if hi > len(self._received) or min(pages) < self.first_page \
                or max(pages) >= self.num_pages:
            self._fail("malformed", "layer range or page position outside the reservation")
        if any(p in self._received[layer] for layer in range(lo, hi) for p in pages):
            self._fail("sequence", "a page position sent twice")
        pool = self.engine.pool
        targets = [self.reserved[p - self.first_page] for p in pages]
        # NOTE: checked before every write: a page freed under the transfer (a use-after-free
        # elsewhere) may already hold another request's KV, which this payload must not touch.
        if not all(pool.is_live(r) for r in targets):
            self._fail("stale", "a reserved page changed hands during the transfer")
        ps, n = pool.page_size, len(self.prompt_ids)
        slots = [ref.page_id * ps + t % ps for p, ref in zip(pages, targets, strict=True)
                 for t in range(p * ps, min((p + 1) * ps, n))]
        try:
            write_payload(self.engine.kv_cache, frame.payload, self._format, (lo, hi),
                          torch.tensor(slots, dtype=torch.long))
        except ValueError as e:
            self._fail("malformed", str(e))
        for layer in range(lo, hi):
            self._received[layer].update(pages)
        self._page_frames += 1

    def _end(self, frame: wire.Frame) -> None:
        if not self._format or frame.header.get("page_frames") != self._page_frames:
            self._fail("sequence", "end frame does not count the frames received")
        self._ended = True

    # -- outcome ------------------------------------------------------------------------------

    def commit(self) -> Sequence:
        """Publish the imported KV: fresh tags, then the sequence joins the scheduler as a
        decode whose first output token is the one the prefill side sampled."""
        if self.state != "receiving" or not self._ended:
            self._fail("incomplete", "commit before the end frame")
        want = set(range(self.first_page, self.num_pages))
        if any(got != want for got in self._received):
            self._fail("incomplete", "some (layer, page) never arrived")
        pool = self.engine.pool
        if not all(pool.is_live(r) for r in self.hits + self.reserved):
            self._fail("stale", "a reserved page changed hands during the transfer")
        self.reserved = [pool.retag(r) for r in self.reserved]
        try:
            # NOTE: the ids `reserve` processed: admitted without a second check.
            seq = self.engine.add_request(
                self.request_id, ProcessedPrompt(self.prompt_ids, self.prompt_text), self.params,
                self.tenant)
        except TesseraError:
            self.abort()
            raise
        refs = self.hits + self.reserved
        seq.page_table, seq.recorded_pages = list(refs), list(refs)
        seq.num_computed_tokens = len(self.prompt_ids)
        seq.num_cached_tokens = len(self.hits) * pool.page_size
        seq.page_keys, seq.num_pages_cached = self.page_keys[: len(self.hits)], len(self.hits)
        self._resume(seq)
        self.state = "committed"
        c = self.counters
        c.transfers += 1
        c.pages += len(self.reserved)
        c.duration_s += time.perf_counter() - self._started
        return seq

    def _resume(self, seq: Sequence) -> None:
        """Put the first token where the prefill engine's own next step would find it: in the
        output, the detokenizer (its released text is what the prefill side streamed), the
        grammar, the logprobs, and the seeded generator past its first draw."""
        state = seq.state
        assert state is not None
        token = self._first_token
        seq.output_token_ids.append(token)
        state.detok.add_token(token)
        state.detok.flush(False)
        if self._generator is not None:
            state.generator = self._generator
        if self._first_logprobs is not None:
            state.logprobs = [self._first_logprobs]
        if state.grammar is not None and not state.grammar.accept(token):
            err = TesseraError(f"constrained decoding failed: {state.grammar.error}")
            self.engine.abort_request(self.request_id, err)
            self.state = "failed"
            raise err

    def check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline \
                and self.state in ("reserved", "receiving"):
            self._release()
            self.state = "failed"
            self.counters.failures["deadline"] += 1
            raise TransferDeadlineExceeded(
                f"KV transfer for {self.request_id!r} stalled past its deadline; its pages "
                f"were freed", request_id=self.request_id)

    def abort(self, cause: str = "cancelled") -> None:
        """Give up (client left, sender died): free the reservation. Idempotent."""
        if self.state in ("reserved", "receiving"):
            self._release()
            self.state = "failed"
            self.counters.failures[cause] += 1

    def reject(self, cause: str, detail: str) -> NoReturn:
        """Fail the transfer as an untrusted frame does (a frame that could not be read off
        its transport): pages freed, KV_INTEGRITY_VIOLATION raised."""
        self._fail(cause, detail)

    def _fail(self, cause: str, detail: str) -> NoReturn:
        self._release()
        self.state = "failed"
        self.counters.failures[cause] += 1
        raise KVIntegrityViolation(
            f"KV transfer for this request failed verification ({cause}: {detail}); aborted "
            f"before any imported page was readable", cause="transfer", detail=cause)

    def _release(self) -> None:
        pool = self.engine.pool
        for ref in reversed(self.hits + self.reserved):
            if pool.is_live(ref):
                pool.release(ref)
        self.hits, self.reserved = [], []
