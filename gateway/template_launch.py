"""Starting a pool's worker template process (gateway/template_process.py), kept apart from
gateway/template.py so that `tessera serve` can start it first thing, before its own heavier
imports and servers: the template's import of torch (the longest part of its load) then runs
beside the gateway's start instead of after it. Imports nothing beyond the standard library
and the worker command line's modules (no asyncio, gRPC or logging set-up)."""

from __future__ import annotations

import os
import subprocess
import sys

from gateway.pool_config import PoolConfig
from gateway.worker_command import worker_command, worker_env

WORKER_MODULE = ["-m", "gateway.worker"]


def uses_template(choice: bool | None, min_workers: int, max_workers: int) -> bool:
    """A pool forks its workers from a template when asked, or by default (None) when it may
    start workers after its first ones: it scales from zero or can grow."""
    return choice if choice is not None else (min_workers == 0 or max_workers > min_workers)


def pool_uses_template(config: PoolConfig) -> bool:
    """Whether a pool of `config` keeps a template. Never a tensor-parallel pool: its worker is
    a group of processes that each load their own shard and meet in a process group, while a
    template holds one process's whole-model engine; forking rank 0 alone would save its
    followers nothing, and on CUDA every rank needs a fresh context of its own anyway."""
    return config.tensor_parallel_size == 1 and uses_template(
        config.template, config.min_workers, config.max_workers)


def template_command(config: PoolConfig) -> list[str]:
    """The worker command line a pool's template loads for (gateway.worker's; no socket and
    no readiness socket: each fork is given its own)."""
    return worker_command(config, f"{config.pool_label.replace('/', '-')}-template", "", None)


def template_argv(command: list[str]) -> list[str]:
    """gateway.worker's arguments in `command` (a worker_command line)."""
    return command[len(WORKER_MODULE) + 1:]


class LaunchedTemplate:
    """A template process started by launch_template, before any event loop watches it: its
    Popen (stdin: the command pipe) and the read end of its reply pipe. A WorkerTemplate adopts
    it (gateway/template.py); `close()` stops one nobody adopted."""

    def __init__(self, process: subprocess.Popen, replies_fd: int, command: list[str]) -> None:
        self.process = process
        self.replies_fd = replies_fd
        self.command = command
        self.adopted = False

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the template (SIGTERM: it has forked no worker yet, and may still be loading,
        when it reads no command; SIGKILL past `timeout_s`) and close its pipes; nothing once a
        WorkerTemplate adopted it (its pool closes it)."""
        if self.adopted:
            return
        self.adopted = True  # NOTE: closed once
        os.close(self.replies_fd)
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def launch_template(command: list[str], env: dict[str, str]) -> LaunchedTemplate:
    """Start `python -m gateway.template_process` for the worker `command` line in `env`, in a
    session of its own; returns at once (the template reports "ready" on its reply pipe once
    loaded). Raises OSError when the process cannot start."""
    read_fd, write_fd = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.template_process", "--reply-fd", str(write_fd),
             "--", *template_argv(command)], env=env, stdin=subprocess.PIPE,
            pass_fds=(write_fd,), start_new_session=True)
    except OSError:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return LaunchedTemplate(process, read_fd, command)


def launch_pool_template(config: PoolConfig) -> LaunchedTemplate | None:
    """The template of a pool of `config`, started now (None when the pool keeps none)."""
    if not pool_uses_template(config):
        return None
    return launch_template(template_command(config), worker_env(config))
