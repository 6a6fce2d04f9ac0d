"""One engine step (nano-vllm's `LLMEngine.step`): schedule, verify the batch's pages, run the
model, sample, decide who finished, and the outputs; and how a request ends (finish, abort)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from runtime.errors import KVIntegrityViolation, TesseraError
from runtime.grammar import GrammarCompiler
from runtime.integrity import Violation
from runtime.model_runner import ModelRunner
from runtime.outputs import CompletionOutput, RequestOutput
from runtime.sampler import Sampler
from runtime.scheduler import Scheduler
from runtime.sequence import Sequence

if TYPE_CHECKING:
    from runtime.engine.build import Tracker

log = logging.getLogger("tessera.engine")


class EngineStep:
    """The engine's step half (a part of `LLMEngine`)."""

    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    grammars: GrammarCompiler
    eos_ids: set[int]
    max_model_len: int
    requests: dict[str, Sequence]
    tracker: Tracker

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        failed: list[RequestOutput] = []
        violations = self.tracker.verify_batch([s.seq for s in batch.scheduled])
        if violations:
            failed = self._abort_violations(violations)
            bad = {id(v.seq) for v in violations}
            batch.scheduled = [s for s in batch.scheduled if id(s.seq) not in bad]
            if batch.is_empty:
                return failed
        try:
            samplers, logits = self.runner.execute(batch)
            states = [s.seq.engine_state for s in samplers]
            sampled = self.sampler(
                logits, [s.seq.params for s in samplers],
                [(s.seq.prompt_token_ids, s.seq.output_token_ids) for s in samplers],
                [st.generator for st in states],
                self.grammars.fill_masks([st.grammar for st in states]))
        except Exception as e:  # a failed step fails its requests, never the engine
            log.exception("step failed; failing its %d requests", len(batch.scheduled))
            err = TesseraError(f"internal error during step: {type(e).__name__}")
            return [o for s in batch.scheduled if (o := self.abort_request(s.seq.request_id, err))]
        finished = []
        for item, token, lp in zip(samplers, sampled.token_ids, sampled.logprobs, strict=True):
            seq = item.seq
            seq.output_token_ids.append(token)
            if lp is not None:
                state = seq.engine_state
                if state.logprobs is None:
                    state.logprobs = []
                state.logprobs.append(lp)
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.finish_reason is not None:
                finished.append(seq)
        self.scheduler.postprocess(batch, finished)
        for seq in finished:
            self.requests.pop(seq.request_id, None)
        return failed + [self._output(item.seq, new_tokens=[token])
                         for item, token in zip(samplers, sampled.token_ids, strict=True)]

    def abort_request(self, request_id: str,
                      error: TesseraError | None = None) -> RequestOutput | None:
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        seq.error = error
        self._finish(seq, "abort" if error is None else "error")
        return self._output(seq)

    def _abort_violations(self, violations: list[Violation]) -> list[RequestOutput]:
        """Fail closed: end each affected sequence before anything reads its pages."""
        outs = []
        for v in violations:
            log.warning("KV integrity violation: request %s page %d expected tag %d found %d (%s)",
                        v.seq.request_id, v.page_id, v.expected_tag, v.found_tag, v.cause)
            err = KVIntegrityViolation(
                f"KV page {v.page_id} no longer matches this request ({v.cause}); "
                f"aborted before reading it", page_id=v.page_id, expected_tag=v.expected_tag,
                found_tag=v.found_tag, cause=v.cause)
            self.scheduler.uncache_pages(v.seq)
            out = self.abort_request(v.seq.request_id, err)
            if out is not None:
                outs.append(out)
        return outs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Whether the token just sampled ends the sequence ("stop", "length"), or None."""
        state = seq.engine_state
        detok = state.detok
        detok.add_token(token)
        p = seq.params
        if state.grammar is not None and not state.grammar.accept(token):
            seq.error = TesseraError(f"constrained decoding failed: {state.grammar.error}")
            return "error"
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if token in self.eos_ids and not p.ignore_eos:
            return "stop"
        if detok.stopped_on is not None:
            seq.stop_reason = detok.stopped_on
            return "stop"
        if state.grammar is not None and state.grammar.is_stopped:
            return "stop"  # the grammar is complete: nothing but EOS could follow
        if len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)

    def hands_over(self, seq: Sequence) -> bool:
        """Whether `seq`, the prefill of a KV transfer (`export_kv`), ended only at its
        one-token cap, so that its decoding goes on in another engine: to its client it has
        not ended, and its text is released as an unfinished request's would be."""
        return (seq.export_kv and seq.finish_reason == "length"
                and seq.num_tokens < self.max_model_len)

    def _output(self, seq: Sequence, new_tokens: list[int] | None = None) -> RequestOutput:
        state = seq.engine_state
        detok = state.detok
        handed_over = self.hands_over(seq)
        finished = seq.is_finished and not handed_over
        delta = detok.flush(finished)
        completion = CompletionOutput(0, detok.text if finished else detok.text[: detok.emitted],
                                      list(seq.output_token_ids),
                                      None if handed_over else seq.finish_reason,
                                      seq.stop_reason, state.logprobs)
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion],
                             seq.is_finished, seq.num_cached_tokens, seq.error, delta,
                             list(new_tokens or []))
