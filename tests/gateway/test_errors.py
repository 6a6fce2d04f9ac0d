"""Every error reason, produced through the real gateway, arrives at the SDK as its class."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from gateway.client import (
    NO_RETRY,
    Client,
    ContextLengthExceeded,
    DeadlineExceeded,
    InvalidArgument,
    KVIntegrityViolation,
    ModelNotFound,
    Overloaded,
    PermissionDenied,
    RequestCancelled,
    RetryPolicy,
    TenantQuotaExceeded,
    TesseraError,
    Unauthenticated,
)
from tests.gateway.conftest import KEYS, MODEL, requests_drained, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def client_for(runner, tenant: str = "acme", key: str | None = None, **kw) -> Client:
    return Client(runner.target, api_key=key or KEYS[tenant], retry=NO_RETRY, **kw)


def expect(cls: type[TesseraError], stream) -> TesseraError:
    with pytest.raises(cls) as info:
        list(stream)
    assert type(info.value) is cls
    assert info.value.reason == cls.reason
    return info.value


def test_unknown_key_is_unauthenticated(two_workers) -> None:
    def usage() -> dict[str, dict[str, int]]:
        return {t: dict(c) for t, c in two_workers.gateway.usage.items()}

    before = usage()
    with client_for(two_workers, key="not-a-key-0123") as c:
        stream = c.generate("Hi", max_tokens=2)
        err = expect(Unauthenticated, stream)
    assert stream.token_ids == [] and stream.usage is None  # refused before any worker ran
    assert "not-a-key-0123" not in str(err) and "not-a-key-0123" not in str(err.metadata)
    assert usage() == before  # no tenant was charged


def test_model_outside_the_tenants_list_is_permission_denied(two_workers) -> None:
    with client_for(two_workers, "other") as c:
        err = expect(PermissionDenied, c.generate("Hi", max_tokens=2))
    assert err.metadata["model"] == MODEL


def test_unknown_model_is_model_not_found(two_workers) -> None:
    with client_for(two_workers) as c:
        err = expect(ModelNotFound, c.generate("Hi", model="no-such-model", max_tokens=2))
    assert err.metadata["model"] == "no-such-model"


def test_bad_sampling_value_is_invalid_argument_with_its_field(two_workers) -> None:
    with client_for(two_workers) as c:
        err = expect(InvalidArgument, c.generate("Hi", max_tokens=2, temperature=-1.0))
    assert err.metadata["field"] == "temperature"


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": -1}, "max_tokens"), ({"min_tokens": 2**40}, "min_tokens"),
    ({"seed": -1}, "seed"), ({"temperature": "hot"}, "temperature")])
def test_value_the_wire_cannot_hold_is_invalid_argument_before_any_call(kwargs, field) -> None:
    from gateway.errors import REASONS

    # Nothing listens on this target: a call would end UNAVAILABLE, not INVALID_ARGUMENT.
    with Client("127.0.0.1:1", api_key="k", retry=NO_RETRY) as c:
        for call in (lambda: c.generate("Hi", **kwargs),
                     lambda: c.chat([{"role": "user", "content": "Hi"}], **kwargs)):
            with pytest.raises(InvalidArgument) as info:
                call()
            assert type(info.value) is REASONS["INVALID_ARGUMENT"][0]
            assert info.value.metadata["field"] == field and field in str(info.value)


def test_max_tokens_the_wire_cannot_hold_is_context_length_exceeded_before_any_call() -> None:
    # The class the server gives any max_tokens past the context (an InvalidArgument too).
    with Client("127.0.0.1:1", api_key="k", retry=NO_RETRY) as c:
        for max_tokens in (2**32, 2**40):
            with pytest.raises(ContextLengthExceeded) as info:
                c.generate("Hi", max_tokens=max_tokens)
            assert isinstance(info.value, InvalidArgument)
            assert info.value.metadata["field"] == "max_tokens"


def test_token_id_the_wire_cannot_hold_is_invalid_argument_before_any_call() -> None:
    with Client("127.0.0.1:1", api_key="k", retry=NO_RETRY) as c, \
            pytest.raises(InvalidArgument) as info:
        c.generate([1, -2], max_tokens=2)
    assert info.value.metadata["field"] == "prompt_token_ids"


def test_unknown_chat_role_is_invalid_argument_with_its_field(two_workers) -> None:
    with client_for(two_workers) as c:
        err = expect(InvalidArgument,
                     c.chat([{"role": "wizard", "content": "Hi"}], max_tokens=1))
    assert err.metadata["field"] == "messages[0].role"
    assert "system, developer, user, assistant, tool" in err.message


def test_too_long_prompt_is_context_length_exceeded(two_workers) -> None:
    with client_for(two_workers) as c:
        err = expect(ContextLengthExceeded, c.generate([100] * 1500, max_tokens=2))
    assert err.metadata == {"prompt_tokens": "1500", "max_model_len": "1456"}


def test_request_larger_than_the_tenant_quota_is_refused(two_workers) -> None:
    with client_for(two_workers) as c:
        err = expect(TenantQuotaExceeded, c.generate("Hi", max_tokens=1200))
    assert err.metadata["tenant"] == "acme"


def test_corrupted_page_mid_stream_is_kv_integrity_violation(two_workers) -> None:
    with client_for(two_workers, "drill") as c:
        prompt = "Tell me a long story about a dragon who guards a library of old books. " * 2
        stream = c.generate(prompt, max_tokens=64, ignore_eos=True)
        err = expect(KVIntegrityViolation, stream)
    assert err.metadata["cause"] and "page_id" in err.metadata
    assert len(stream.token_ids) < 64, "no token computed from the bad page may come out"
    wait_for(lambda: requests_drained(two_workers), 30, "the aborted request's pages")


def requests_total(reason: str) -> float:
    from prometheus_client import REGISTRY

    labels = {"model": MODEL, "reason": reason}
    return REGISTRY.get_sample_value("tessera_gateway_requests_total", labels) or 0.0


def test_client_deadline_is_deadline_exceeded_and_frees_the_request(two_workers) -> None:
    before = {r: requests_total(r) for r in ("DEADLINE_EXCEEDED", "CANCELLED")}
    with client_for(two_workers) as c:
        start = time.monotonic()
        stream = c.generate("Count:", max_tokens=600, ignore_eos=True, timeout_s=1.0)
        expect(DeadlineExceeded, stream)
        elapsed_s = time.monotonic() - start
    assert elapsed_s < 10, "the deadline ended the call, not the 600 tokens"
    assert len(stream.token_ids) < 600 and stream.usage is None
    wait_for(lambda: requests_drained(two_workers), 30, "the worker to abort the request")
    wait_for(lambda: requests_total("DEADLINE_EXCEEDED") == before["DEADLINE_EXCEEDED"] + 1, 10,
             "the gateway to count the request DEADLINE_EXCEEDED")
    assert requests_total("CANCELLED") == before["CANCELLED"]


def test_client_cancel_is_cancelled_and_frees_the_request(two_workers) -> None:
    before = {r: requests_total(r) for r in ("DEADLINE_EXCEEDED", "CANCELLED")}
    with client_for(two_workers) as c:
        stream = c.generate("Count:", max_tokens=600, ignore_eos=True, timeout_s=60)
        chunks = iter(stream)
        next(chunks), next(chunks)
        stream.cancel()
        with pytest.raises(RequestCancelled):
            next(chunks)
    wait_for(lambda: requests_drained(two_workers), 30, "the worker to abort the request")
    wait_for(lambda: requests_total("CANCELLED") == before["CANCELLED"] + 1, 10,
             "the gateway to count the request CANCELLED")
    assert requests_total("DEADLINE_EXCEEDED") == before["DEADLINE_EXCEEDED"]


def requests_counted() -> float:
    return sum(requests_total(r) for r in ("OK", "CANCELLED", "DEADLINE_EXCEEDED"))


def test_a_stream_is_single_use_and_never_sends_its_request_twice(two_workers) -> None:
    before = requests_counted()
    with client_for(two_workers) as c:
        stream = c.generate("Count:", max_tokens=600, ignore_eos=True, timeout_s=60)
        for n, _chunk in enumerate(stream):
            if n == 1:
                stream.cancel()
                break
        with pytest.raises(RequestCancelled):
            list(stream)  # the cancelled request, not a new one
        done = c.generate("Hi", max_tokens=2)
        first = list(done)
        assert first and list(done) == []  # a finished stream yields nothing more
    wait_for(lambda: requests_drained(two_workers), 30, "the worker to abort the request")
    wait_for(lambda: requests_counted() == before + 2, 10, "the gateway to count two requests")
    time.sleep(0.5)
    assert requests_counted() == before + 2


def test_leaving_a_stream_context_early_cancels_the_request(two_workers) -> None:
    before = requests_total("CANCELLED")
    with client_for(two_workers) as c:
        with c.generate("Count:", max_tokens=600, ignore_eos=True, timeout_s=60) as stream:
            for n, _chunk in enumerate(stream):
                if n == 2:
                    break  # the stream object stays referenced: the `with` ends the request
        wait_for(lambda: requests_drained(two_workers), 30, "the worker to abort the request")
        wait_for(lambda: requests_total("CANCELLED") == before + 1, 10,
                 "the gateway to count the request CANCELLED")
        assert len(stream.token_ids) < 600
        assert list(c.generate("Hi", max_tokens=2))  # and the next request is served


class _OpenContext:
    """What the handler asks of grpc's ServicerContext for a call that is still open."""

    def __init__(self, key: str) -> None:
        self.key = key

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.key}"),)

    def time_remaining(self) -> float:
        return 60.0

    async def abort_with_status(self, status: object) -> None:
        raise AssertionError(f"the call was not to fail: {status}")


