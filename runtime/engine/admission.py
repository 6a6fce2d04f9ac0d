"""Admitting a request: its checks (parameters, context length, output limit, tenant quota),
operator-declared shared prefixes, and the sequence with its engine state."""

from __future__ import annotations

import torch

from runtime.config import ModelConfig
from runtime.detokenizer import IncrementalDetokenizer
from runtime.errors import ContextLengthExceeded, InvalidArgument, TenantQuotaExceeded
from runtime.grammar import GrammarCompiler
from runtime.input_processor import InputProcessor, Prompt
from runtime.kv.pages import PagePool
from runtime.request_state import RequestState
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler
from runtime.sequence import Sequence
from runtime.tokenizer import Tokenizer


class Admission:
    """The engine's admission half (a part of `LLMEngine`)."""

    model_config: ModelConfig
    tokenizer: Tokenizer
    processor: InputProcessor
    pool: PagePool
    scheduler: Scheduler
    grammars: GrammarCompiler
    max_model_len: int
    requests: dict[str, Sequence]
    # namespace -> (prefix token ids, tenants allowed to share it)
    shared_prefixes: dict[str, tuple[list[int], frozenset[str]]]

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of `prompt`, through the input processor."""
        p = self.processor.process(prompt)
        return p.text, p.token_ids

    def declare_shared_prefix(self, namespace: str, prefix: Prompt,
                              tenants: list[str]) -> int:
        """Operator-only: let these tenants share the KV of a common prompt prefix (e.g. a
        system prompt). Returns the number of tokens shared (whole pages only)."""
        if not namespace or namespace in tenants:
            raise InvalidArgument("a shared namespace needs its own name, not a tenant's",
                                  field="namespace")
        ids = self.processor.process(prefix).token_ids
        self.shared_prefixes[namespace] = (ids, frozenset(tenants))
        return len(ids) // self.pool.page_size * self.pool.page_size

    def _shared_prefix_for(self, tenant: str, ids: list[int]) -> tuple[str | None, int]:
        for ns, (prefix, tenants) in self.shared_prefixes.items():
            if tenant in tenants and ids[: len(prefix)] == prefix:
                return ns, len(prefix) // self.pool.page_size
        return None, 0

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    tenant: str = "default", *, prompt_text: str | None = None) -> Sequence:
        """Admit one request. `prompt` is a ProcessedPrompt (`self.processor`, run off the
        engine thread: admitted as it is), or text or token ids, processed here (the offline
        API's callers, whose thread is the engine's). `prompt_text` overrides the text that
        outputs carry."""
        if not isinstance(params, SamplingParams):
            raise InvalidArgument("params must be a SamplingParams", field="params")
        if params.n != 1:  # one sequence per request: runtime.candidates fans n out
            raise InvalidArgument("add_request takes n = 1; fan candidates out with "
                                  "runtime.candidates", field="n")
        if request_id in self.requests:
            raise InvalidArgument(f"request id {request_id!r} is already in flight",
                                  field="request_id")
        processed = self.processor.process(prompt)
        ids = processed.token_ids
        text = processed.text if prompt_text is None else prompt_text
        if not ids:
            raise InvalidArgument("prompt is empty after tokenization", field="prompt")
        if len(ids) >= self.max_model_len:
            raise ContextLengthExceeded(
                f"prompt has {len(ids)} tokens; this model serves at most {self.max_model_len} "
                f"(prompt and output together)", prompt_tokens=len(ids),
                max_model_len=self.max_model_len)
        max_tokens = self._resolve_max_tokens(len(ids), params.max_tokens, tenant,
                                              "messages" if processed.from_messages else "prompt")
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

    def _resolve_max_tokens(self, prompt_tokens: int, asked: int | None, tenant: str,
                            prompt_name: str = "prompt") -> int:
        """The output limit: what was asked, refused past the context or the tenant's KV quota;
        when unset, all that both leave after the prompt. `prompt_name` is what the refusal
        calls the input: "messages" for a chat (OpenAI's chat wording), else "prompt"."""
        quota_tokens = self.scheduler.quota_pages * self.pool.page_size
        if asked is None:
            room = min(self.max_model_len, quota_tokens) - prompt_tokens
            if room >= 1:
                return room
            asked = 1  # the quota holds not even the prompt and one token: refused below
        elif prompt_tokens + asked > self.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_tokens + asked} tokens ({prompt_tokens} in the "
                f"{prompt_name}, {asked} in the completion). Please reduce the length of the "
                f"{prompt_name} or completion.", field="max_tokens", prompt_tokens=prompt_tokens,
                max_tokens=asked, max_model_len=self.max_model_len)
        longest = prompt_tokens + asked
        if self.pool.pages_for_tokens(longest) > self.scheduler.quota_pages:
            raise TenantQuotaExceeded(
                f"this request may need {longest} tokens of KV, more than tenant {tenant!r} may "
                f"hold ({quota_tokens} tokens)", tenant=tenant,
                quota_pages=self.scheduler.quota_pages)
        return asked
