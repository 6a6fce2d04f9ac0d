"""Device kinds decided once (runtime/platform.py): `platform_for`, `auto`, and --device."""

from __future__ import annotations

import argparse

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import resolve_dtype
from runtime.engine_flags import add_engine_flags, engine_config
from runtime.errors import InvalidArgument
from runtime.platform import CPUPlatform, CUDAPlatform, platform_for, resolve_device


def test_auto_is_cuda_exactly_where_torch_sees_a_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"


def test_cuda_where_torch_sees_none_is_refused_before_any_weight_loads(monkeypatch):
    # a new-user trial: --device cuda on a CPU machine loaded the weights, then died in
    # model.to("cuda") with a traceback
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:1"):
        with pytest.raises(InvalidArgument, match="sees no CUDA device") as e:
            resolve_device(name)
        assert e.value.metadata["field"] == "device"
    assert resolve_device("cpu") == "cpu"


def test_each_kind_has_its_dtype_and_distributed_backend():
    cpu, cuda = platform_for("cpu"), platform_for(torch.device("cuda", 1))
    assert isinstance(cpu, CPUPlatform) and isinstance(cuda, CUDAPlatform)
    assert (cpu.default_dtype, cpu.distributed_backend) == ("float32", "gloo")
    assert (cuda.default_dtype, cuda.distributed_backend) == ("bfloat16", "nccl")
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) is torch.float16


def test_a_device_without_a_platform_is_refused_with_its_field():
    with pytest.raises(InvalidArgument) as e:
        EngineConfig(device="tpu")
    assert e.value.metadata["field"] == "device"
    with pytest.raises(InvalidArgument):
        platform_for("meta")


def test_cpu_kv_storage_is_zeroed_and_writable():
    z = platform_for("cpu").zeros((2, 3, 4), torch.bfloat16, "cpu")
    assert z.shape == (2, 3, 4) and z.dtype is torch.bfloat16 and not z.any()
    z[1, 2] = 1.5
    assert z.sum().item() == 6.0


def test_the_device_flag_reaches_the_engine_config():
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_config(p.parse_args([])).device == "auto"
    assert engine_config(p.parse_args(["--device", "cpu"])).device == "cpu"


def test_a_small_host_shares_every_core_with_the_serving_processes():
    from runtime.platform import PIN_MIN_CORES, compute_cores

    for n in range(1, PIN_MIN_CORES):  # this 2-core development box among them
        assert compute_cores(range(n), num_workers=1) is None
        assert compute_cores(range(n), num_workers=1, num_threads=1) is None


def test_a_large_host_pins_one_worker_to_its_own_cores_past_the_serving_ones():
    from runtime.platform import PIN_MIN_CORES, SERVING_CORES, compute_cores

    cores = list(range(PIN_MIN_CORES))
    pinned = compute_cores(cores, num_workers=1)
    assert pinned == tuple(cores[SERVING_CORES:])
    assert compute_cores([15, 3, 9, 1, 7, 5, 11, 13], num_workers=1, num_threads=2) == (13, 15)
    # the cores a container or taskset allows, in any order: the lowest stay with serving
    assert compute_cores(range(4, 4 + 16), num_workers=1, num_threads=4) == (16, 17, 18, 19)


def test_no_pinning_for_several_workers_or_more_threads_than_cores_to_spare():
    from runtime.platform import SERVING_CORES, compute_cores

    cores = range(16)
    assert compute_cores(cores, num_workers=2) is None  # each would need a set of its own
    assert compute_cores(cores, num_workers=1, num_threads=16 - SERVING_CORES + 1) is None
    assert compute_cores(cores, num_workers=1, num_threads=0) is None
    assert compute_cores(cores, num_workers=1, min_cores=32) is None
    assert compute_cores(cores, num_workers=1, serving_cores=0) == tuple(cores)


def test_pinning_moves_every_thread_of_the_process_already_running_or_started_later():
    import subprocess
    import sys

    code = """if True:
        import os, threading
        from runtime.platform import platform_for
        core = sorted(os.sched_getaffinity(0))[-1]
        stop = threading.Event()
        early = threading.Thread(target=stop.wait); early.start()
        platform_for("cpu").pin_compute_threads([core])
        late = threading.Thread(target=stop.wait); late.start()
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        print(all(os.sched_getaffinity(t) == {core} for t in tids), len(tids))
        stop.set()
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "True" and int(out[1]) >= 3
