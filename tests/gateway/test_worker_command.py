"""A pool's worker command line: its thread count, and the cores it pins them to where the host
has cores to spare (runtime/platform.py's `compute_cores`)."""

from __future__ import annotations

import os

import pytest

from gateway.pool_config import PoolConfig
from gateway.worker import parse_args
from gateway.worker_command import pinned_cores, threads_per_worker, worker_command


def _host(monkeypatch, cores: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))


def _command(config: PoolConfig) -> list[str]:
    return worker_command(config, "w-1", "/tmp/w.sock", None)


def test_a_two_core_host_pins_nothing_and_computes_on_every_core(monkeypatch):
    _host(monkeypatch, 2)
    config = PoolConfig("m", max_workers=1)
    assert pinned_cores(config) is None
    assert threads_per_worker(config) == 2
    assert "--compute-cores" not in _command(config)


def test_a_large_host_gives_its_lone_worker_the_cores_past_the_serving_ones(monkeypatch):
    _host(monkeypatch, 16)
    config = PoolConfig("m", max_workers=1)
    assert pinned_cores(config) == tuple(range(2, 16))
    assert threads_per_worker(config) == 14
    cmd = _command(config)
    assert cmd[cmd.index("--worker-threads") + 1] == "14"
    args = parse_args(cmd[cmd.index("--socket"):])
    assert args.compute_cores == tuple(range(2, 16))


def test_several_workers_or_a_chosen_thread_count_keep_the_os_placement(monkeypatch):
    _host(monkeypatch, 16)
    for config in (PoolConfig("m", max_workers=2), PoolConfig("m", worker_threads=4)):
        assert pinned_cores(config) is None
        assert "--compute-cores" not in _command(config)
    assert threads_per_worker(PoolConfig("m", max_workers=2)) == 8


@pytest.mark.parametrize("value", ["", "1,x", "-1", "1,,2"])
def test_a_malformed_core_list_is_refused(value):
    with pytest.raises(SystemExit):
        parse_args(["--socket", "/tmp/w.sock", "--compute-cores", value])
