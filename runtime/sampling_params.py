"""Per-request sampling parameters, validated on construction (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.errors import InvalidArgument

# Temperatures below this sample greedily (as in vLLM): dividing logits by a smaller one
# overflows float32, or underflows the temperature itself to zero.
SAMPLING_EPS = 1e-5
# Stop strings are searched on every decoded token: their number and length are bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# Candidates per prompt (`n`): each is a sequence with its own pages past the shared prompt.
MAX_CANDIDATES = 16
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound


@dataclass(frozen=True)
class SamplingParams:
    # None: as many as the context (and the tenant's KV quota) leaves after the prompt.
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Candidates for the prompt; candidate i samples with seed + i (mod 2**64) when seeded.
    n: int = 1
    # EOS and stop token ids are masked, and stop strings not checked, before this many tokens.
    min_tokens: int = 0

    def __post_init__(self) -> None:
        # Accept lists, None and a single stop string, as users of vLLM pass them.
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is None:
                value = ()
            elif name == "stop" and isinstance(value, str):
                value = (value,)
            try:
                object.__setattr__(self, name, tuple(value))
            except TypeError:
                raise InvalidArgument(f"{name} must be a list, got {_shown(value)}",
                                      field=name) from None
        if type(self.top_k) is int and self.top_k == 0:  # vLLM's users send 0 for "off" too
            object.__setattr__(self, "top_k", -1)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidArgument:
            return InvalidArgument(f"{name} {why}, got {_shown(getattr(self, name))}",
                                   field=name)

        if self.max_tokens is not None:
            if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
                raise bad("max_tokens", "must be an integer")
            if self.max_tokens <= 0:
                raise bad("max_tokens", "must be at least 1")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (off) or a positive integer")
        if not _is_finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or
                                      not 0 <= self.seed < 1 << 64):
            raise bad("seed", "must be an integer in [0, 2**64)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise bad("stop", f"strings may be at most {MAX_STOP_CHARS} characters long")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and (not _is_int(self.logprobs) or
                                          not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_CANDIDATES:
            raise bad("n", f"must be an integer in [1, {MAX_CANDIDATES}]")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens ({self.max_tokens})")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _shown(value: object) -> str:
    """What an error may echo of a value: a number as is, anything else by its kind only
    (client input of any size must not grow the message)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, float) or (isinstance(value, int) and abs(value) < 1 << 64):
        return repr(value)
    if isinstance(value, int):
        return "an integer of more than 64 bits"
    if isinstance(value, (str, tuple, list)):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"a value of type {type(value).__name__}"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: object) -> bool:
    import math

    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
