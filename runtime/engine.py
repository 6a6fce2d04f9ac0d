"""The engine: admits requests, runs scheduler -> model runner -> sampler steps, emits outputs."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from runtime.attention import make_backend
from runtime.config import EngineConfig, ModelConfig
from runtime.detokenizer import IncrementalDetokenizer
from runtime.distributed import TensorParallel, TensorParallelIntegrityTracker
from runtime.errors import (
    ContextLengthExceeded,
    InvalidArgument,
    KVIntegrityViolation,
    TenantQuotaExceeded,
    TesseraError,
)
from runtime.grammar import GrammarCompiler
from runtime.heap import release_free_heap
from runtime.integrity import Violation
from runtime.kv import smoothing
from runtime.kv.budget import auto_kv_cache_bytes
from runtime.kv.cache import KVCache, KVCacheSpec
from runtime.kv.pages import PagePool
from runtime.kv.prefix import PrefixCache
from runtime.loader import Checkpoint, open_checkpoint
from runtime.loader.weight_layout import use_column_major_weights
from runtime.model_runner import ModelRunner
from runtime.models import model_class
from runtime.models.meta_init import meta_without_init
from runtime.outputs import CompletionOutput, RequestOutput
from runtime.progress import progress
from runtime.request_state import RequestState
from runtime.sampler import Sampler
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler, SchedulerConfig
from runtime.sequence import Sequence
from runtime.serving_formats import ServingFormats
from runtime.threads import apply_num_threads
from runtime.tokenizer import Tokenizer

log = logging.getLogger("tessera.engine")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass(frozen=True)
class EngineStats:
    num_pages: int
    num_free_pages: int
    page_size: int
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_enabled: bool = False
    num_cached_pages: int = 0  # pages the prefix cache holds
    num_evictable_pages: int = 0  # of those, held by the cache alone


class LLMEngine:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig) -> None:
        self.config = config
        self.checkpoint = checkpoint
        self.model_config: ModelConfig = checkpoint.config
        self.tokenizer: Tokenizer = checkpoint.tokenizer
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.num_threads = (apply_num_threads(config.num_threads) if self.device.type == "cpu"
                            else torch.get_num_threads())
        self.formats = ServingFormats.resolve(
            str(self.dtype).removeprefix("torch."), prefill_weights=config.prefill_weights,
            decode_weights=config.decode_weights, kv_cache_dtype=config.kv_cache_dtype,
            prefill_kv_cache_dtype=config.prefill_kv_cache_dtype,
            group_size=config.weight_group_size, symmetric=config.weight_symmetric,
            checkpoint_format=checkpoint.quantization)
        self.tp = self._join_tensor_parallel()
        self.attention = make_backend(config.attention_backend, self.device)
        self.prefill_model, self.decode_model = self._build_models()
        self.checkpoint.release_file_pages()  # the model holds its own copies now
        release_free_heap()  # the load's transient buffers, back to the OS before serving
        # NOTE: colocated, KV is written in the decode phase's format whoever writes it.
        spec = KVCacheSpec.for_model(self.model_config, config.page_size, self.formats.kv)
        if self.tp is None:
            self.kv_cache = KVCache.within(spec, config.kv_cache_bytes, self.device)
        else:  # this rank's heads; the same page count on every rank
            budget = (auto_kv_cache_bytes() if config.kv_cache_bytes is None
                      else config.kv_cache_bytes)
            spec, tp_pages = self.tp.shard_kv_spec(spec, budget)
            if tp_pages < 1:
                raise InvalidArgument(f"kv_cache_bytes={budget} holds no page of "
                                      f"{spec.bytes_per_page} bytes", field="kv_cache_bytes")
            self.kv_cache = KVCache(spec, tp_pages, self.device)
            self.kv_cache.budget_bytes = budget
        if smoothing.SMOOTH_FP8_KEYS and spec.quantized and not spec.latent and self.tp is None:
            self.kv_cache.key_smoothing = smoothing.calibrate_key_smoothing(
                self.prefill_model, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                smoothing.calibration_windows(
                    lambda text: self.tokenizer.encode(text, add_special_tokens=False)),
                self.device, self.attention)
        num_pages, self.kv_cache_budget_bytes = self.kv_cache.num_pages, self.kv_cache.budget_bytes
        self.pool = PagePool(num_pages, config.page_size)
        self.max_model_len = min(self.model_config.max_position_embeddings,
                                 num_pages * config.page_size,
                                 config.max_model_len or 1 << 62)
        self.prefix_cache = PrefixCache(self.pool) if config.enable_prefix_caching else None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            tenant_page_quota=config.tenant_page_quota), self.pool,
            self.prefix_cache)
        self.runner = ModelRunner(self.prefill_model, self.decode_model, self.kv_cache,
                                  self.device, self.attention)
        self.sampler = Sampler(config.seed, self.model_config.eos_token_ids)
        self.tracker = self.attention.integrity_tracker(config.integrity, self.pool)
        if self.tp is not None:
            self.tracker = TensorParallelIntegrityTracker(self.tracker, self.tp)
        self.requests: dict[str, Sequence] = {}
        # namespace -> (prefix token ids, tenants allowed to share it)
        self.shared_prefixes: dict[str, tuple[list[int], frozenset[str]]] = {}
        self.eos_ids = set(self.model_config.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                        sorted(self.eos_ids))
        log.info("engine ready: %s, %d pages of %d tokens: %d tokens of %s KV at %d bytes each; "
                 "prefill weights %s, decode weights %s", checkpoint.revision, num_pages,
                 config.page_size, self.kv_capacity_tokens, self.formats.kv.name,
                 spec.bytes_per_token, self.formats.prefill.weights.label,
                 self.formats.decode.weights.label)

    @classmethod
    def from_path(cls, model: str | None, config: EngineConfig) -> LLMEngine:
        return cls(open_checkpoint(model), config)

    def _build_models(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """The prefill and decode models: one object when both phases serve the same weights,
        else two sharing everything but the linear layers (both resident, both counted)."""
        with meta_without_init():
            model = model_class(self.model_config)(self.model_config)
        from runtime.loader.gguf_blocks import load_gguf_as_stored, serves_as_stored

        # NOTE: tensor-parallel ranks shard dense weights: blocks are served on one rank only.
        if self.tp is None and serves_as_stored(self.config.gguf_weights, self.checkpoint,
                                                self.formats, self.dtype, self.device):
            load_gguf_as_stored(model, self.checkpoint, self.dtype,  # type: ignore[arg-type]
                                self.config.gguf_activations, self.config.mapped_weights)
            base = model.to(self.device).eval()
            return base, base
        stored = self.checkpoint.quantization
        tensors = progress(self.checkpoint.tensors(), "load weights", unit="tensors")
        model.load_weights(tensors, self.dtype, quantization=stored)
        if self.tp is not None:
            from runtime.models.tensor_parallel import shard_model

            shard_model(model, self.tp)
        base = model.to(self.device).eval()
        if stored is not None:
            return _lay_out(base), base  # served as stored (ServingFormats refuses the rest)
        from runtime.quant.convert import convert_model  # returns `base` for its own dtype

        prefill = convert_model(base, self.formats.prefill.weights)
        if self.formats.shares_weights:
            return _lay_out(prefill), prefill
        decode = convert_model(base, self.formats.decode.weights)
        return _lay_out(prefill), _lay_out(decode)

    def _join_tensor_parallel(self) -> TensorParallel | None:
        """This rank's place in the launcher's process group, or None for one process."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return None
        stored = self.checkpoint.quantization
        quantized = [p.weights.label for p in (self.formats.prefill, self.formats.decode)
                     if p.weights.name in ("fp8", "int4")]
        if stored is not None or quantized:
            raise InvalidArgument("tensor parallelism serves float weights only for now, not "
                                  f"{stored.label if stored is not None else quantized[0]}",
                                  field="tensor_parallel_size")
        return TensorParallel.join(size)

    @property
    def model(self) -> torch.nn.Module:
        """The prefill model (the decode model shares all but its linear layers with it)."""
        return self.prefill_model

    def release_idle_memory(self) -> None:
        """Drops what a busy engine caches in its modules (the bf16 weight copies of
        `--gguf-activations bf16`); they are rebuilt by the next step that needs them. For an
        idle engine only: a step must not be running."""
        for model in {id(m): m for m in (self.prefill_model, self.decode_model)}.values():
            for module in model.modules():
                release = getattr(module, "release_cache", None)
                if callable(release):
                    release()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.num_pages * self.pool.page_size

    def stats(self) -> EngineStats:
        cache = self.prefix_cache
        return EngineStats(self.pool.num_pages, self.pool.num_free_pages, self.pool.page_size,
                           self.kv_capacity_tokens, self.kv_cache.spec.bytes_per_token,
                           len(self.scheduler.running), len(self.scheduler.waiting),
                           self.scheduler.num_preemptions, cache is not None,
                           0 if cache is None else len(cache),
                           0 if cache is None else cache.num_evictable)

    # -- requests ---------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt is empty", field="prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
                   for t in ids):
                raise InvalidArgument(f"prompt token ids must be integers in [0, {vocab})",
                                      field="prompt")
            return None, ids
        raise InvalidArgument(f"prompt must be a string or a list of token ids, "
                              f"got {type(prompt).__name__}", field="prompt")

    def declare_shared_prefix(self, namespace: str, prefix: str | list[int],
                              tenants: list[str]) -> int:
        """Operator-only: let these tenants share the KV of a common prompt prefix (e.g. a
        system prompt). Returns the number of tokens shared (whole pages only)."""
        if not namespace or namespace in tenants:
            raise InvalidArgument("a shared namespace needs its own name, not a tenant's",
                                  field="namespace")
        _, ids = self.tokenize_prompt(prefix)
        self.shared_prefixes[namespace] = (ids, frozenset(tenants))
        return len(ids) // self.pool.page_size * self.pool.page_size

    def _shared_prefix_for(self, tenant: str, ids: list[int]) -> tuple[str | None, int]:
        for ns, (prefix, tenants) in self.shared_prefixes.items():
            if tenant in tenants and ids[: len(prefix)] == prefix:
                return ns, len(prefix) // self.pool.page_size
        return None, 0

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    tenant: str = "default", *, prompt_text: str | None = None) -> Sequence:
        """Admit one request. `prompt` is text or token ids; token ids tokenized elsewhere
        (`tokenize_prompt`, off the engine thread) may bring their text as `prompt_text`."""
        if not isinstance(params, SamplingParams):
            raise InvalidArgument("params must be a SamplingParams", field="params")
        if params.n != 1:  # one sequence per request: runtime.candidates fans n out
            raise InvalidArgument("add_request takes n = 1; fan candidates out with "
                                  "runtime.candidates", field="n")
        if request_id in self.requests:
            raise InvalidArgument(f"request id {request_id!r} is already in flight",
                                  field="request_id")
        text, ids = self.tokenize_prompt(prompt)
        text = text if prompt_text is None else prompt_text
        if not ids:
            raise InvalidArgument("prompt is empty after tokenization", field="prompt")
        if len(ids) >= self.max_model_len:
            raise ContextLengthExceeded(
                f"prompt has {len(ids)} tokens; this model serves at most {self.max_model_len} "
                f"(prompt and output together)", prompt_tokens=len(ids),
                max_model_len=self.max_model_len)
        max_tokens = self._resolve_max_tokens(len(ids), params.max_tokens, tenant)
        so = params.structured_output
        grammar = None if so is None else self.grammars.matcher(so)
        seq = Sequence(request_id, ids, params, tenant=tenant, prompt=text, max_tokens=max_tokens)
        seq.shared_namespace, seq.shared_pages = self._shared_prefix_for(tenant, ids)
        seq.state = RequestState(
            IncrementalDetokenizer(self.tokenizer, ids, params.stop,
                                   params.include_stop_str_in_output, params.skip_special_tokens,
                                   params.min_tokens),
            None if params.seed is None else torch.Generator().manual_seed(params.seed),
            grammar=grammar)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _resolve_max_tokens(self, prompt_tokens: int, asked: int | None, tenant: str) -> int:
        """The output limit: what was asked, refused past the context or the tenant's KV quota;
        when unset, all that both leave after the prompt."""
        quota_tokens = self.scheduler.quota_pages * self.pool.page_size
        if asked is None:
            room = min(self.max_model_len, quota_tokens) - prompt_tokens
            if room >= 1:
                return room
            asked = 1  # the quota holds not even the prompt and one token: refused below
        elif prompt_tokens + asked > self.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_tokens + asked} tokens ({prompt_tokens} in the messages, "
                f"{asked} in the completion). Please reduce the length of the messages or "
                f"completion.", field="max_tokens", prompt_tokens=prompt_tokens,
                max_tokens=asked, max_model_len=self.max_model_len)
        longest = prompt_tokens + asked
        if self.pool.pages_for_tokens(longest) > self.scheduler.quota_pages:
            raise TenantQuotaExceeded(
                f"this request may need {longest} tokens of KV, more than tenant {tenant!r} may "
                f"hold ({quota_tokens} tokens)", tenant=tenant,
                quota_pages=self.scheduler.quota_pages)
        return asked

    def prompt_logits(self, token_ids: list[int], tenant: str = "default") -> torch.Tensor:
        """Teacher-forced next-token logits at every prompt position, float32 [n, vocab] (row
        i predicts token i + 1), computed by the prefill path over the configured KV format.
        Runs on its own: call it only when no other request is in flight."""
        if self.requests:
            raise InvalidArgument("prompt_logits needs an idle engine", field="token_ids")
        rid = f"score-{len(token_ids)}-{id(token_ids)}"
        seq = self.add_request(rid, list(token_ids), SamplingParams(max_tokens=1), tenant)
        seq.reuse_prefix = False
        sink: list[torch.Tensor] = []
        _state(seq).prompt_logits = sink
        try:
            while rid in self.requests:
                for out in self.step():
                    if out.request_id == rid and out.error is not None:
                        raise out.error
        finally:
            self.abort_request(rid)
        logits = torch.cat(sink)
        assert logits.shape[0] == len(token_ids), (logits.shape, len(token_ids))
        return logits

    def warm_up(self) -> None:
        """Run one short request through prefill and decode (and every format's path), so
        native ops are built or loaded and first-use costs are paid before any client waits.
        Shorter than a page: it leaves nothing in the prefix cache."""
        self.grammars.prepare()
        rid = "__warm_up__"
        prompt = list(range(1, min(4, self.pool.page_size - 2) + 1))
        self.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                     ignore_eos=True), tenant="__warm_up__")
        while rid in self.requests:
            for out in self.step():
                if out.request_id == rid and out.error is not None:
                    raise out.error
        release_free_heap()  # the grammar tokenizer's and the step's transient buffers

    def abort_request(self, request_id: str,
                      error: TesseraError | None = None) -> RequestOutput | None:
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        seq.error = error
        self._finish(seq, "abort" if error is None else "error")
        return self._output(seq)

    def check_quiescent(self) -> None:
        """Raise unless every page is free or held once by the prefix cache alone."""
        if self.requests:
            raise AssertionError(f"{len(self.requests)} requests still in flight")
        if self.prefix_cache is None:
            self.pool.check_quiescent()
        else:
            self.prefix_cache.check_quiescent()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------

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
            states = [_state(s.seq) for s in samplers]
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
                state = _state(seq)
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
        state = _state(seq)
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
        state = _state(seq)
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


def _lay_out(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its float projections stored as the CPU matmul reads them fastest (after
    any conversion, which reads the weights as loaded)."""
    use_column_major_weights(model)
    return model


def _state(seq: Sequence) -> RequestState:
    assert seq.state is not None, "admitted sequences carry their engine state"
    return seq.state
