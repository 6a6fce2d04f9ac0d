"""Prefill/decode pools through the public routes (the official `openai` client, plain HTTP SSE
and the SDK), over real worker processes: one gateway serves `PD` from a prefill worker and a
decode worker and `COLO` from one colocated worker, all BF16 KV, the same model. Every answer
from the pools must be the colocated answer: greedy, seeded, structured (json_schema and a
forced tool call), with stop strings (one across the first token), streamed and not, logprobs
included. The first token is sampled by the prefill worker and everything after it by the
decode worker, so each test reaches past the hand-over."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from gateway.client import NO_RETRY, Client
from gateway.rest import GatewayView, RestServer
from gateway.runner import GatewayRunner
from gateway.supervisor import PoolConfig
from tests.gateway.conftest import KEYS, api_keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PD, COLO = "smollm2-pd", "smollm2-colo"
BF16 = ("--kv-cache-dtype", "bf16")
CHAT = [{"role": "user", "content": "Describe the moon in one sentence."}]
PROMPT = "The moon is"
SEEDED = {"temperature": 1.0, "seed": 7, "max_tokens": 12}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
LOGPROB_TOL = 1e-3  # the same BF16 KV and model on one CPU: float32 rounding at most


@dataclass
class Served:
    runner: GatewayRunner
    server: RestServer

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.server.url}/v1", api_key=KEYS["acme"],
                             max_retries=0, timeout=120)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.server.url + path, json=body, timeout=120,
                          headers={"authorization": f"Bearer {KEYS['acme']}"})

    def sdk(self) -> Client:
        return Client(self.runner.target, api_key=KEYS["acme"], retry=NO_RETRY)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    common = dict(max_inflight=4, min_workers=1, max_workers=1, worker_threads=1,
                  kv_cache_bytes=32 << 20, worker_args=BF16)
    pools = [PoolConfig(PD, role="prefill", **common), PoolConfig(PD, role="decode", **common),
             PoolConfig(COLO, **common)]
    runner = GatewayRunner(pools, api_keys()).start()
    assert runner.gateway is not None
    server = RestServer(runner.target, port=0, view=GatewayView(runner.gateway, runner.loop))
    runner.call(server.start())
    yield Served(runner, server)
    runner.call(server.stop())
    runner.stop()


@pytest.fixture(scope="module")
def oai(served) -> openai.OpenAI:
    return served.openai()


def _chat(oai: openai.OpenAI, model: str, **kwargs: object) -> openai.types.chat.ChatCompletion:
    return oai.chat.completions.create(model=model, messages=CHAT, **kwargs)  # type: ignore


def _streamed_chat(oai: openai.OpenAI, model: str, **kwargs: object) -> tuple[str, list]:
    """(the streamed content, every chunk's choices)"""
    chunks = list(oai.chat.completions.create(model=model, messages=CHAT, stream=True,
                                              **kwargs))  # type: ignore
    choices = [c for chunk in chunks for c in chunk.choices]
    return "".join(c.delta.content or "" for c in choices), choices


def _sse(served: Served, path: str, body: dict) -> list[dict]:
    r = served.post(path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    data = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _finish_reasons(choices: list) -> list[str | None]:
    return [c.finish_reason for c in choices]


# -- 1. structured output across the hand-over ----------------------------------------------


def test_json_schema_answer_is_the_colocated_one(oai) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    kwargs = dict(response_format=fmt, max_tokens=48, temperature=0)
    want = _chat(oai, COLO, **kwargs).choices[0]
    got = _chat(oai, PD, **kwargs).choices[0]
    assert json.loads(want.message.content).keys() == {"name", "age"}
    assert (got.message.content, got.finish_reason) == (want.message.content,
                                                         want.finish_reason)
    streamed, _ = _streamed_chat(oai, PD, **kwargs)
    assert streamed == want.message.content


def test_forced_tool_call_is_the_colocated_one(oai) -> None:
    kwargs = dict(tools=[WEATHER], max_tokens=64, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    want = _chat(oai, COLO, **kwargs).choices[0]
    got = _chat(oai, PD, **kwargs).choices[0]
    assert want.message.tool_calls and want.message.content is None
    assert got.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in got.message.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in want.message.tool_calls]
    assert got.finish_reason == want.finish_reason


# -- 2. a stream ends once ------------------------------------------------------------------


def test_sse_stream_says_it_ended_only_on_its_last_chunk(served) -> None:
    body = {"model": PD, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    choices = [c for e in _sse(served, "/v1/chat/completions", body) for c in e["choices"]]
    reasons = [c["finish_reason"] for c in choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}, reasons
    want = [c for e in _sse(served, "/v1/chat/completions", {**body, "model": COLO})
            for c in e["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in choices) == \
        "".join(c["delta"].get("content") or "" for c in want)


def test_sdk_stream_says_it_ended_only_on_its_last_chunk(served) -> None:
    with served.sdk() as sdk:
        stream = sdk.generate(PROMPT, model=PD, max_tokens=8, temperature=0.0, ignore_eos=True)
        chunks = list(stream)
    reasons = [c.finish_reason for c in chunks]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}, reasons
    assert stream.finish_reason == "length" and stream.usage.completion_tokens == 8


# -- 3. stop strings ------------------------------------------------------------------------


def _colocated_first_tokens(served: Served) -> list[str]:
    """The colocated greedy answer to PROMPT, one text per token (no stop string: no holdback)."""
    with served.sdk() as sdk:
        chunks = list(sdk.generate(PROMPT, model=COLO, max_tokens=6, temperature=0.0,
                                   ignore_eos=True))
    texts = [c.text for c in chunks]
    assert all(len(c.token_ids) == 1 for c in chunks) and all(texts[:3]), texts
    return texts


def test_a_stop_string_does_not_repeat_the_first_token(served, oai) -> None:
    stop = "\n\n\n"  # never reached: only its holdback is in play
    kwargs = dict(max_tokens=10, temperature=0, stop=[stop])
    want = oai.completions.create(model=COLO, prompt=PROMPT, **kwargs).choices[0].text
    got = oai.completions.create(model=PD, prompt=PROMPT, **kwargs).choices[0].text
    assert got == want
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=PD, prompt=PROMPT, stream=True, **kwargs) if c.choices)
    assert streamed == want


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_across_the_first_token_cuts_as_colocated(served, oai, stream) -> None:
    first, second = _colocated_first_tokens(served)[:2]
    stop = first[-1] + second[:2]  # begins in the prefill worker's token, ends in the decode's
    kwargs = dict(max_tokens=10, temperature=0, stop=[stop])
    want = oai.completions.create(model=COLO, prompt=PROMPT, **kwargs).choices[0]
    assert want.finish_reason == "stop" and want.text == first[:-1]
    if stream:
        chunks = [c.choices[0] for c in oai.completions.create(
            model=PD, prompt=PROMPT, stream=True, **kwargs) if c.choices]
        text, reason = "".join(c.text for c in chunks), chunks[-1].finish_reason
    else:
        got = oai.completions.create(model=PD, prompt=PROMPT, **kwargs).choices[0]
        text, reason = got.text, got.finish_reason
    assert (text, reason) == (want.text, "stop")


# -- 4. seeded sampling ---------------------------------------------------------------------


def test_seeded_chat_is_the_colocated_answer(oai) -> None:
    want = _chat(oai, COLO, **SEEDED).choices[0].message.content
    assert _chat(oai, PD, **SEEDED).choices[0].message.content == want
    assert _streamed_chat(oai, PD, **SEEDED)[0] == want


def test_seeded_sdk_tokens_are_the_colocated_ones(served) -> None:
    with served.sdk() as sdk:
        runs = {m: [t for c in sdk.generate(PROMPT, model=m, ignore_eos=True, **SEEDED)
                    for t in c.token_ids] for m in (COLO, PD)}
    assert len(runs[COLO]) == SEEDED["max_tokens"] and runs[PD] == runs[COLO]


# -- 5. logprobs and n ----------------------------------------------------------------------


def test_logprobs_are_the_colocated_ones_first_token_included(oai) -> None:
    kwargs = dict(max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    want = _chat(oai, COLO, **kwargs).choices[0].logprobs.content
    for got in (_chat(oai, PD, **kwargs).choices[0].logprobs.content,
                [lp for c in _streamed_chat(oai, PD, **kwargs)[1] if c.logprobs
                 for lp in c.logprobs.content]):
        assert [e.token for e in got] == [e.token for e in want] and len(want) == 6
        for g, w in zip(got, want, strict=True):
            assert abs(g.logprob - w.logprob) < LOGPROB_TOL
            assert [t.token for t in g.top_logprobs] == [t.token for t in w.top_logprobs]


def test_n_above_one_is_a_typed_400_from_the_pools(oai) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(oai, PD, n=2, max_tokens=4)
    assert info.value.body["param"] == "n"  # type: ignore[index]


# -- the rest of the request's state --------------------------------------------------------


def test_penalties_min_tokens_and_stop_token_ids_cross_the_hand_over(served) -> None:
    with served.sdk() as sdk:
        probe = [t for c in sdk.generate(PROMPT, model=COLO, max_tokens=8, temperature=0.0)
                 for t in c.token_ids]
        kwargs = dict(max_tokens=16, temperature=0.0, repetition_penalty=1.3,
                      frequency_penalty=0.5, presence_penalty=0.4, min_tokens=4,
                      stop_token_ids=[probe[4]])
        runs = {}
        for m in (COLO, PD):
            stream = sdk.generate(PROMPT, model=m, **kwargs)
            runs[m] = ([t for c in stream for t in c.token_ids], stream.finish_reason,
                       stream.usage.completion_tokens, stream.usage.prompt_tokens)
    assert runs[PD] == runs[COLO]
