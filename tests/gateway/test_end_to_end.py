"""Through the SDK, a real gateway and two real worker processes: parity with the offline
engine, usage and cached tokens, session affinity, health, reflection and model listing."""

from __future__ import annotations

import re

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.client import Client
from runtime.sampling_params import SamplingParams
from tests.gateway.conftest import KEYS, MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
# Long enough for two full KV pages of 16 tokens: the second request of a session reuses them.
LONG_PROMPT = ("You are a careful assistant. Answer in one short sentence, with no preamble "
               "and no list. The question is about geography and history, and it is asked by "
               "a student: which river flows through the city of Paris, and where does it end?")


@pytest.fixture(scope="module")
def client(two_workers):
    with Client(two_workers.target, api_key=KEYS["acme"]) as c:
        yield c


def test_streamed_greedy_output_equals_offline_engine(client, llm) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    offline = llm.generate(PROMPTS, params)
    for prompt, expected in zip(PROMPTS, offline, strict=True):
        stream = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
        chunks = list(stream)
        assert [t for c in chunks for t in c.token_ids] == expected.outputs[0].token_ids
        assert "".join(c.text for c in chunks) == expected.outputs[0].text
        assert len(chunks) > 1, "the output must arrive as a stream, not one message"
        assert stream.finish_reason == "length"
        assert stream.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert stream.usage.completion_tokens == 12


def test_chat_equals_offline_chat(client, llm) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    expected = llm.chat(messages, SamplingParams(max_tokens=10, temperature=0.0))[0]
    stream = client.chat(messages, max_tokens=10, temperature=0.0)
    assert "".join(c.text for c in stream) == expected.outputs[0].text
    assert stream.token_ids == expected.outputs[0].token_ids


