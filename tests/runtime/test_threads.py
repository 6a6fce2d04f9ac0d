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
