"""The engine's CPU threads: every core by default, a flag to choose, one inter-op thread."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from runtime.config import EngineConfig
from runtime.engine_flags import add_engine_flags, engine_config
from runtime.errors import InvalidArgument
from runtime.threads import available_cores, resolve_num_threads, thread_env


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return p.parse_args(argv)


def test_worker_threads_flag_reaches_the_engine_config():
    assert engine_config(_parse([])).num_threads == available_cores()
    assert engine_config(_parse(["--worker-threads", "3"])).num_threads == 3


def test_default_is_every_core_this_process_may_run_on():
    assert resolve_num_threads(None) == available_cores() >= 1
    assert resolve_num_threads(5) == 5


@pytest.mark.parametrize("bad", [0, -2])
def test_fewer_than_one_thread_is_refused(bad):
    with pytest.raises(InvalidArgument):
        EngineConfig(num_threads=bad)
    with pytest.raises(InvalidArgument):
        resolve_num_threads(bad)


def test_applying_threads_sets_intra_op_and_one_inter_op_thread():
    code = ("from runtime.threads import apply_num_threads; import torch; "
            "torch.set_num_threads(2); kept = apply_num_threads(None); "
            "n = apply_num_threads(3); print(kept, n, torch.get_num_threads(), "
            "torch.get_num_interop_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, **thread_env(3)})
    assert out.stdout.split() == ["2", "3", "3", "1"]


_POOL_SCRIPT = """
import json, os, threading, torch
from runtime.threads import release_openmp_pool
torch.set_num_threads(2)
tasks = lambda: len(os.listdir("/proc/self/task"))
a = torch.randn(1 << 20)
out = {"base": tasks()}
torch.add(a, a)  # a parallel region: this thread's pool starts its second thread
out["with_pool"] = tasks()
out["released"] = release_openmp_pool()
out["after"], out["main_threads"] = tasks(), torch.get_num_threads()
torch.add(a, a)  # runs on this thread alone now: no pool again
out["after_op"] = tasks()
def engine():
    out["engine_threads"] = torch.get_num_threads()
    torch.add(a, a)
    out["engine_tasks"] = tasks()
t = threading.Thread(target=engine)
t.start()
t.join()
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_release_openmp_pool_leaves_the_engine_threads_pool_the_only_one():
    """A worker's main thread warms the engine, then the engine thread computes: the main
    thread's pool must be gone (libgomp throttles every barrier while it manages more threads
    than cores), and the engine thread must keep the engine's thread count."""
    import json

    done = subprocess.run([sys.executable, "-c", _POOL_SCRIPT], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"}, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not out["released"]:
        pytest.skip("this torch's OpenMP runtime is not GNU libgomp 5.0+ (nothing to release)")
    assert out["with_pool"] == out["base"] + 1
    assert out["after"] == out["after_op"] == out["base"]
    assert out["main_threads"] == 1
    assert out["engine_threads"] == 2
    assert out["engine_tasks"] == out["base"] + 2  # the engine thread and its pool's second
