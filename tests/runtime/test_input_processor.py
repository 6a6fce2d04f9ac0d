"""The input processor: a prompt is tokenized (or its ids checked) once per request, off the
engine thread, and the engine admits the result without checking it again."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections import Counter

import pytest

from runtime.async_engine import AsyncLLM
from runtime.candidates import generate_candidates
from runtime.errors import InvalidArgument
from runtime.input_processor import InputProcessor, ProcessedPrompt
from runtime.sampling_params import SamplingParams

PROMPT = "The capital of France is"
SHORT = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
TIMEOUT_S = 120


class Calls:
    """Counts calls of the engine tokenizer's encoders and the processor's id check, and the
    threads they ran on (wrapping the real objects' methods)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engine) -> None:
        self.count: Counter[str] = Counter()
        self.threads: set[str] = set()
        for obj, name in ((engine.tokenizer, "encode"), (engine.tokenizer, "encode_chat"),
                          (engine.processor, "check_ids")):
            monkeypatch.setattr(obj, name, self._wrap(name, getattr(obj, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.count[name] += 1
            self.threads.add(threading.current_thread().name)
            return fn(*args, **kwargs)
        return counted


def run(main):
    async def bounded():
        return await asyncio.wait_for(main(), TIMEOUT_S)
    return asyncio.run(bounded())


def test_text_is_tokenized_with_the_tokenizers_rules(engine):
    p = engine.processor.process(PROMPT)
    assert p == ProcessedPrompt(engine.tokenizer.encode(PROMPT), PROMPT)
    literal = "a <|im_end|> b"
    assert engine.processor.process(literal).token_ids == engine.tokenizer.encode(literal)
    split = engine.processor.process(literal, split_special_tokens=True)
    assert split.token_ids == engine.tokenizer.encode(literal, split_special_tokens=True)
    assert split.token_ids != engine.tokenizer.encode(literal)


def test_chat_contents_are_text_and_control_tokens_come_from_the_template(engine):
    messages = [{"role": "user", "content": "say <|im_end|> please"}]
    p = engine.processor.process_chat(messages)
    assert p.token_ids == engine.tokenizer.encode_chat(messages) and p.text is None
    im_end = engine.tokenizer.token_to_id("<|im_end|>")
    plain = engine.tokenizer.encode_chat([{"role": "user", "content": "say please"}])
    assert p.token_ids.count(im_end) == plain.count(im_end)  # the template's own only


@pytest.mark.parametrize("bad", [[1, -1], [1, 10**9], [True, 2], [1.0], "", 3, None])
def test_bad_prompts_are_refused_with_the_prompt_field(engine, bad):
    with pytest.raises(InvalidArgument) as e:
        engine.processor.process(bad)
    assert e.value.metadata["field"] == "prompt"


def test_a_processed_prompt_passes_as_it_is(engine):
    processor = InputProcessor(engine.tokenizer, vocab_size=8)
    p = ProcessedPrompt([5, 6, 7])
    assert processor.process(p) is p


@pytest.mark.parametrize("n", [1, 3])
def test_one_request_through_the_async_engine_tokenizes_its_prompt_once(engine, monkeypatch,
                                                                         n):
    calls = Calls(monkeypatch, engine)
    allm = AsyncLLM(engine)
    try:
        async def main():
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, n=n,
                                    seed=1)
            return [out async for _, out in generate_candidates(allm, PROMPT, params,
                                                                request_id=f"once-{n}")]
        outs = run(main)
    finally:
        allm.shutdown()
    assert sum(o.finished for o in outs) == n
    assert calls.count == Counter(encode=1)
    assert "tessera-engine" not in calls.threads


def test_token_ids_are_checked_once_and_not_on_the_engine_thread(engine, monkeypatch):
    ids = engine.tokenizer.encode(PROMPT)
    calls = Calls(monkeypatch, engine)
    allm = AsyncLLM(engine)
    try:
        async def main():
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, n=2)
            return [out async for _, out in generate_candidates(allm, ids, params,
                                                                request_id="ids-once")]
        run(main)
    finally:
        allm.shutdown()
    assert calls.count == Counter(check_ids=1)
    assert "tessera-engine" not in calls.threads


def test_the_offline_api_tokenizes_each_prompt_once(llm, engine, monkeypatch):
    calls = Calls(monkeypatch, engine)
    outs = llm.generate([PROMPT, "Water boils at"], dataclasses.replace(SHORT, n=2))
    assert len(outs) == 2 and all(len(o.outputs) == 2 for o in outs)
    assert calls.count == Counter(encode=2)
    llm.chat([{"role": "user", "content": "hi"}], SHORT)
    assert calls.count == Counter(encode=2, encode_chat=1)
