"""A CPU KV pool (runtime/kv/cache.py) is private to its process: a child forked from the
process that holds it (a worker forked from a template that built the engine) writes its own
copy, and the parent's pages, and any sibling's, stay as they were."""

from __future__ import annotations

import os

import torch

from runtime.platform import platform_for


def test_a_forked_child_s_kv_writes_stay_in_the_child() -> None:
    pool = platform_for("cpu").zeros((2, 8, 4, 64), torch.bfloat16, "cpu")
    pool[0, 0] = 1.0  # a page the parent wrote before the fork
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            pool[0, 0] = 7.0
            pool[1, 3] = 7.0
            code = 0 if bool((pool[0, 0] == 7.0).all()) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bool((pool[0, 0] == 1.0).all()) and bool((pool[1, 3] == 0).all())
