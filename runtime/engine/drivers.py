"""Loops that drive the engine's own steps for one purpose: teacher-forced scoring of a prompt
and the warm-up request a worker runs before it serves (LLM().generate and the asyncio front
drive the steps of client requests)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.config import EngineConfig
from runtime.errors import InvalidArgument
from runtime.grammar import GrammarCompiler
from runtime.heap import release_free_heap
from runtime.kv.pages import PagePool
from runtime.model_runner import ModelRunner
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence


class Drivers:
    """The engine's own step loops (a part of `LLMEngine`)."""

    config: EngineConfig
    pool: PagePool
    runner: ModelRunner
    grammars: GrammarCompiler
    requests: dict[str, Sequence]
    add_request: Callable[..., Sequence]
    step: Callable[[], list[RequestOutput]]
    abort_request: Callable[..., RequestOutput | None]

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
        seq.engine_state.prompt_logits = sink
        try:
            self._run_until_done(rid)
        finally:
            self.abort_request(rid)
        logits = torch.cat(sink)
        assert logits.shape[0] == len(token_ids), (logits.shape, len(token_ids))
        return logits

    def warm_up(self, *, first_use: bool = True) -> None:
        """Run one short request through prefill and decode (and every format's path), so
        native ops are built or loaded and first-use costs are paid before any client waits.
        Shorter than a page: it leaves nothing in the prefix cache. `first_use=False` leaves
        `prepare_first_use` to the caller (a worker runs it once idle after reporting ready)."""
        if first_use:
            self.prepare_first_use()
        rid = "__warm_up__"
        prompt = list(range(1, min(4, self.pool.page_size - 2) + 1))
        self.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                     ignore_eos=True), tenant="__warm_up__")
        self._run_until_done(rid)
        if self.runner.graphs is not None and self.config.decode_graphs == "auto":
            # after a request was served eagerly (issue 31): every kernel is built and loaded
            self.runner.graphs.capture()
        release_free_heap()  # the grammar tokenizer's and the step's transient buffers

    def prepare_first_use(self) -> None:
        """Build what a plain request never needs but a structured-output or chat request does
        on first use: llguidance's tokenizer (~0.4 s of CPU with the default model), the
        tokenizer's plain-text backend and chat template (~0.15 s). Idempotent."""
        self.grammars.prepare()
        self.tokenizer.prepare()

    def _run_until_done(self, request_id: str) -> None:
        """Step until `request_id` is no longer in flight; its error, if any, is raised."""
        while request_id in self.requests:
            for out in self.step():
                if out.request_id == request_id and out.error is not None:
                    raise out.error
