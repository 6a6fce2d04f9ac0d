"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

from runtime.candidates import child_id, child_params, merge
from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.errors import InvalidArgument
from runtime.input_processor import ProcessedPrompt, Prompt
from runtime.memory import MemoryFootprint, measure_memory
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto",
                 kv_cache_bytes: int | None = None, page_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, device: str = "auto", seed: int = 0,
                 integrity: str = "tags", enable_prefix_caching: bool = True,
                 tenant_page_quota: float = 1.0, kv_cache_dtype: str = "auto",
                 prefill_kv_cache_dtype: str = "auto", prefill_weights: str = "auto",
                 decode_weights: str = "auto", weight_group_size: int = 128,
                 weight_symmetric: bool = True, tensor_parallel_size: int = 1,
                 gguf_weights: str = "auto", gguf_activations: str = "auto",
                 attention_backend: str = "auto") -> None:
        config = EngineConfig(page_size=page_size, kv_cache_bytes=kv_cache_bytes,
                              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, dtype=dtype,
                              device=device, seed=seed, integrity=integrity,
                              enable_prefix_caching=enable_prefix_caching,
                              tenant_page_quota=tenant_page_quota,
                              kv_cache_dtype=kv_cache_dtype,
                              prefill_kv_cache_dtype=prefill_kv_cache_dtype,
                              prefill_weights=prefill_weights, decode_weights=decode_weights,
                              weight_group_size=weight_group_size,
                              weight_symmetric=weight_symmetric,
                              tensor_parallel_size=tensor_parallel_size,
                              gguf_weights=gguf_weights, gguf_activations=gguf_activations,
                              attention_backend=attention_backend)
        self.engine = LLMEngine.from_path(model, config)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, model: str | None, config: EngineConfig) -> LLM:
        """An LLM over an engine built from a full EngineConfig (the command line's path)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine.from_path(model, config)
        llm._ids = itertools.count()
        return llm

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.kv_capacity_tokens

    @property
    def serving_formats(self) -> Any:
        """The resolved per-phase weight and KV formats (`runtime.serving_formats`)."""
        return self.engine.formats

    def prompt_logits(self, token_ids: list[int], *, tenant: str = "default") -> Any:
        """float32 [len(token_ids), vocab]: row i is the logits predicting token i + 1, through
        the engine's own paged path (configured KV format, prefill weights)."""
        return self.engine.prompt_logits(token_ids, tenant)

    def memory_footprint(self) -> MemoryFootprint:
        """Weight and KV bytes this engine holds, measured, with the settings that sized them
        (`ops.planner.engine.memory_report` compares them with the capacity planner)."""
        return measure_memory(self.engine)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, tenant: str = "default") -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs in prompt order."""
        if isinstance(prompts, (str, ProcessedPrompt)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params_list = [params] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise InvalidArgument(f"{len(params_list)} sampling params for "
                                      f"{len(prompts)} prompts", field="sampling_params")
        # Process everything before anything runs: a bad prompt fails the call, not the batch.
        processed = [self.engine.processor.process(p) for p in prompts]
        for i, p in enumerate(processed):
            if not p.token_ids:
                raise InvalidArgument(f"prompt {i} is empty", field="prompt")
        rids = [f"offline-{next(self._ids)}" for _ in prompts]
        # child id -> (prompt position, candidate index); candidates past 0 wait in `later`
        # until candidate 0 has sampled (its prompt pages are then in the prefix cache).
        order: dict[str, tuple[int, int]] = {}
        later: dict[str, list[tuple[str, ProcessedPrompt, SamplingParams]]] = {}
        for pos, (rid, prompt, p) in enumerate(zip(rids, processed, params_list, strict=True)):
            for i in range(p.n):
                order[child_id(rid, i)] = (pos, i)
            self.engine.add_request(rid, prompt, child_params(p, 0), tenant=tenant)
            later[rid] = [(child_id(rid, i), prompt, child_params(p, i)) for i in range(1, p.n)]
        return self._run(order, later, [p.n for p in params_list], tenant)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
               tenant: str = "default") -> Iterator[RequestOutput]:
        """One request's outputs as it decodes (`delta_text`: the text each adds); closing the
        iterator early (or Ctrl-C while it runs) aborts the request and frees its pages."""
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, prompt, sampling_params or SamplingParams(), tenant=tenant)
        try:
            while rid in self.engine.requests:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    if out.error is not None:
                        raise out.error
                    yield out
        finally:
            self.engine.abort_request(rid)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, *,
             tenant: str = "default") -> list[RequestOutput]:
        """Each conversation rendered with the model's chat template; message contents are
        tokenized as plain text (a "<|im_end|>" in one is text, never a control token)."""
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.engine.processor.process_chat(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, tenant=tenant)

    def _run(self, order: dict[str, tuple[int, int]],
             later: dict[str, list[tuple[str, ProcessedPrompt, SamplingParams]]],
             counts: list[int], tenant: str) -> list[RequestOutput]:
        results: list[list[RequestOutput | None]] = [[None] * n for n in counts]
        try:
            while any(r is None for rs in results for r in rs):
                for out in self.engine.step():
                    for cid, prompt, p in later.pop(out.request_id, ()):
                        self.engine.add_request(cid, prompt, p, tenant=tenant)
                    if out.finished and out.request_id in order:
                        pos, i = order[out.request_id]
                        results[pos][i] = out
        finally:
            for rid in order:
                self.engine.abort_request(rid)
        return [rs[0] if len(rs) == 1 else merge(rs)  # type: ignore[misc,arg-type]
                for rs in results]
