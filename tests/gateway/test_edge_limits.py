"""What a client sends never changes which error another input gets: oversize prompts, model
ids, session ids and keys, and bytes that are not a message, are refused with a typed,
non-retryable INVALID_ARGUMENT whatever their size; sessions are scoped per tenant; a stream
the client cuts short is billed for what it cost; and the gateway keeps serving."""

from __future__ import annotations

import grpc
import pytest

from gateway.client import NO_RETRY, Client, InvalidArgument, ModelNotFound
from gateway.errors import from_rpc_error
from gateway.grpc_server import MAX_NAME_BYTES, MAX_PROMPT_BYTES, session_key
from tests.gateway.conftest import KEYS, requests_drained, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def client(two_workers):
    with Client(two_workers.target, api_key=KEYS["acme"], retry=NO_RETRY) as c:
        yield c


def _refusal(stream) -> Exception:
    with pytest.raises(Exception) as info:
        list(stream)
    return info.value


@pytest.mark.parametrize("size", [MAX_PROMPT_BYTES + 1, 5 << 20, 20 << 20])
def test_an_oversize_prompt_is_invalid_argument_at_any_size(client, size) -> None:
    error = _refusal(client.generate("x" * size, max_tokens=1))
    assert type(error) is InvalidArgument and not error.retryable
    assert len(str(error)) < 2000


def test_oversize_chat_contents_are_invalid_argument(client) -> None:
    messages = [{"role": "user", "content": "y" * (MAX_PROMPT_BYTES // 2 + 1)}] * 2
    assert type(_refusal(client.chat(messages, max_tokens=1))) is InvalidArgument


@pytest.mark.parametrize("size", [MAX_NAME_BYTES + 1, 5_000, 60_000])
def test_an_oversize_model_id_is_invalid_argument(client, size) -> None:
    error = _refusal(client.generate("Hi", model="m" * size, max_tokens=1))
    assert type(error) is InvalidArgument and error.metadata.get("field") == "model"


def test_an_unknown_model_id_is_not_found_and_not_echoed_whole(client) -> None:
    error = _refusal(client.generate("Hi", model="m" * MAX_NAME_BYTES, max_tokens=1))
    assert type(error) is ModelNotFound and len(error.message) < 1100


@pytest.mark.parametrize("size", [MAX_NAME_BYTES + 1, 6_000, 100_000])
def test_an_oversize_session_id_is_invalid_argument(client, size) -> None:
    error = _refusal(client.generate("Hi", session="s" * size, max_tokens=1))
    assert type(error) is InvalidArgument and not error.retryable


@pytest.mark.parametrize("size", [10_000, 100_000])
def test_an_oversize_api_key_is_refused_without_a_retry_hint(two_workers, size) -> None:
    with Client(two_workers.target, api_key="k" * size, retry=NO_RETRY) as c:
        error = _refusal(c.generate("Hi", max_tokens=1))
    assert error.reason in ("UNAUTHENTICATED", "INVALID_ARGUMENT") and not error.retryable


def test_bytes_that_are_not_a_message_get_invalid_argument(two_workers) -> None:
    with grpc.insecure_channel(two_workers.target) as channel:
        call = channel.unary_stream("/tessera.v1.Gateway/Generate")
        with pytest.raises(grpc.RpcError) as info:
            list(call(b"\xff\xff\xff\xff\x0f garbage",
                      metadata=(("authorization", f"Bearer {KEYS['acme']}"),)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert type(from_rpc_error(info.value)) is InvalidArgument


def test_session_keys_are_per_tenant_and_of_fixed_size() -> None:
    alpha, beta = session_key("alpha", "shared-id"), session_key("beta", "shared-id")
    assert alpha != beta
    assert len(session_key("alpha", "s" * MAX_NAME_BYTES)) == len(alpha) == 32
    assert session_key("alpha", None) is None


def test_a_stream_cut_short_is_billed_for_what_it_generated(two_workers, client) -> None:
    usage = two_workers.gateway.usage["acme"]
    before = dict(usage)
    stream = client.generate("Count slowly to fifty:", max_tokens=200, ignore_eos=True)
    received = 0
    for chunk in stream:
        received += len(chunk.token_ids)
        if received >= 5:
            break
    stream.cancel()
    wait_for(lambda: usage["completion_tokens"] > before.get("completion_tokens", 0), 30,
             "the cut-short stream to be billed")
    assert usage["prompt_tokens"] > before.get("prompt_tokens", 0)
    assert usage["completion_tokens"] - before.get("completion_tokens", 0) >= received
    wait_for(lambda: requests_drained(two_workers), 30, "the worker to drop the request")


def test_the_gateway_still_serves_after_all_of_that(client) -> None:
    stream = client.generate("The capital of France is", max_tokens=4, temperature=0.0)
    assert "".join(c.text for c in stream).strip()