def test_second_request_of_a_session_reports_cached_tokens(client) -> None:
    session = client.session()
    first = session.generate(LONG_PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
    list(first)
    second = session.generate(LONG_PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
    list(second)
    assert first.usage.cached_tokens == 0
    assert first.usage.prompt_tokens == second.usage.prompt_tokens >= 32
    # Full pages of the prompt are reused; the last prompt token is always recomputed.
    assert second.usage.cached_tokens == (second.usage.prompt_tokens - 1) // 16 * 16
    assert second.served.worker_id == first.served.worker_id
    assert second.text == first.text


def test_other_tenant_gets_no_cache_hit_for_the_same_prompt(two_workers, client) -> None:
    session = client.session()
    list(session.generate(LONG_PROMPT + " Twice.", max_tokens=2, temperature=0.0))
    with Client(two_workers.target, api_key=KEYS["bob"]) as bob:
        stream = bob.generate(LONG_PROMPT + " Twice.", max_tokens=2, temperature=0.0,
                              session=session.id)
        list(stream)
    assert stream.usage.cached_tokens == 0


def test_without_session_a_repeated_long_prompt_goes_where_its_prefix_is_cached(client) -> None:
    prompt = LONG_PROMPT + " Answer for a child."
    first = client.generate(prompt, max_tokens=2, temperature=0.0)
    list(first)
    second = client.generate(prompt, max_tokens=2, temperature=0.0)
    list(second)
    assert second.served.worker_id == first.served.worker_id
    assert second.usage.cached_tokens > 0


def test_session_requests_land_on_one_worker(client) -> None:
    for name in ("alpha", "beta", "gamma"):
        session = client.session(name)
        workers = set()
        for _ in range(3):
            stream = session.generate("Hi", max_tokens=1)
            list(stream)
            workers.add(stream.served.worker_id)
        assert len(workers) == 1


def test_final_message_carries_served_configuration(client) -> None:
    stream = client.generate("Hello", max_tokens=2)
    list(stream)
    served = stream.served
    assert served.model == MODEL  # the id clients use, as in ListModels
    assert served.revision.startswith("SmolLM2-135M-Instruct")
    # the default GGUF is served as its own blocks: the label says so, not "fp32"
    assert served.prefill_weights == served.decode_weights
    assert re.fullmatch(r"gguf-(Q\w+\+?)+-(int8x2|float32)", served.decode_weights)
    assert (served.prefill_kv_cache, served.decode_kv_cache) == ("fp32", "fp32")
    assert served.worker_id.startswith(MODEL)


def test_list_models_health_and_reflection(two_workers, client) -> None:
    [model] = client.list_models()
    assert model.id == MODEL and model.ready_workers == 2 and model.max_model_len == 1456
    with grpc.insecure_channel(two_workers.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tessera.v1.Gateway"), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        [resp] = list(reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in resp.list_services_response.service}
        assert "tessera.v1.Gateway" in names and "grpc.health.v1.Health" in names


def test_gateway_keeps_per_tenant_usage_totals(two_workers, client) -> None:
    before = dict(two_workers.gateway.usage["acme"])
    stream = client.generate("Count to three:", max_tokens=3, temperature=0.0, ignore_eos=True)
    list(stream)
    after = two_workers.gateway.usage["acme"]
    assert after["completion_tokens"] - before.get("completion_tokens", 0) == 3
    assert after["prompt_tokens"] - before.get("prompt_tokens", 0) == stream.usage.prompt_tokens


def test_async_client_streams_the_same_tokens(two_workers, client) -> None:
    import asyncio

    from gateway.client import AsyncClient

    sync = client.generate(PROMPTS[0], max_tokens=6, temperature=0.0, ignore_eos=True)
    list(sync)

    async def run():
        async with AsyncClient(two_workers.target, api_key=KEYS["acme"]) as ac:
            stream = ac.generate(PROMPTS[0], max_tokens=6, temperature=0.0, ignore_eos=True)
            texts = [chunk.text async for chunk in stream]
            return stream, texts

    stream, texts = asyncio.run(run())
    assert stream.token_ids == sync.token_ids and "".join(texts) == sync.text
    assert stream.usage == sync.usage


def test_prometheus_metrics_cover_requests_tokens_workers_and_pages(two_workers, client) -> None:
    from prometheus_client import REGISTRY

    from tests.gateway.conftest import wait_for

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = value("tessera_gateway_requests_total", model=MODEL, reason="OK")
    list(client.generate("Hello", max_tokens=2))
    assert value("tessera_gateway_requests_total", model=MODEL, reason="OK") == before + 1
    assert value("tessera_gateway_tokens_total", tenant="acme", kind="completion") >= 2
    assert value("tessera_gateway_ttft_seconds_count", model=MODEL) >= 1
    assert value("tessera_gateway_workers", model=MODEL, state="ready") == 2
    assert value("tessera_gateway_worker_cold_start_seconds_count", model=MODEL) >= 2
    worker = next(iter(two_workers.gateway.pools[MODEL].ready())).id
    wait_for(lambda: value("tessera_worker_kv_pages", model=MODEL, worker=worker,
                           state="free") > 0, 10, "the worker status poll")
    assert value("tessera_worker_integrity", model=MODEL, worker=worker, kind="checks") > 0
    # where the engine's time went (runtime/step_times.py), through the worker's Status
    assert value("tessera_worker_engine_steps", model=MODEL, worker=worker, kind="mixed") >= 1
    assert value("tessera_worker_engine_step_seconds", model=MODEL, worker=worker,
                 kind="mixed", part="compute") > 0
    assert value("tessera_worker_engine_step_tokens", model=MODEL, worker=worker,
                 kind="mixed", tokens="prefill") > 0
    assert value("tessera_worker_engine_loop_seconds", model=MODEL, worker=worker,
                 part="cpu") > 0


def test_gateway_logs_are_json_with_request_tenant_and_worker_and_no_key(client, capfd) -> None:
    import json

    stream = client.generate("Hello", max_tokens=1)
    list(stream)
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines()
             if line.startswith("{")]
    done = [r for r in lines if r.get("event") == "request done"]
    assert done and done[-1]["tenant"] == "acme"
    assert done[-1]["worker"] == stream.served.worker_id and done[-1]["request_id"]
    assert not any(KEYS["acme"] in json.dumps(r) for r in lines)
