"""Bad input gets a clear typed error and harms nothing else: the batch it lands in keeps its
exact outputs, no page leaks, and a failing step fails only the requests it held."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from runtime import LLM, SamplingParams
from runtime.engine import LLMEngine
from runtime.errors import (
    ContextLengthExceeded,
    InvalidArgument,
    ModelLoadError,
    ModelNotFound,
    TesseraError,
)

pytestmark = pytest.mark.slow

GOOD_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=77, max_tokens=8, ignore_eos=True)
GOOD = [(prompt, GREEDY) for prompt in GOOD_PROMPTS] + [(GOOD_PROMPTS[0], SEEDED)]


@pytest.fixture(scope="module")
def solo_tokens(llm) -> list[list[int]]:
    """Each good request's tokens when it runs alone in the engine."""
    return [llm.generate(prompt, params)[0].outputs[0].token_ids for prompt, params in GOOD]


# -- the catalogue of bad requests ----------------------------------------------------------


@dataclass(frozen=True)
class BadCase:
    name: str
    submit: Callable[[LLMEngine, str], Any]  # (engine, request id) -> raises
    error: type[TesseraError]
    words: tuple[str, ...]  # the message must name the problem
    field: str | None = None


def prompt_case(name: str, prompt: Any, *words: str) -> BadCase:
    return BadCase(name, lambda e, rid: e.add_request(rid, prompt, GREEDY), InvalidArgument,
                   words, "prompt")


def params_case(name: str, field: str, value: Any, *words: str) -> BadCase:
    def submit(e: LLMEngine, rid: str) -> Any:
        return e.add_request(rid, "Hello", SamplingParams(**{field: value}))
    return BadCase(name, submit, InvalidArgument, (field, *words), field)


def too_long_ids(e: LLMEngine, rid: str) -> Any:
    return e.add_request(rid, [1] * e.max_model_len, GREEDY)


def too_long_text(e: LLMEngine, rid: str) -> Any:
    return e.add_request(rid, "hello " * e.max_model_len, GREEDY)


def output_past_context(e: LLMEngine, rid: str) -> Any:
    return e.add_request(rid, [1] * 10, SamplingParams(max_tokens=e.max_model_len - 9))


CASES = [
    prompt_case("empty_string", "", "prompt", "empty"),
    prompt_case("empty_token_list", [], "prompt", "empty"),
    prompt_case("token_id_past_vocab", [1, 2, 49152], "token ids", "49152"),
    prompt_case("huge_token_id", [1, 10**12], "token ids"),
    prompt_case("negative_token_id", [5, -1], "token ids"),
    prompt_case("non_int_token_id", [5, "6"], "token ids"),
    prompt_case("prompt_of_wrong_type", 42, "prompt", "int"),
    BadCase("prompt_ids_past_context", too_long_ids, ContextLengthExceeded,
            ("prompt", "tokens", "at most")),
    BadCase("prompt_text_past_context", too_long_text, ContextLengthExceeded,
            ("prompt", "tokens", "at most")),
    BadCase("max_tokens_past_context", output_past_context, ContextLengthExceeded,
            ("maximum context length", "10 in the prompt")),
    params_case("max_tokens_zero", "max_tokens", 0, "at least 1"),
    params_case("max_tokens_negative", "max_tokens", -3, "at least 1"),
    params_case("max_tokens_float", "max_tokens", 2.5, "integer"),
    params_case("top_p_zero", "top_p", 0.0, "(0, 1]"),
    params_case("top_p_above_one", "top_p", 1.5, "(0, 1]"),
    params_case("top_p_nan", "top_p", math.nan, "(0, 1]"),
    params_case("temperature_negative", "temperature", -0.5, ">= 0"),
    params_case("temperature_nan", "temperature", math.nan, "finite"),
    params_case("temperature_inf", "temperature", math.inf, "finite"),
    params_case("temperature_string", "temperature", "hot", "number"),
    params_case("top_k_below_minus_one", "top_k", -2, "-1"),
    params_case("top_k_float", "top_k", 2.5, "integer"),
    params_case("min_p_above_one", "min_p", 1.5, "[0, 1]"),
    params_case("min_p_negative", "min_p", -0.1, "[0, 1]"),
    params_case("repetition_penalty_zero", "repetition_penalty", 0.0, "> 0"),
    params_case("presence_penalty_too_big", "presence_penalty", 3.0, "[-2, 2]"),
    params_case("frequency_penalty_nan", "frequency_penalty", math.nan, "[-2, 2]"),
    params_case("seed_negative", "seed", -1, "integer"),
    params_case("seed_string", "seed", "42", "integer"),
    params_case("seed_past_64_bits", "seed", 1 << 64, "2**64"),
    params_case("stop_not_a_string", "stop", [3], "strings"),
    params_case("stop_empty_string", "stop", [""], "non-empty"),
    params_case("stop_a_number", "stop", 5, "list"),
    params_case("stop_too_many_strings", "stop", ["a"] * 17, "at most 16"),
    params_case("stop_string_too_long", "stop", ["a" * 257], "at most 256"),
    params_case("stop_token_ids_negative", "stop_token_ids", [-1], "non-negative"),
    params_case("stop_token_ids_a_number", "stop_token_ids", 5, "list"),
    params_case("logprobs_too_many", "logprobs", 21, "[0, 20]"),
    BadCase("params_not_sampling_params",
            lambda e, rid: e.add_request(rid, "Hello", {"temperature": 0.0}),  # type: ignore[arg-type]
            InvalidArgument, ("SamplingParams",), "params"),
    BadCase("duplicate_request_id",
            lambda e, rid: e.add_request("good-0", "Something else", GREEDY),
            InvalidArgument, ("good-0", "already in flight"), "request_id"),
]