def test_a_stream_closed_between_two_responses_is_cancelled_and_frees_the_request(
        two_workers) -> None:
    # grpc closes a handler whose client left while it was suspended at a `yield` (aclose,
    # GeneratorExit), rather than cancelling it inside an await: the request must still be
    # counted CANCELLED, never OK, and its worker request aborted at once, not when collected.
    from gateway._proto.tessera.v1 import gateway_pb2 as pb
    from gateway.grpc_server import GatewayServicer

    before = {r: requests_total(r) for r in ("OK", "CANCELLED")}
    servicer = GatewayServicer(two_workers.gateway)
    request = pb.GenerateRequest(model=MODEL, prompt="Count:",
                                 sampling=pb.SamplingOptions(max_tokens=600, ignore_eos=True))

    async def leave_after_two() -> None:
        stream = servicer.Generate(request, _OpenContext(KEYS["acme"]))
        await anext(stream)
        await anext(stream)
        await stream.aclose()

    two_workers.call(leave_after_two())
    wait_for(lambda: requests_total("CANCELLED") == before["CANCELLED"] + 1, 10,
             "the gateway to count the request CANCELLED")
    assert requests_total("OK") == before["OK"]
    wait_for(lambda: requests_drained(two_workers), 30, "the worker to abort the request")


