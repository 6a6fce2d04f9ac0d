"""Workers forked from a model's template (gateway/template.py, gateway/template_process.py):
they answer as spawned workers do, sample as their seeds say, keep none of the template's
pipes or sockets, survive it, and are spawned again when it dies; a model file replaced under a
running template is what the next worker serves."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import worker_pb2 as wpb
from gateway.client import Client
from gateway.runner import GatewayRunner
from gateway.template import ForkedProcess
from gateway.template_process import reseed
from tests.gateway.conftest import KEYS, MODEL, api_keys, pool_config, wait_for
from tests.helpers import perturbed_model_copy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"


def _runner(**overrides: object) -> GatewayRunner:
    return GatewayRunner([pool_config(**overrides)], api_keys()).start(wait_ready=False)


def _template(runner: GatewayRunner):
    template = runner.gateway.pools[MODEL]._template
    assert template is not None
    runner.call(template.ready.wait(), timeout_s=300)
    assert template.alive, template.failed
    return template


def _greedy(runner: GatewayRunner, max_tokens: int = 12) -> list[int]:
    with Client(runner.target, api_key=KEYS["acme"]) as client:
        stream = client.generate(PROMPT, max_tokens=max_tokens, temperature=0.0,
                                 ignore_eos=True)
        return [t for chunk in stream for t in chunk.token_ids]


def _direct(runner: GatewayRunner, worker, seed: int | None) -> list[int]:
    sampling = pb.SamplingOptions(max_tokens=12, temperature=1.0, ignore_eos=True)
    if seed is not None:
        sampling.seed = seed
    req = wpb.WorkerGenerateRequest(request_id=f"direct-{time.monotonic_ns()}", tenant="acme",
                                    text=PROMPT, sampling=sampling)

    async def run() -> list[int]:
        call = worker.stub.Generate(req, timeout=120)
        return [t async for r in call if r.HasField("chunk") for t in r.chunk.token_ids]

    return runner.call(run())


@pytest.fixture(scope="module")
def forked_pair() -> Iterator[GatewayRunner]:
    """Two workers, both forked from the pool's template."""
    runner = _runner(min_workers=2, max_workers=2, template=True)
    _template(runner)
    runner.call(runner.wait_ready(timeout_s=300), timeout_s=330)
    wait_for(lambda: len(runner.gateway.pools[MODEL].ready()) == 2, 300, "two workers")
    yield runner
    runner.stop()


