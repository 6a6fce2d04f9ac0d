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


class OutputTokenIds(list):
    """A sequence's output token ids, which only grow: each one appended is also appended to
    the sequence's `token_ids` (prompt then output), so neither is rebuilt on a read."""

    def __init__(self, all_ids: list[int], ids: list[int]) -> None:
        super().__init__(ids)
        self._all = all_ids

    def append(self, token_id: int) -> None:
        super().append(token_id)
        self._all.append(token_id)

    def extend(self, ids) -> None:  # type: ignore[override]
        ids = list(ids)
        super().extend(ids)
        self._all.extend(ids)

    def __iadd__(self, ids):  # type: ignore[override]
        self.extend(ids)
        return self

    def _refuse(self, *args, **kwargs):
        raise TypeError("output token ids only grow (append, extend)")

    insert = pop = remove = clear = sort = reverse = __setitem__ = __delitem__ = _refuse


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
        self._token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        self.output_token_ids = OutputTokenIds(self._token_ids, self.output_token_ids)
        if self.max_tokens <= 0:
            if self.params.max_tokens is None:
                raise ValueError("an unset max_tokens must be resolved before the sequence")
            self.max_tokens = self.params.max_tokens

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output ids: one list, grown as outputs are appended (read, never
        modify it)."""
        return self._token_ids

    @property
    def engine_state(self) -> RequestState:
        """The engine's state of an admitted sequence."""
        assert self.state is not None, "admitted sequences carry their engine state"
        return self.state

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

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
