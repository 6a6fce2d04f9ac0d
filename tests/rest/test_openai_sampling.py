"""`n`, logprobs, min_tokens, lists of prompts and tool messages through the official `openai`
client, against the real stack (gateway, worker process, shim on loopback); the same fields on
the gRPC SDK; bad input as typed 400s."""

from __future__ import annotations

import math

import openai
import pytest

from gateway.client import NO_RETRY, Client
from tests.rest.conftest import KEYS, MODEL
from tests.rest.test_openai_client import LONG_PROMPT, make_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CHAT = [{"role": "user", "content": "Invent a name for a cat."}]
# The offline engine and the worker run the same fp32 model on the same CPU, but in batches
# of other shapes: logprobs agree to float32 rounding, far below this.
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def oai(shim) -> openai.OpenAI:
    return make_client(shim)


def test_n3_seeded_chat_gives_three_candidates_with_usage_and_streams_them_by_index(oai):
    kwargs = dict(model=MODEL, messages=CHAT, n=3, seed=7, temperature=1.0, max_tokens=4,
                  extra_body={"ignore_eos": True})
    done = oai.chat.completions.create(**kwargs)
    assert [c.index for c in done.choices] == [0, 1, 2]
    texts = [c.message.content for c in done.choices]
    assert len(set(texts)) == 3, texts
    single = oai.chat.completions.create(**{**kwargs, "n": 1})
    assert single.choices[0].message.content == texts[0]  # candidate 0 is seed itself
    assert done.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert done.usage.completion_tokens == 12
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12
    chunks = list(oai.chat.completions.create(**kwargs, stream=True,
                                              stream_options={"include_usage": True}))
    streamed = {i: "" for i in range(3)}
    ends = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        streamed[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            ends[choice.index] = choice.finish_reason
    assert [streamed[i] for i in range(3)] == texts  # the same seeds, the same candidates
    assert ends == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 12


def test_top_logprobs_equal_the_offline_engine_for_the_same_request(oai, llm, one_torch_thread):
    from runtime.sampling_params import SamplingParams

    done = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=5,
                                       extra_body={"ignore_eos": True})
    served = done.choices[0].logprobs.content
    [offline] = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=4, logprobs=5,
                                              ignore_eos=True))
    out = offline.outputs[0]
    assert len(served) == len(out.token_ids) == 4
    decode = llm.tokenizer.decode
    for entry, token_id, lps in zip(served, out.token_ids, out.logprobs, strict=True):
        assert entry.token == decode([token_id], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - lps[token_id]) < LOGPROB_TOL
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:5]
        assert [t.token for t in entry.top_logprobs] == [decode([t]) for t, _ in top]
        for got, (_, want) in zip(entry.top_logprobs, top, strict=True):
            assert abs(got.logprob - want) < LOGPROB_TOL
    assert "".join(e.token for e in served) == done.choices[0].message.content


def test_streamed_chat_logprobs_equal_the_unstreamed_ones(oai):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                  top_logprobs=2)
    whole = oai.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [e for c in oai.chat.completions.create(**kwargs, stream=True)
                for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert [(e.token, e.logprob, len(e.top_logprobs)) for e in streamed] == \
        [(e.token, e.logprob, 2) for e in whole]


def test_completions_take_a_list_of_prompts_with_n_and_legacy_logprobs(oai):
    prompts = ["The capital of France is", "Once upon a time"]
    done = oai.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=3, seed=3,
                                  temperature=0.9, logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in done.choices] == [0, 1, 2, 3]  # prompt k, candidate i: k * n + i
    alone = [oai.completions.create(model=MODEL, prompt=p, n=2, max_tokens=3, seed=3,
                                    temperature=0.9, extra_body={"ignore_eos": True})
             for p in prompts]
    assert [c.text for c in done.choices] == [c.text for a in alone for c in a.choices]
    assert done.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert done.usage.completion_tokens == 12
    for c in done.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                     strict=True):
            assert value <= 0 and math.isfinite(value) and top[token] == value
            assert 3 <= len(top) <= 4  # the top 3 and the chosen token


def test_streamed_completions_of_two_prompts_carry_each_choice_index(oai):
    chunks = list(oai.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=3,
                                         temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}))
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_min_tokens_holds_off_the_stop_string(oai):
    kwargs = dict(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=8, temperature=0)
    text = oai.completions.create(**kwargs).choices[0].text
    stop = text.strip()[:1]
    assert stop
    cut = oai.completions.create(**kwargs, stop=[stop]).choices[0]
    held = oai.completions.create(**kwargs, stop=[stop], extra_body={"min_tokens": 6})
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert stop in held.choices[0].text and held.usage.completion_tokens >= 6


def test_a_tool_result_message_is_accepted_and_rendered(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "Let me check."},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    done = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                       temperature=0)
    assert done.choices[0].message.content is not None
    plain = oai.chat.completions.create(model=MODEL, messages=messages[:2], max_tokens=3,
                                        temperature=0)
    assert done.usage.prompt_tokens > plain.usage.prompt_tokens  # the tool turn was rendered


@pytest.mark.parametrize("route,body,param", [
    ("chat", {"n": 0}, "n"), ("chat", {"n": 17}, "n"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, None),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    ("completions", {"logprobs": 21}, "logprobs"), ("completions", {"n": 17}, "n"),
    ("completions", {"prompt": ["a"] * 17}, "prompt"),
    ("completions", {"min_tokens": 9, "max_tokens": 8}, "min_tokens")])
def test_bad_sampling_input_is_a_typed_400(oai, route, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            oai.chat.completions.create(**{"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                           **body})
        else:
            extra = {"min_tokens": body.pop("min_tokens")} if "min_tokens" in body else None
            oai.completions.create(**{"model": MODEL, "prompt": "Hi", "max_tokens": 2, **body},
                                   extra_body=extra)
    error = info.value.body
    assert error["reason"] == "INVALID_ARGUMENT" and info.value.status_code == 400
    if param is not None:
        assert (error["param"] or "").startswith(param), error


def test_the_sdk_streams_candidates_with_logprobs_and_shares_the_prompt_pages(shim):
    with Client(shim.runner.target, api_key=KEYS["acme"], retry=NO_RETRY) as c:
        # NOTE: the marker leads, so no earlier test's LONG_PROMPT pages are a prefix of it.
        stream = c.generate("(sdk) " + LONG_PROMPT, model=MODEL, n=2, seed=5, max_tokens=3,
                            logprobs=1, ignore_eos=True)
        chunks = list(stream)
    assert {ch.index for ch in chunks} == {0, 1}
    assert all(len(ch.logprobs or []) == len(ch.token_ids) for ch in chunks)
    assert sorted(ch.index for ch in chunks if ch.finish_reason) == [0, 1]
    first, second = stream.candidates
    assert first.cached_tokens == 0 and second.cached_tokens > 0  # candidate 1 hit 0's pages
    assert stream.usage.completion_tokens == 6
    assert set(stream.texts) == {0, 1}
