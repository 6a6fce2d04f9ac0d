"""Disaggregated generation between two engines in one process: the whole flow, driven inline.

The reference for the worker-process flow (gateway picks the decode side first): reserve on
the decode engine, prefill and sample the first token on the prefill engine, move the frames,
commit, decode. Used by tests and `ops/bench/bench_disagg.py`; frames travel as bytes exactly
as they would over a socket, through an optional sender fault hook.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from runtime.disagg.export import DEFAULT_FRAME_BYTES, FrameFault, KVExport
from runtime.disagg.importer import KVImport
from runtime.disagg.metrics import TransferCounters
from runtime.engine import LLMEngine
from runtime.errors import TesseraError
from runtime.sampling_params import SamplingParams


@dataclass
class LocalResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the output text as the client gets it (stop strings cut)
    finish_reason: str | None = None
    error: TesseraError | None = None
    num_cached_tokens: int = 0
    first_token_s: float = 0.0  # since the start: prefill done, first token sampled
    transfer_s: float = 0.0  # frames exported, verified and committed


@dataclass
class LocalTransfer:
    prefill: LLMEngine
    decode: LLMEngine
    max_frame_bytes: int = DEFAULT_FRAME_BYTES
    exported: TransferCounters = field(default_factory=TransferCounters)
    imported: TransferCounters = field(default_factory=TransferCounters)

    def generate(self, prompts: dict[str, list[int]], params: SamplingParams,
                 tenant: str = "default",
                 faults: dict[str, FrameFault] | None = None) -> dict[str, LocalResult]:
        """Generate every prompt disaggregated. A request whose transfer fails gets its typed
        error and no tokens past the first; the others are untouched."""
        start = time.perf_counter()
        results = {rid: LocalResult() for rid in prompts}
        imports: dict[str, KVImport] = {}
        exports: dict[str, KVExport] = {}
        for rid, ids in prompts.items():
            try:
                imports[rid] = KVImport.reserve(self.decode, rid, ids, params, tenant,
                                                counters=self.imported)
                exports[rid] = KVExport.start(self.prefill, rid, ids, params, tenant,
                                              counters=self.exported)
            except TesseraError as e:
                results[rid].error = e
                if rid in imports:
                    imports.pop(rid).abort()
        while not all(x.prefilled for x in exports.values()):
            for out in self.prefill.step():
                if out.request_id in exports:
                    results[out.request_id].text = out.outputs[0].text
                    results[out.request_id].error = out.error or results[out.request_id].error
        for rid, exp in exports.items():
            res, imp = results[rid], imports[rid]
            res.first_token_s = time.perf_counter() - start
            res.token_ids = list(exp.seq.output_token_ids)
            res.finish_reason = exp.seq.finish_reason
            t0 = time.perf_counter()
            try:
                if res.error is None and exp.needs_transfer:
                    for data in exp.frames(imp.first_page, self.max_frame_bytes,
                                           (faults or {}).get(rid)):
                        imp.accept(data)
                    imp.commit()
                    res.finish_reason = None
                    res.num_cached_tokens = max(exp.seq.num_cached_tokens,
                                                imp.first_page * self.decode.pool.page_size)
            except TesseraError as e:
                res.error = e
            finally:
                imp.abort()  # no-op once committed
                exp.release()
            res.transfer_s = time.perf_counter() - t0
        while self.decode.has_unfinished_requests():
            for out in self.decode.step():
                res = results[out.request_id]
                res.token_ids = list(out.outputs[0].token_ids)
                res.text = out.outputs[0].text
                res.finish_reason = out.outputs[0].finish_reason
                res.error = out.error or res.error
        return results