def test_every_worker_of_a_template_pool_is_forked(forked_pair: GatewayRunner) -> None:
    template = _template(forked_pair)
    for w in forked_pair.gateway.pools[MODEL].ready():
        assert isinstance(w.process, ForkedProcess)
        with open(f"/proc/{w.pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == template.pid  # its parent


def test_forked_workers_of_the_default_device_adopt_the_templates_warm_engine(
        forked_pair: GatewayRunner) -> None:
    # the pool names no --device: "auto", the CPU on this torch; the template built and warmed
    # the workers' engine once, and each fork adopted it instead of building and warming its own
    assert "--device" not in forked_pair.gateway.pools[MODEL].config.worker_args
    assert "engine_warm_up" in _template(forked_pair).phases
    for w in forked_pair.gateway.pools[MODEL].ready():
        assert "adopt_engine" in w.start_phases and "warm_up" not in w.start_phases


def test_forked_greedy_output_equals_a_spawned_workers(forked_pair: GatewayRunner) -> None:
    spawned = _runner(min_workers=1, max_workers=1, template=False)
    try:
        spawned.call(spawned.wait_ready(timeout_s=300), timeout_s=330)
        worker = spawned.gateway.pools[MODEL].ready()[0]
        assert not isinstance(worker.process, ForkedProcess)
        expected = _greedy(spawned)
    finally:
        spawned.stop()
    assert len(expected) == 12
    assert _greedy(forked_pair) == expected


def test_forked_workers_sample_alike_with_one_seed(forked_pair: GatewayRunner) -> None:
    first, second = forked_pair.gateway.pools[MODEL].ready()
    assert first.pid != second.pid
    a, b = _direct(forked_pair, first, seed=1234), _direct(forked_pair, second, seed=1234)
    assert len(a) == 12 and a == b
    assert _direct(forked_pair, first, seed=99) != a  # the seed is what made them equal


def test_forked_workers_sample_differently_without_a_seed(forked_pair: GatewayRunner) -> None:
    first, second = forked_pair.gateway.pools[MODEL].ready()
    a, b = _direct(forked_pair, first, seed=None), _direct(forked_pair, second, seed=None)
    assert len(a) == len(b) == 12 and a != b


def test_forks_draw_different_numbers_without_a_seed() -> None:
    """reseed(), as every forked worker runs it first: random, numpy and torch's global
    generators copied by fork draw differently in two children (and differently from the
    parent, which would otherwise hand both the same numbers)."""
    import torch

    torch.manual_seed(0)
    draws = []
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.close(read)
                reseed()
                import random

                values = (random.random(), float(np.random.rand()), float(torch.rand(1)))
                os.write(write, struct.pack("<3d", *values))
            finally:
                os._exit(0)
        os.close(write)
        data = os.read(read, 24)
        os.close(read)
        os.waitpid(pid, 0)
        draws.append(struct.unpack("<3d", data))
    assert all(x != y for x, y in zip(*draws, strict=True)), draws


def _fd_targets(pid: int) -> dict[int, str]:
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            pass
    return out


def test_a_forked_worker_holds_only_the_listed_fds_of_its_template(
        forked_pair: GatewayRunner) -> None:
    template = _template(forked_pair)
    ours = _fd_targets(template.pid)
    # its command pipe (stdin) and reply pipe; 1 and 2 are the gateway's log stream
    pipes = {t for fd, t in ours.items() if t.startswith(("pipe:", "socket:"))
             and fd not in (1, 2)}
    assert ours[0].startswith("pipe:") and len(pipes) >= 2, ours
    for w in forked_pair.gateway.pools[MODEL].ready():
        theirs = _fd_targets(w.pid)
        shared = {fd: t for fd, t in theirs.items() if t in set(ours.values())}
        assert not pipes & set(theirs.values())
        assert theirs[0] == "/dev/null"
        for fd, target in shared.items():
            listed = (fd in (1, 2) or target in ("/dev/null", "anon_inode:[pidfd]")
                      or target.endswith((".gguf", ".tsm")))
            assert listed, (fd, target)
        model_files = [t for t in theirs.values() if t.endswith((".gguf", ".tsm"))]
        assert any(t.endswith(".tsm") for t in model_files), theirs


def test_template_death_falls_back_to_spawning_and_leaves_workers_serving(
        tmp_path: Path) -> None:
    runner = _runner(min_workers=0, max_workers=1, idle_ttl_s=0.5, template=True)
    try:
        template = _template(runner)
        pool = runner.gateway.pools[MODEL]
        first = _greedy(runner)
        forked = pool.ready()[0]
        assert isinstance(forked.process, ForkedProcess)
        os.kill(template.pid, signal.SIGKILL)
        wait_for(lambda: not template.alive, 30, "the template's death noticed")
        assert _greedy(runner) == first  # the forked worker outlives its template
        wait_for(lambda: not pool.live(), 60, "the pool at zero")
        assert _greedy(runner) == first
        spawned = pool.ready()[0]
        assert not isinstance(spawned.process, ForkedProcess)
        with open(f"/proc/{spawned.pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    finally:
        runner.stop()


def test_a_model_replaced_under_the_template_is_served_by_the_next_worker(
        tmp_path: Path, default_model_path: Path) -> None:
    model = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path, model)
    runner = _runner(min_workers=0, max_workers=1, idle_ttl_s=0.5, template=True,
                     model_path=str(model),
                     worker_env=(("TESSERA_MAPPED_DIR", str(tmp_path / "mapped")),))
    try:
        _template(runner)
        pool = runner.gateway.pools[MODEL]
        before = _greedy(runner)
        staged = tmp_path / "model.gguf.new"
        perturbed_model_copy(default_model_path, staged)
        os.replace(staged, model)  # atomically, as a deployment replaces a model
        wait_for(lambda: not pool.live(), 60, "the pool at zero")
        after = _greedy(runner)
        assert isinstance(pool.ready()[0].process, ForkedProcess)
        assert len(list((tmp_path / "mapped").glob("*.tsm"))) == 2
    finally:
        runner.stop()
    from runtime import LLM
    from runtime.sampling_params import SamplingParams

    direct = LLM(str(model), kv_cache_bytes=16 << 20, max_num_seqs=2)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = direct.generate([PROMPT], params)[0].outputs[0].token_ids
    assert after == list(expected) and after != before


def test_a_pool_that_cannot_grow_spawns_without_a_template() -> None:
    from gateway.template import uses_template

    assert not uses_template(None, min_workers=2, max_workers=2)
    assert uses_template(None, min_workers=0, max_workers=1)
    assert uses_template(None, min_workers=1, max_workers=2)
    assert not uses_template(False, min_workers=0, max_workers=1)


