"""Constrained decoding on llguidance: compiles a request's StructuredOutput for the model's
vocabulary, keeps one matcher per sequence, and fills the batch's token bitmask each step.

Why llguidance (measured 2026-11-30 on this project's 49,152-token SmolLM2 vocabulary, one CPU
thread, a 4-property nested JSON schema, 49 tokens of output; `ops/bench/grammar_engines.py`):

| engine        | compile  | mask + advance per step: median / p90 / max |
|---------------|----------|---------------------------------------------|
| llguidance    | 1.0 ms   | 22 / 72 / 1,515 us                          |
| xgrammar      | 9.7 ms   | 14 / 22 / 189 us                            |
| outlines-core | 107 ms   | 91 / 1,269 / 8,883 us                       |

Both llguidance and xgrammar cost well under 1% of a decode step here (~30 ms); llguidance is
chosen for what the rest of the engine needs: it is one wheel with no dependencies (xgrammar
requires torch, transformers, triton and apache-tvm-ffi, and must be installed --no-deps beside
our CPU torch), compilation is lazy and cheap on the request path, and its parser limits bound
the work of every mask step (`LLParserLimits`: lexer fuel, Earley items, grammar size), so a
hostile grammar fails its own request instead of stalling the engine thread. It also takes JSON
schemas, regexes and Lark grammars directly (vLLM, SGLang and llama.cpp use it for the same).

The bitmask is llguidance's: int32 words, bit `t % 32` of word `t // 32` set when token `t` is
allowed; EOS is allowed only where the grammar accepts.
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass

import numpy as np
import torch

from runtime.structured_output import InvalidStructuredOutput, StructuredOutput
from runtime.tokenizer import Tokenizer
from runtime.tool_grammar import tool_call_lark

_ERROR_CHARS = 300  # a compiler's message may quote the spec: shown cut
# JSON is written as json.dumps writes it: whitespace a model may choose freely is whitespace a
# small model can repeat until max_tokens, and the output never parses.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class TokenMasks:
    """The step's masks: `rows` index the sampler's rows; `bitmask` is int32 [len(rows),
    ceil(vocab / 32)]."""

    rows: list[int]
    bitmask: torch.Tensor


class GrammarMatcher:
    """One sequence's position in its grammar, advanced by every accepted output token."""

    def __init__(self, matcher: object) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and the matcher in error) if it was not allowed."""
        return bool(self._m.consume_token(token_id))  # type: ignore[attr-defined]

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing more (EOS included, or consumed)."""
        return bool(self._m.is_stopped())  # type: ignore[attr-defined]

    @property
    def error(self) -> str | None:
        m = self._m
        return str(m.get_error())[:_ERROR_CHARS] if m.is_error() else None  # type: ignore


def llguidance_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]) -> object:
    """llguidance's tokenizer for `tokenizer`, built once and kept on it: a worker template
    builds it once idle (it starts no thread; the executor does), so that no worker forked
    afterwards pays it again."""
    import llguidance

    cached = getattr(tokenizer, "_llguidance", None)
    if not has_llguidance_tokenizer(tokenizer, vocab_size, eos_ids):
        built = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                       eos_token=list(eos_ids))
        cached = ((vocab_size, tuple(eos_ids)), built)
        tokenizer._llguidance = cached  # type: ignore[attr-defined]
    return cached[1]


def has_llguidance_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]) -> bool:
    """Whether llguidance_tokenizer(...) of these arguments is built already (kept on it)."""
    cached = getattr(tokenizer, "_llguidance", None)
    return cached is not None and cached[0] == (vocab_size, tuple(eos_ids))


class GrammarCompiler:
    """The engine's grammar engine for one vocabulary. The llguidance tokenizer (~0.3 s to build
    for 49k tokens) is built on first use or by `prepare` (the engine's warm-up)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self.eos_ids = list(eos_ids)
        self._lltok: object | None = None
        self._executor: object | None = None
        self._lock = threading.Lock()

    def prepare(self) -> None:
        import llguidance

        with self._lock:
            if self._lltok is None:
                self._lltok = llguidance_tokenizer(self.tokenizer, self.vocab_size,
                                                   self.eos_ids)
                self._executor = llguidance.LLExecutor()

    def grammar_text(self, so: StructuredOutput) -> str:
        """llguidance's grammar for a request, or InvalidStructuredOutput naming the problem."""
        import llguidance

        try:
            if so.kind in ("json_schema", "json_object"):
                spec = so.spec if so.kind == "json_schema" else json.dumps({"type": "object"})
                return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=_JSON_STYLE)
            if so.kind == "tool_call":
                return llguidance.LLMatcher.grammar_from_lark(tool_call_lark(so.spec))
            if so.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(so.spec)
            return llguidance.LLMatcher.grammar_from_lark(so.spec)
        except (ValueError, TypeError) as e:
            raise InvalidStructuredOutput(f"invalid {so.kind}: {_first_line(str(e))}",
                                          "invalid") from None

    def matcher(self, so: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; InvalidStructuredOutput when the spec does
        not compile (an unknown type, a dangling $ref, a bad regex, a grammar past the limits)."""
        import llguidance

        self.prepare()
        grammar = self.grammar_text(so)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._lltok)
        if problem:
            kind = "too_large" if "limit" in problem.lower() or "too" in problem.lower() \
                else "invalid"
            raise InvalidStructuredOutput(f"invalid {so.kind}: {_first_line(problem)}", kind)
        m = llguidance.LLMatcher(self._lltok, grammar, log_level=0)
        if m.is_error():
            raise InvalidStructuredOutput(f"invalid {so.kind}: {_first_line(m.get_error())}",
                                          "invalid")
        return GrammarMatcher(m)

    def fill_masks(self, matchers: list[GrammarMatcher | None]) -> TokenMasks | None:
        """The bitmask of every constrained row (None when no row is): computed in llguidance's
        thread pool, written straight into one tensor."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
        work = [(matchers[i]._m, j) for j, i in enumerate(rows)]  # type: ignore[union-attr]
        self._executor.unsafe_compute_mask_ptr(  # type: ignore[attr-defined]
            work, bitmask.data_ptr(), words * 4, len(rows))
        return TokenMasks(rows, bitmask)


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
    """logits [rows, vocab] with every token a row's mask forbids at -inf (in place; returns
    logits). The bitmask unpacked in one pass, no loop over the vocabulary."""
    assert sys.byteorder == "little", "the bitmask is unpacked by bytes"
    vocab = logits.shape[-1]
    # allowed: [masked rows, words * 32] -> the first `vocab` columns. numpy's unpackbits is one
    # C loop over the bytes, and its 0/1 bytes are viewed as bools without a copy: 94 us for 32
    # rows of 49k tokens where a byte-table lookup took 16 ms (2026-12-01, this machine).
    bits = np.unpackbits(masks.bitmask.view(torch.uint8).numpy(), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits).view(torch.bool)[:, :vocab]
    if len(masks.rows) == logits.shape[0]:
        return logits.masked_fill_(~allowed, float("-inf"))
    idx = torch.tensor(masks.rows, dtype=torch.long)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits


def _first_line(text: str) -> str:
    lines = [line for line in str(text).splitlines() if line.strip()]
    return (lines[0] if lines else "rejected by the grammar compiler")[:_ERROR_CHARS]
