"""A request's state inside the engine: its tokens, how many have KV, and its page table."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtime.errors import TesseraError
from runtime.kv.pages import PageRef
from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine's side of a request; the scheduler never reads it
    from runtime.request_state import RequestState

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str = "default"
    prompt: str | None = None
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache; the rest of `token_ids` is fed on later steps.
    num_computed_tokens: int = 0
    # The table the model runner reads, and the integrity ledger: what the sequence recorded
    # when the allocator gave it each page. The check compares the two and the pool.
    page_table: list[PageRef] = field(default_factory=list)
    recorded_pages: list[PageRef] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Prefix-cache keys of this sequence's full pages, and how many of them are in the cache.
    page_keys: list[bytes] = field(default_factory=list)
    num_pages_cached: int = 0
    # An operator-declared shared prefix (e.g. a common system prompt): its first
    # `shared_pages` full pages belong to the namespace, not to the tenant.
    shared_namespace: str | None = None
    shared_pages: int = 0
    num_preemptions: int = 0
    # False when every prompt position must be computed (teacher-forced scoring).
    reuse_prefix: bool = True
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: TesseraError | None = None
    # The engine's per-request state (detokenizer, generator, logprobs), set at admission.
    state: RequestState | None = None
    # Prefill side of a KV transfer: finishing for "length" keeps the pages for the exporter,
    # which releases them (runtime/disagg/export.py).
    export_kv: bool = False
    # Most output tokens: params.max_tokens when set (0 here), else what the engine resolved.
    max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            if self.params.max_tokens is None:
                raise ValueError("an unset max_tokens must be resolved before the sequence")
            self.max_tokens = self.params.max_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def engine_state(self) -> RequestState:
        """The engine's state of an admitted sequence."""
        assert self.state is not None, "admitted sequences carry their engine state"
        return self.state

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def shared_prefix(self) -> tuple[str, int] | None:
        return (self.shared_namespace, self.shared_pages) if self.shared_namespace else None

    def owner_of_page(self, index: int) -> str:
        return self.shared_namespace if index < self.shared_pages and self.shared_namespace \
            else self.tenant

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