def test_a_zero_timeout_is_a_passed_deadline_not_none(two_workers) -> None:
    with client_for(two_workers, timeout_s=60) as c:
        expect(DeadlineExceeded, c.generate("Hi", max_tokens=2, timeout_s=0))
        assert list(c.generate("Hi", max_tokens=2))  # the client's own deadline still serves


def test_full_pool_is_overloaded_with_a_retry_hint(two_workers) -> None:
    pool = two_workers.gateway.pools[MODEL]
    config = pool.config
    pool.config = replace(config, max_queue=0)
    for w in pool.ready():
        w.max_inflight = 1
    holders = []
    try:
        with client_for(two_workers) as c:
            for _ in range(2):  # one long request on each worker fills the pool
                holder = c.generate("Count:", max_tokens=600, ignore_eos=True)
                next(iter(holder))
                holders.append(holder)
            err = expect(Overloaded, c.generate("Hi", max_tokens=2))
            assert float(err.metadata["retry_after_s"]) > 0
            retried = Client(two_workers.target, api_key=KEYS["acme"],
                             retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.05,
                                               max_backoff_s=0.2))
            stream = retried.generate("Hi", max_tokens=2)
            expect(Overloaded, stream)
            assert stream.attempts == 2
            retried.close()
    finally:
        for holder in holders:
            holder.cancel()
        pool.config = config
        for w in pool.workers.values():
            w.max_inflight = config.max_inflight
    wait_for(lambda: requests_drained(two_workers), 30, "the long requests to end")
