"""One engine step (nano-vllm's `LLMEngine.step`): schedule, verify the batch's pages, run the
model, sample, decide who finished; and how a request ends (finish, abort).

What leaves a step is a delta per request (`EngineCoreOutput`: new token ids, new text); the
asyncio front takes those (`step_core`) and rebuilds RequestOutputs on its consumers' side,
while `step` rebuilds them here for callers on this thread (the offline API, drivers, tests).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from runtime.errors import KVIntegrityViolation, TesseraError
from runtime.grammar import GrammarCompiler
from runtime.integrity import Violation
from runtime.model_runner import ModelRunner
from runtime.outputs import EngineCoreOutput, OutputAccumulator, RequestOutput
from runtime.sampler import INVALID_TOKEN, Sampler
from runtime.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from runtime.sequence import Sequence
from runtime.step_times import EngineTimes

if TYPE_CHECKING:
    from runtime.engine.build import Tracker

log = logging.getLogger("tessera.engine")

Row = tuple[ScheduledSequence, int, "dict[int, float] | None"]  # a sampled row: token, logprobs


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
    times: EngineTimes  # where the steps' time went (runtime/step_times.py)
    # request id -> the outputs `step` and `abort_request` rebuild on this thread
    _accumulators: dict[str, OutputAccumulator]

    def step(self) -> list[RequestOutput]:
        """One step; each scheduled request's output as of it (see `OutputAccumulator`)."""
        return [self._accumulate(seq, core) for seq, core in self._step()]

    def step_core(self) -> list[EngineCoreOutput]:
        """One step; what it added to each scheduled request (and the requests it ended)."""
        return [core for _, core in self._step()]

    def _step(self) -> list[tuple[Sequence, EngineCoreOutput]]:
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        decode_rows = sum(1 for s in batch.scheduled if s.num_tokens == 1)
        prefill_tokens = batch.num_tokens - decode_rows
        failed: list[tuple[Sequence, EngineCoreOutput]] = []
        seqs = [s.seq for s in batch.scheduled]
        # the device tag pass, its flags obeyed on the device and learnt from the sampled
        # tokens, where every sequence samples now (a mid-prompt chunk would not tell us)
        deferred = getattr(self.tracker, "defers", False) and all(
            s.samples for s in batch.scheduled)
        violations = [] if deferred else self.tracker.verify_batch(seqs)
        if deferred:
            self.tracker.launch(seqs)  # type: ignore[union-attr]
        if violations:
            failed = self._abort_violations(violations)
            bad = {id(v.seq) for v in violations}
            batch.scheduled = [s for s in batch.scheduled if id(s.seq) not in bad]
            if batch.is_empty:
                return failed
        compute_started = time.perf_counter()
        try:
            samplers, logits = self.runner.execute(batch)
            states = [s.seq.engine_state for s in samplers]
            valid = (self.tracker.valid_rows([s.seq for s in samplers])  # type: ignore[union-attr]
                     if deferred else None)
            sampled = self.sampler(
                logits, [s.seq.params for s in samplers],
                [(s.seq.prompt_token_ids, s.seq.output_token_ids) for s in samplers],
                [st.generator for st in states],
                self.grammars.fill_masks([st.grammar for st in states]), valid)
        except Exception as e:  # a failed step fails its requests, never the engine
            log.exception("step failed; failing its %d requests", len(batch.scheduled))
            err = TesseraError(f"internal error during step: {type(e).__name__}")
            return [o for s in batch.scheduled if (o := self._abort(s.seq.request_id, err))]
        compute_s = time.perf_counter() - compute_started
        rows = list(zip(samplers, sampled.token_ids, sampled.logprobs, strict=True))
        if deferred and any(token == INVALID_TOKEN for _, token, _ in rows):
            rows, more = self._abort_flagged(batch, rows)
            failed += more
        finished = []
        for item, token, lp in rows:
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
        outs = failed + [(item.seq, self._core_output(item.seq, [token]))
                         for item, token, _ in rows]
        self.times.record_step(decode_rows, prefill_tokens, time.perf_counter() - started,
                               compute_s)
        return outs

    def _abort_flagged(self, batch: SchedulerOutput, rows: list[Row]
                       ) -> tuple[list[Row], list[tuple[Sequence, EngineCoreOutput]]]:
        """The rows that sampled INVALID_TOKEN (the device tag pass failed them: they read
        and wrote no KV) aborted as `_abort_violations` aborts, and taken out of `batch`;
        returns the other rows and the aborted requests' outputs."""
        flagged = [item.seq for item, token, _ in rows if token == INVALID_TOKEN]
        outs = self._abort_violations(self.tracker.explain(flagged))  # type: ignore[union-attr]
        bad = {id(seq) for seq in flagged}
        batch.scheduled = [s for s in batch.scheduled if id(s.seq) not in bad]
        return [r for r in rows if id(r[0].seq) not in bad], outs

    def abort_request(self, request_id: str,
                      error: TesseraError | None = None) -> RequestOutput | None:
        """End a request in flight (`error` None: the caller's abort); its final output, or
        None when it was not in flight."""
        ended = self._abort(request_id, error)
        return None if ended is None else self._accumulate(*ended)

    def abort_request_core(self, request_id: str,
                           error: TesseraError | None = None) -> EngineCoreOutput | None:
        """`abort_request`, with its last delta for a consumer that accumulates its own."""
        ended = self._abort(request_id, error)
        self._accumulators.pop(request_id, None)
        return None if ended is None else ended[1]

    def _abort(self, request_id: str,
               error: TesseraError | None) -> tuple[Sequence, EngineCoreOutput] | None:
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        seq.error = error
        self._finish(seq, "abort" if error is None else "error")
        return seq, self._core_output(seq, [])

    def _abort_violations(self, violations: list[Violation],
                          ) -> list[tuple[Sequence, EngineCoreOutput]]:
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
            out = self._abort(v.seq.request_id, err)
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

    def _core_output(self, seq: Sequence, new_tokens: list[int]) -> EngineCoreOutput:
        """What this step added to `seq`: `new_tokens`, the text now safe to release, their
        logprobs, and how it ended, if it did."""
        state = seq.engine_state
        handed_over = self.hands_over(seq)
        text = state.detok.flush(seq.is_finished and not handed_over)
        logprobs = (None if state.logprobs is None or not new_tokens
                    else state.logprobs[-len(new_tokens):])
        return EngineCoreOutput(seq.request_id, new_tokens, text, logprobs, seq.is_finished,
                                None if handed_over else seq.finish_reason, seq.stop_reason,
                                seq.num_cached_tokens, seq.error)

    def accumulator_for(self, request_id: str) -> OutputAccumulator:
        """An accumulator for a request just admitted (or committed from a KV import), holding
        what it has so far: its consumer adds every later delta to it."""
        return _accumulator_of(self.requests[request_id])

    def _accumulate(self, seq: Sequence, core: EngineCoreOutput) -> RequestOutput:
        """`core` added to this thread's accumulator of its request (made from the sequence on
        its first output); dropped once the request has ended."""
        acc = self._accumulators.get(core.request_id)
        if acc is None:
            acc = self._accumulators[core.request_id] = _accumulator_of(seq, minus=core)
        if core.finished:
            del self._accumulators[core.request_id]
        return acc.add(core)


def _accumulator_of(seq: Sequence, minus: EngineCoreOutput | None = None) -> OutputAccumulator:
    """What `seq` has produced so far (without `minus`, a delta just taken from it)."""
    state = seq.engine_state
    tokens, text, logprobs = len(seq.output_token_ids), state.detok.emitted, state.logprobs
    if minus is not None:
        tokens -= len(minus.new_token_ids)
        text -= len(minus.new_text)
        if logprobs is not None and minus.new_logprobs is not None:
            logprobs = logprobs[: len(logprobs) - len(minus.new_logprobs)]
    return OutputAccumulator(seq.request_id, seq.prompt, seq.prompt_token_ids,
                             seq.output_token_ids[:tokens], state.detok.text[:text],
                             None if logprobs is None else logprobs[: len(logprobs)])