def check_error(case: BadCase, err: TesseraError) -> None:
    assert type(err) is case.error
    assert err.reason == case.error.reason
    for word in case.words:
        assert word in str(err), f"{word!r} not in {err}"
    if case.field is not None:
        assert err.metadata.get("field") == case.field


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request_raises_a_typed_error_and_registers_nothing(engine, case):
    holder = engine.add_request("good-0", "Hello there", GREEDY)
    with pytest.raises(TesseraError) as info:
        case.submit(engine, f"bad-{case.name}")
    check_error(case, info.value)
    assert engine.requests == {"good-0": holder}
    assert list(engine.scheduler.waiting) == [holder]
    engine.prefix_cache.clear()
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_context_length_error_says_both_lengths(engine):
    with pytest.raises(ContextLengthExceeded) as info:
        too_long_ids(engine, "long")
    err = info.value
    assert isinstance(err, InvalidArgument)  # clients that only know INVALID_ARGUMENT still cope
    assert err.reason == "CONTEXT_LENGTH_EXCEEDED"
    assert str(engine.max_model_len) in str(err)
    assert err.metadata == {"prompt_tokens": str(engine.max_model_len),
                            "max_model_len": str(engine.max_model_len)}


def test_longest_allowed_prompt_is_accepted(engine):
    one = SamplingParams(max_tokens=1)
    seq = engine.add_request("longest", [1] * (engine.max_model_len - 1), one)
    assert engine.requests["longest"] is seq


def test_bad_requests_mid_flight_leave_the_batch_untouched(engine, solo_tokens):
    good_ids = [f"good-{i}" for i in range(len(GOOD))]
    for rid, (prompt, params) in zip(good_ids, GOOD, strict=True):
        engine.add_request(rid, prompt, params)
    finished: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids

    step()
    step()
    for i, case in enumerate(CASES):
        assert set(good_ids) <= set(engine.requests), "good requests finished too early"
        with pytest.raises(TesseraError) as info:
            case.submit(engine, f"bad-{case.name}")
        check_error(case, info.value)
        if i % 10 == 9:
            step()
    assert set(engine.requests) == set(good_ids)
    while engine.has_unfinished_requests():
        step()
    assert [finished[rid] for rid in good_ids] == solo_tokens


