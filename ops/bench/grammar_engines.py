"""Per-step token-mask cost of three grammar engines on the default model's vocabulary.

    python3 -m ops.bench.grammar_engines

Compiles one nested JSON schema with llguidance, xgrammar and outlines-core for the SmolLM2
tokenizer (49,152 tokens, read from the GGUF), then walks a valid 49-token document: per token,
fill the bitmask, check the token is allowed, advance. Prints compile time and the per-step
median / p90 / max. xgrammar and outlines-core are not project dependencies: an engine that is
not installed is skipped (install with `pip install --no-deps xgrammar apache-tvm-ffi
outlines-core` to compare). The choice this informed is explained in runtime/grammar.py.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string"}}}}}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
       "address": {"city": "London", "zip": "W1"}}
EOS = 2


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table (byte-level BPE token spelling)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _bit(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def _walk(step: Callable[[int], bool], ids: list[int]) -> list[float]:
    times = []
    for t in ids:
        start = time.perf_counter()
        ok = step(t)
        times.append(time.perf_counter() - start)
        assert ok, f"token {t} refused"
    return times


def bench_llguidance(tok, ids: list[int]) -> tuple[float, list[float]]:
    import llguidance

    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=EOS)
    start = time.perf_counter()
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - start
    mask = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)

    def step(t: int) -> bool:
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        return _bit(mask, t) and m.consume_token(t)
    return compile_s, _walk(step, ids)


def bench_xgrammar(tok, ids: list[int]) -> tuple[float, list[float]]:
    import xgrammar as xgr

    vocab = [tok.backend.id_to_token(i) for i in range(tok.vocab_size)]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL,
                             vocab_size=tok.vocab_size, stop_token_ids=[EOS],
                             add_prefix_space=False)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), strict_mode=True)
    compile_s = time.perf_counter() - start
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, tok.vocab_size)

    def step(t: int) -> bool:
        m.fill_next_token_bitmask(mask, 0)
        return _bit(mask[0], t) and m.accept_token(t)
    return compile_s, _walk(step, ids)


def bench_outlines_core(tok, ids: list[int]) -> tuple[float, list[float]]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    by_bytes: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        text = tok.backend.id_to_token(i)
        if i in tok.special_ids or any(c not in to_byte for c in text):
            continue
        by_bytes.setdefault(bytes(to_byte[c] for c in text), []).append(i)
    vocabulary = Vocabulary(EOS, by_bytes)
    start = time.perf_counter()
    guide = Guide(Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary))
    compile_s = time.perf_counter() - start
    mask = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)

    def step(t: int) -> bool:
        guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        ok = _bit(mask, t)
        if t != EOS:
            guide.advance(t)
        return ok
    return compile_s, _walk(step, ids)


def main() -> None:
    from runtime.loader import open_checkpoint

    torch.set_num_threads(1)
    tok = open_checkpoint(None).tokenizer
    ids = [*tok.encode(json.dumps(DOC), add_special_tokens=False), EOS]
    print(f"vocabulary {tok.vocab_size} tokens, {len(ids)} steps")
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar),
                        ("outlines-core", bench_outlines_core)):
        try:
            compile_s, steps = bench(tok, ids)
        except ImportError:
            print(f"{name}: not installed, skipped (`pip install {name}` to compare it)")
            continue
        steps.sort()
        median, p90 = statistics.median(steps), steps[int(len(steps) * 0.9)]
        print(f"{name}: compile {compile_s * 1e3:.1f} ms; mask + advance per step: median "
              f"{median * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us, max {steps[-1] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
