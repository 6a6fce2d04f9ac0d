"""Disaggregated serving with real worker processes on loopback: a prefill worker (BF16 KV) and
a decode worker (BF16 KV) behind the gateway, plus decode workers with FP8 and INT8 KV; greedy
parity with colocated serving, a corrupted frame, and a failure at every stage (the client leaving
during prefill, transfer and decode; a stalled transfer; a full decode pool, where requests
queue; each worker killed mid-prefill, mid-transfer and mid-decode), each ending typed for the
requests it hit only, with every page back (free + cached = total) on both sides. Stage
timing comes from drills on the prefill worker (`hold`: after the prompt's prefill, before the
first token; `stall`: after the first token, before the KV frames), never from sleeps.

One deployment serves the whole module; the tests that kill workers run last."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import worker_pb2 as wpb
from gateway.auth import ApiKeys
from gateway.client import (
    NO_RETRY,
    Client,
    DeadlineExceeded,
    KVIntegrityViolation,
    Stream,
    Unavailable,
    WorkerLost,
)
from gateway.runner import GatewayRunner
from gateway.supervisor import PoolConfig
from runtime.errors import RequestCancelled
from tests.gateway.conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PD, PD8, PDI8 = "pd", "pd8", "pdi8"
TRANSFER_TIMEOUT_S = 10.0
BF16 = ("--kv-cache-dtype", "bf16")
# drill tenants on the prefill worker: `drill` gets a corrupted frame, `bob` a sender that
# stalls after the first token (mid-transfer), `carol` a request held after its prefill
KEYS = {"acme": "key-acme", "bob": "key-bob", "drill": "key-drill", "carol": "key-carol"}
PREFILL_ARGS = (*BF16, "--fault-transfer", "corrupt:drill", "--fault-transfer", "stall:bob",
                "--fault-transfer", "hold:carol")
DECODE_KV_BYTES = 8 << 20  # 22 BF16 pages of 16 tokens: two long prompts do not fit
PROMPTS = [
    "The three primary colors are",
    "Write a haiku about the sea. The waves",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, the first humans to walk on the Moon were",
    "A list of fruits: apple, banana, cherry,",
    "Q: What is 12 times 12?\nA:",
]
LONG = " ".join(f"item {i} is a small red box;" for i in range(30))  # ~200 tokens, 13 pages
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def runner() -> Iterator[GatewayRunner]:
    """`pd`: one prefill worker and one decode worker (BF16 KV both; frames through shared
    memory); `pd8` / `pdi8`: one decode worker with FP8 / INT8 KV taking frames in the gRPC
    stream (served colocated by the gateway; its disaggregated path is driven directly)."""
    common = dict(max_inflight=4, min_workers=1, max_workers=1)
    pools = [
        PoolConfig(PD, role="prefill", kv_cache_bytes=32 << 20, worker_args=PREFILL_ARGS,
                   **common),
        PoolConfig(PD, role="decode", kv_cache_bytes=DECODE_KV_BYTES, worker_args=BF16,
                   transfer_timeout_s=TRANSFER_TIMEOUT_S, **common),
        PoolConfig(PD8, role="decode", kv_cache_bytes=DECODE_KV_BYTES,
                   worker_args=("--kv-cache-dtype", "fp8", "--kv-transport", "grpc"), **common),
        PoolConfig(PDI8, role="decode", kv_cache_bytes=DECODE_KV_BYTES,
                   worker_args=("--kv-cache-dtype", "int8", "--kv-transport", "grpc"), **common),
    ]
    keys = ApiKeys.parse(",".join(f"{k}={t}" for t, k in KEYS.items()))
    r = GatewayRunner(pools, keys).start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(runner) -> Iterator[Client]:
    with Client(runner.target, api_key=KEYS["acme"], retry=NO_RETRY) as c:
        yield c


def _workers(runner: GatewayRunner) -> dict[str, object]:
    gw = runner.gateway
    return {"prefill": gw.prefill_pools[PD].ready()[0], "decode": gw.pools[PD].ready()[0],
            "decode8": gw.pools[PD8].ready()[0], "decode_i8": gw.pools[PDI8].ready()[0]}


def _statuses(runner: GatewayRunner) -> dict[str, wpb.StatusResponse]:
    workers = _workers(runner)

    async def read() -> list[wpb.StatusResponse]:
        return list(await asyncio.gather(*(w.stub.Status(wpb.StatusRequest(), timeout=10)
                                           for w in workers.values())))

    return dict(zip(workers, runner.call(read()), strict=True))


def _idle(runner: GatewayRunner) -> bool:
    """Nothing running, waiting or in transfer; every page free or only cached."""
    return all(s.num_running == 0 and s.num_waiting == 0 and s.exported.pending == 0
               and s.imported.pending == 0
               and s.num_free_pages + s.prefix_cache.evictable_pages == s.num_pages
               for s in _statuses(runner).values())


def assert_idle(runner: GatewayRunner) -> None:
    wait_for(lambda: _idle(runner), 30, "both sides' pages back to idle")


def _direct(runner: GatewayRunner, worker: str, prompt: str, max_tokens: int,
            prefill_from: str | None = None) -> list[int]:
    """Greedy tokens from one worker over its own socket: colocated `Generate`, or with
    `prefill_from` the disaggregated `GenerateImported` pulling from that worker."""
    workers = _workers(runner)
    req = wpb.WorkerGenerateRequest(request_id=f"direct-{time.monotonic_ns()}", tenant="acme",
                                    text=prompt,
                                    sampling=pb.SamplingOptions(max_tokens=max_tokens, **GREEDY))

    async def run() -> list[int]:
        stub = workers[worker].stub
        if prefill_from is None:
            call = stub.Generate(req, timeout=120)
        else:
            target = f"unix:{workers[prefill_from].socket_path}"
            call = stub.GenerateImported(wpb.ImportGenerateRequest(
                request=req, prefill_target=target, transfer_timeout_s=60), timeout=120)
        return [t async for r in call if r.HasField("chunk") for t in r.chunk.token_ids]

    return runner.call(run())


def test_greedy_disaggregated_bf16_is_token_identical_to_colocated(runner, client) -> None:
    for prompt in PROMPTS:
        stream = client.generate(prompt, model=PD, max_tokens=10, **GREEDY)
        chunks = list(stream)
        want = _direct(runner, "decode", prompt, 10)  # the decode worker, colocated
        assert [t for c in chunks for t in c.token_ids] == want, prompt
        assert stream.finish_reason == "length" and stream.usage.completion_tokens == 10
        assert stream.usage.prompt_tokens > 0
    s = _statuses(runner)
    assert s["decode"].imported.transfers >= len(PROMPTS) == s["prefill"].exported.transfers
    assert s["decode"].role == "decode" and s["prefill"].role == "prefill"
    assert s["decode"].imported.failures == {} and s["decode"].imported.bytes > 0
    # one host: the frames went through the shared-memory ring, the same frames and checks
    assert s["decode"].imported.shm_frames == s["decode"].imported.frames
    assert s["prefill"].exported.shm_frames == s["decode"].imported.shm_frames > 0
    assert_idle(runner)


# measured 2026-12-01: fp8 4/6, int8 5/6 prompts identical (int8 in process: 8/8)
@pytest.mark.parametrize("worker,fmt,at_least", [("decode8", "fp8", 0.5),
                                                  ("decode_i8", "int8", 0.66)])
def test_quantized_decode_side_matches_colocated(runner, worker, fmt, at_least) -> None:
    """BF16 prefill KV converted to FP8 / INT8 at import vs a colocated worker of that format
    (whose prefill attends over quantized KV already): most prompts agree token for token
    (INT8's finer grid more of them); where one parts, it is the rounding of the prompt's
    attention (tests/runtime/test_disagg_transfer.py measures the logit gap at the first
    divergence in-process)."""
    same = []
    for prompt in PROMPTS:
        got = _direct(runner, worker, prompt, 8, prefill_from="prefill")
        want = _direct(runner, worker, prompt, 8)
        assert len(got) == len(want) == 8
        same.append(got == want)
    print(f"\nbf16 -> {fmt} import vs colocated {fmt} over processes: {sum(same)}/{len(same)} "
          "prompts token-identical over 8 tokens")
    assert sum(same) >= len(same) * at_least
    s = _statuses(runner)[worker]
    assert s.imported.transfers >= len(PROMPTS) and s.imported.shm_frames == 0  # in-stream
    assert_idle(runner)


def test_corrupted_frame_aborts_only_that_request(runner, client) -> None:
    results: dict[str, object] = {}

    def run(name: str, key: str, prompt: str) -> None:
        with Client(runner.target, api_key=KEYS[key], retry=NO_RETRY) as c:
            try:
                results[name] = list(c.generate(prompt, model=PD, max_tokens=8, **GREEDY))
            except Exception as e:
                results[name] = e

    threads = [threading.Thread(target=run, args=(f"ok{i}", "acme", p))
               for i, p in enumerate(PROMPTS[:2])]
    threads.append(threading.Thread(target=run, args=("bad", "drill", PROMPTS[3])))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    err = results["bad"]
    assert isinstance(err, KVIntegrityViolation), err
    assert err.metadata["cause"] == "transfer" and err.metadata["detail"] == "checksum"
    for i, prompt in enumerate(PROMPTS[:2]):
        chunks = results[f"ok{i}"]
        assert not isinstance(chunks, Exception), chunks
        assert [t for c in chunks for t in c.token_ids] == _direct(runner, "decode", prompt, 8)
    assert _statuses(runner)["decode"].imported.failures["checksum"] >= 1
    assert_idle(runner)
    # Prometheus, as the supervisor reads it from the decode worker's Status
    wait_for(lambda: REGISTRY.get_sample_value("tessera_worker_kv_transfer_failures", {
        "model": f"{PD}/decode", "worker": _workers(runner)["decode"].id,
        "direction": "import", "cause": "checksum"}) == 1, 30, "the failure metric")
    labels = {"model": f"{PD}/prefill", "worker": _workers(runner)["prefill"].id,
              "direction": "export"}
    assert REGISTRY.get_sample_value("tessera_worker_kv_transfer",
                                     {**labels, "kind": "bytes"}) > 0
    assert REGISTRY.get_sample_value("tessera_worker_kv_pages", {
        "model": f"{PD}/decode", "worker": _workers(runner)["decode"].id, "state": "free"}) > 0


def test_a_full_decode_pool_queues_imports_until_pages_free(runner) -> None:
    """`bob`'s sender stalls after prefill while the decode side holds 13 of its 22 pages. A
    second long prompt waits for pages (the prefill side never hears of it); a third, with a
    short deadline, ends DEADLINE_EXCEEDED while waiting. At the transfer timeout the stalled
    one ends DEADLINE_EXCEEDED with both sides' pages freed, and the waiting one then runs."""
    exported_before = _statuses(runner)["prefill"].exported.transfers
    started = time.monotonic()
    stalled = _in_thread(runner, "bob", LONG, 4)
    wait_for(lambda: _statuses(runner)["prefill"].exported.pending == 1, 60, "a stalled sender")
    queued = _in_thread(runner, "acme", LONG + " again", 4, timeout_s=120)
    wait_for(lambda: _statuses(runner)["decode"].imported.waiting == 1, 30, "a queued import")
    with Client(runner.target, api_key=KEYS["acme"], retry=NO_RETRY) as c, \
            pytest.raises(DeadlineExceeded):
        list(c.generate(LONG + " and again", model=PD, max_tokens=4, timeout_s=2, **GREEDY))
    # NOTE: the client's deadline fires before the worker's Status shows the waiter gone.
    wait_for(lambda: _statuses(runner)["decode"].imported.waiting == 1, 10,
             "the short-deadline import to leave the queue")
    s = _statuses(runner)
    assert s["prefill"].exported.pending == 1 and s["prefill"].num_waiting == 0
    stalled.thread.join(TRANSFER_TIMEOUT_S + 60)
    assert isinstance(stalled.error, DeadlineExceeded), stalled.error
    assert time.monotonic() - started >= TRANSFER_TIMEOUT_S * 0.9
    queued.thread.join(120)
    assert queued.error is None and len(queued.tokens) == 4
    s = _statuses(runner)
    assert s["decode"].imported.failures["deadline"] >= 1
    assert s["prefill"].exported.transfers == exported_before + 1  # the queued one only
    assert_idle(runner)


def test_decode_worker_holding_the_prefix_imports_only_what_it_lacks(runner, client) -> None:
    session = client.session()
    first = " ".join(f"step {i}: stir the soup;" for i in range(12))  # ~6 full pages
    list(session.generate(first, model=PD, max_tokens=4, **GREEDY))
    before = _statuses(runner)["decode"].imported.pages
    second = session.generate(first + " Then serve it hot.", model=PD, max_tokens=4, **GREEDY)
    tokens = [t for c in second for t in c.token_ids]
    imported = _statuses(runner)["decode"].imported.pages - before
    total = -(-second.usage.prompt_tokens // 16)
    assert second.usage.cached_tokens >= 4 * 16
    # cached_tokens counts hits on either side; the decode side's own hits are not sent again
    assert total - second.usage.cached_tokens // 16 <= imported < total - 3
    assert tokens == _direct(runner, "decode", first + " Then serve it hot.", 4)
    assert_idle(runner)


@pytest.mark.parametrize("stage", ["prefill", "transfer", "decode"])
def test_client_leaving_at_each_stage_frees_both_sides(runner, stage) -> None:
    """prefill: `carol`'s request is held after its prefill, before the first token, with
    pages on both sides, until the client cancels it (or its deadline passes); transfer:
    `bob`'s sender stalls after the first token, so leaving then leaves mid-transfer; decode:
    leaving after the first tokens of a long output."""
    if stage == "prefill":  # the client cancels; then another's deadline passes there
        for timeout_s, error in ((None, RequestCancelled), (2.0, DeadlineExceeded)):
            held = _in_thread(runner, "carol", PROMPTS[0], 4, timeout_s=timeout_s)
            wait_for(lambda: _held_on_both_sides(_statuses(runner)), 30,
                     "both sides holding the request")
            if timeout_s is None:
                held.stream.cancel()
            held.thread.join(60)
            assert isinstance(held.error, error) and not held.tokens, held.error
            assert_idle(runner)
        return
    key = "bob" if stage == "transfer" else "acme"
    with Client(runner.target, api_key=KEYS[key], retry=NO_RETRY) as c:
        stream = c.generate(LONG if stage == "transfer" else PROMPTS[1], model=PD,
                            max_tokens=200 if stage == "decode" else 4, **GREEDY)
        chunks = iter(stream)
        assert next(chunks).token_ids
        if stage == "transfer":
            assert _statuses(runner)["prefill"].exported.pending == 1
        else:
            assert next(chunks).token_ids  # a token the decode worker sampled
        stream.cancel()
    assert_idle(runner)


def _held_on_both_sides(s: dict[str, wpb.StatusResponse]) -> bool:
    prefill, decode = s["prefill"], s["decode"]
    return (prefill.exported.pending == 1 and prefill.num_free_pages < prefill.num_pages
            and decode.imported.pending == 1 and decode.num_free_pages < decode.num_pages)


class _Outcome:
    """A request run in a thread: its tokens so far, how it ended, its first token's event."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.error: Exception | None = None
        self.first_token = threading.Event()
        self.thread = threading.Thread(target=lambda: None)
        self.stream: Stream | None = None


def _in_thread(runner: GatewayRunner, key: str, prompt: str, max_tokens: int,
               timeout_s: float | None = None) -> _Outcome:
    outcome = _Outcome()

    def run() -> None:
        with Client(runner.target, api_key=KEYS[key], retry=NO_RETRY) as c:
            outcome.stream = c.generate(prompt, model=PD, max_tokens=max_tokens,
                                        timeout_s=timeout_s, **GREEDY)
            try:
                for chunk in outcome.stream:
                    outcome.tokens += chunk.token_ids
                    outcome.first_token.set()
            except Exception as e:
                outcome.error = e

    outcome.thread = threading.Thread(target=run)
    outcome.thread.start()
    return outcome


def _side_idle(runner: GatewayRunner, pool: str) -> bool:
    """The one worker of a pool (prefill or decode) has nothing running or in transfer and
    every page free or only cached."""
    async def read() -> wpb.StatusResponse:
        pools = runner.gateway.prefill_pools if pool == "prefill" else runner.gateway.pools
        return await pools[PD].ready()[0].stub.Status(wpb.StatusRequest(), timeout=10)

    s = runner.call(read())
    return (s.num_running == 0 and s.num_waiting == 0 and s.exported.pending == 0
            and s.imported.pending == 0 and s.imported.waiting == 0
            and s.num_free_pages + s.prefix_cache.evictable_pages == s.num_pages)


def test_decode_worker_killed_mid_transfer_and_mid_decode_ends_typed(runner):
    """The decode worker dies holding two requests: `bob`'s mid-transfer (its sender stalled
    after the first token) and one mid-decode (tokens from the decode side streamed). Both get
    WORKER_LOST (nothing transparent after a token was streamed); the prefill side's call is
    cut and its pages come back; the supervisor starts another decode worker."""
    in_transfer = _in_thread(runner, "bob", LONG, 4)
    in_decode = _in_thread(runner, "acme", PROMPTS[1], 100)
    decode = _workers(runner)["decode"]
    assert in_transfer.first_token.wait(60), "no first token"
    wait_for(lambda: len(in_decode.tokens) >= 3, 60, "tokens from the decode worker")
    os.kill(decode.pid, signal.SIGKILL)
    for outcome in (in_transfer, in_decode):
        outcome.thread.join(60)
        assert isinstance(outcome.error, WorkerLost), outcome.error
    assert len(in_decode.tokens) < 100
    wait_for(lambda: _side_idle(runner, "prefill"), 30, "the prefill side's pages back")
    # the replacement decode worker, for the next test
    wait_for(lambda: any(w.id != decode.id for w in runner.gateway.pools[PD].ready()), 300,
             "a new decode worker")


def test_prefill_worker_killed_mid_prefill_and_mid_transfer_ends_typed(runner):
    """The prefill worker dies holding two requests: `carol`'s after its prefill (no token out)
    and `bob`'s mid-transfer. Both end UNAVAILABLE (retryable); the decode side frees both
    reservations. Last: the supervisor restarts the prefill worker, nobody waits for it."""
    in_transfer = _in_thread(runner, "bob", LONG, 4)
    in_prefill = _in_thread(runner, "carol", PROMPTS[0], 4)
    prefill = _workers(runner)["prefill"]
    assert in_transfer.first_token.wait(60), "no first token"
    wait_for(lambda: _statuses(runner)["prefill"].exported.pending == 2, 60,
             "both requests held by the prefill worker")
    os.kill(prefill.pid, signal.SIGKILL)
    for outcome in (in_transfer, in_prefill):
        outcome.thread.join(60)
        assert isinstance(outcome.error, Unavailable), outcome.error
    assert not in_prefill.tokens
    wait_for(lambda: _side_idle(runner, "decode"), 30, "the decode side's pages back")
    assert runner.call(_read_decode_failures(runner))["sender"] >= 2


async def _read_decode_failures(runner: GatewayRunner) -> dict[str, int]:
    s = await runner.gateway.pools[PD].ready()[0].stub.Status(wpb.StatusRequest(), timeout=10)
    return dict(s.imported.failures)