def test_failing_step_fails_only_its_requests_and_the_engine_keeps_serving(
        engine, solo_tokens, monkeypatch):
    budget = engine.config.max_num_batched_tokens
    real_execute = engine.runner.execute
    failed_batches: list[list[str]] = []

    def execute_failing_once(batch):
        if not failed_batches:
            failed_batches.append([s.seq.request_id for s in batch.scheduled])
            raise RuntimeError("simulated device fault")
        return real_execute(batch)

    monkeypatch.setattr(engine.runner, "execute", execute_failing_once)
    # The first request fills the whole token budget, so the second one waits this step.
    engine.add_request("doomed", list(range(1000, 1000 + budget)), GREEDY)
    engine.add_request("bystander", GOOD_PROMPTS[0], GREEDY)
    outputs = engine.step()
    assert failed_batches == [["doomed"]]
    assert [o.request_id for o in outputs] == ["doomed"]
    doomed = outputs[0]
    assert doomed.finished
    assert doomed.outputs[0].finish_reason == "error"
    assert doomed.outputs[0].token_ids == []
    assert isinstance(doomed.error, TesseraError)
    assert doomed.error.reason == "INTERNAL"
    assert "RuntimeError" in str(doomed.error)
    assert "doomed" not in engine.requests
    engine.prefix_cache.clear()
    assert engine.pool.num_used_pages == 0  # the failed request's pages came back
    # The bystander was not in the failed step: it runs on, unchanged.
    assert list(engine.requests) == ["bystander"]
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert finished == {"bystander": solo_tokens[0]}
    # And new requests after the fault are served exactly as before it.
    monkeypatch.undo()
    assert engine.runner.execute == real_execute
    outs = [o.outputs[0].token_ids for o in engine_generate(engine, GOOD)]
    assert outs == solo_tokens


def engine_generate(engine: LLMEngine, requests: list[tuple[str, SamplingParams]]):
    rids = [f"after-{i}" for i in range(len(requests))]
    for rid, (prompt, params) in zip(rids, requests, strict=True):
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[rid] for rid in rids]


# -- bad models -----------------------------------------------------------------------------


def load(path: Path | str) -> LLM:
    return LLM(str(path), kv_cache_bytes=1 << 20)


def test_unknown_model_path_is_model_not_found(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(ModelNotFound) as info:
        load(missing)
    assert info.value.reason == "MODEL_NOT_FOUND"
    assert "no-such-model.gguf" in str(info.value)
    assert "does not exist" in str(info.value)


def test_directory_without_config_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match=r"config\.json"):
        load(tmp_path)


def test_random_bytes_gguf_is_a_model_load_error(tmp_path):
    bad = tmp_path / "random.gguf"
    bad.write_bytes(os.urandom(64 << 10))
    with pytest.raises(ModelLoadError) as info:
        load(bad)
    assert info.value.reason == "MODEL_LOAD_FAILED"
    assert "random.gguf" in str(info.value)
    assert "GGUF" in str(info.value)


def test_truncated_gguf_is_a_model_load_error(tmp_path, default_model_path):
    data = default_model_path.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) - 4096])  # a download cut short
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf"):
        load(bad)


@pytest.fixture
def hf_dir(tmp_path, llm) -> Path:
    """A Hugging Face directory with a valid config and tokenizer, weights to be written."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(llm.engine.model_config.to_hf_config()))
    llm.tokenizer.backend.save(str(folder / "tokenizer.json"))
    return folder


# A header announcing one 4x4 float32 tensor (64 bytes of data), of which only 10 follow.
TENSOR_HEADER = b'{"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}'


@pytest.mark.parametrize("weights", [
    pytest.param(b"", id="empty"),
    pytest.param(os.urandom(16 << 10), id="random_bytes"),
    pytest.param((1 << 40).to_bytes(8, "little") + b"{}", id="absurd_header_length"),
    pytest.param(len(TENSOR_HEADER).to_bytes(8, "little") + TENSOR_HEADER + bytes(10),
                 id="truncated_data"),
])
def test_corrupt_safetensors_is_a_model_load_error(hf_dir, weights):
    (hf_dir / "model.safetensors").write_bytes(weights)
    with pytest.raises(ModelLoadError) as info:
        load(hf_dir)
    assert info.value.reason == "MODEL_LOAD_FAILED"
    assert "model.safetensors" in str(info.value)


def test_unparseable_config_is_a_model_load_error(hf_dir):
    (hf_dir / "config.json").write_text("{not json")
    (hf_dir / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load(hf_dir)


def test_missing_tokenizer_is_a_model_load_error(hf_dir):
    (hf_dir / "tokenizer.json").unlink()
    (hf_dir / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        load(hf_dir)
