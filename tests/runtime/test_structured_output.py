"""Constrained decoding: the spec's own checks, the batched mask, and the engine's output
matching its schema under chunked prefill, preemption and prefix-cache hits."""

from __future__ import annotations

import json

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.grammar import TokenMasks, apply_token_masks
from runtime.structured_output import (
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_CHARS,
    InvalidStructuredOutput,
    StructuredOutput,
)
from tests.runtime.test_hf_loader import tiny_hf  # noqa: F401  (the tiny random Llama)

jsonschema = pytest.importorskip("jsonschema")

# Bounded by construction (enums, small integers, short strings): even a random model finishes.
SMALL_SCHEMA = {"type": "object", "additionalProperties": False,
                "required": ["color", "count", "tag"],
                "properties": {"color": {"enum": ["red", "green", "blue"]},
                               "count": {"type": "integer", "minimum": 0, "maximum": 99},
                               "tag": {"type": "string", "maxLength": 6}}}


# -- the spec ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "spec", "problem"), [
    ("json_schema", "{not json", "invalid"),
    ("json_schema", "[1, 2]", "invalid"),
    ("json_schema", "x" * (MAX_SPEC_CHARS + 1), "too_large"),
    ("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}
    ).replace("{}", '{"allOf": [' * MAX_SCHEMA_DEPTH + "{}" + "]}" * MAX_SCHEMA_DEPTH),
     "too_deep"),
    ("regex", "", "invalid"),
    ("json_object", "{}", "invalid"),
    ("yaml", "a: b", "invalid"),
])
def test_a_bad_spec_is_refused_naming_its_problem(kind, spec, problem):
    with pytest.raises(InvalidStructuredOutput) as info:
        StructuredOutput(kind, spec)
    assert info.value.reason == "INVALID_ARGUMENT"
    assert info.value.metadata["problem"] == problem
    assert len(info.value.message) < 200  # never echoes the spec


def test_apply_token_masks_matches_a_per_token_reference():
    vocab, rows = 101, 5  # odd: the last 32-bit word is partly past the vocabulary
    logits = torch.randn(rows, vocab)
    masked_rows = [0, 3, 4]
    allowed = torch.rand(len(masked_rows), vocab) < 0.3
    words = (vocab + 31) // 32
    bitmask = torch.zeros(len(masked_rows), words, dtype=torch.int32)
    for j in range(len(masked_rows)):
        for w in range(words):
            v = sum(1 << b for b in range(32) if w * 32 + b < vocab and allowed[j, w * 32 + b])
            bitmask[j, w] = v - (1 << 32) if v >= 1 << 31 else v  # the word as an int32
    out = apply_token_masks(logits.clone(), TokenMasks(masked_rows, bitmask))
    expected = logits.clone()
    for j, i in enumerate(masked_rows):
        for t in range(vocab):
            if not allowed[j, t]:
                expected[i, t] = float("-inf")
    assert torch.equal(out, expected)


# -- the engine (a tiny random Llama: fast, and it would never write JSON by itself) ------------


@pytest.fixture(scope="module")
def tiny_paths(tiny_hf):  # noqa: F811
    return str(tiny_hf[1])


def _run(llm: LLM, prompts: list[str], params: SamplingParams) -> list[str]:
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"so-{i}", p, params)
    texts: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                assert out.outputs[0].finish_reason == "stop"
                texts[out.request_id] = out.outputs[0].text
    engine.check_quiescent()
    return [texts[f"so-{i}"] for i in range(len(prompts))]


PROMPTS = [f"Request {i}: describe item number {i * 7} " + "with some padding words " * (i % 3)
           for i in range(4)]


def test_output_matches_its_schema_under_chunked_prefill_preemption_and_cache_hits(tiny_paths):
    params = SamplingParams(max_tokens=48, temperature=0.0,
                            structured_output=StructuredOutput.json_schema(SMALL_SCHEMA))
    roomy = LLM(model=tiny_paths, kv_cache_bytes=8 << 20)
    alone = [_run(roomy, [p], params)[0] for p in PROMPTS]
    for text in alone:
        jsonschema.validate(json.loads(text), SMALL_SCHEMA)
    # 16-token pages of 512 bytes a token: 8 pages for four requests of ~40 tokens each, and
    # an 8-token step budget that prefills every prompt in chunks.
    tight = LLM(model=tiny_paths, kv_cache_bytes=8 * 16 * 512, max_num_batched_tokens=8)
    together = _run(tight, PROMPTS, params)
    assert tight.engine.scheduler.num_preemptions > 0, "the pool never ran short"
    assert together == alone
    again = _run(tight, PROMPTS[:2], params)  # the prompts' pages are now in the prefix cache
    assert again == alone[:2]


def test_seeded_sampling_and_regex_and_lark_are_followed(tiny_paths):
    llm = LLM(model=tiny_paths, kv_cache_bytes=8 << 20)
    for so, check in [
        (StructuredOutput("regex", r"(yes|no), [a-z]{1,8}\."),
         lambda t: __import__("re").fullmatch(r"(yes|no), [a-z]{1,8}\.", t)),
        (StructuredOutput("grammar", 'start: "(" NUM ")" | "(" NUM "+" NUM ")"\n'
                                     "NUM: /[0-9]{1,3}/"),
         lambda t: __import__("re").fullmatch(r"\(\d{1,3}(\+\d{1,3})?\)", t)),
    ]:
        params = SamplingParams(max_tokens=64, temperature=1.0, seed=3, structured_output=so)
        for text in _run(llm, PROMPTS[:3], params):
            assert check(text), (so.kind, text)


def test_a_schema_the_compiler_refuses_fails_only_its_request(tiny_paths):
    llm = LLM(model=tiny_paths, kv_cache_bytes=8 << 20)
    good = llm.engine.add_request("good", PROMPTS[0], SamplingParams(max_tokens=4))
    for spec in ('{"type": "strin"}', '{"$ref": "#/definitions/missing"}'):
        with pytest.raises(InvalidStructuredOutput) as info:
            llm.engine.add_request("bad", PROMPTS[1], SamplingParams(
                structured_output=StructuredOutput("json_schema", spec)))
        assert info.value.metadata["problem"] == "invalid"
    with pytest.raises(InvalidStructuredOutput):
        llm.engine.add_request("bad", PROMPTS[1], SamplingParams(
            structured_output=StructuredOutput("regex", "[a-")))
    assert "bad" not in llm.engine.requests
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert good.finish_reason == "length"
    llm.engine.check_quiescent()
