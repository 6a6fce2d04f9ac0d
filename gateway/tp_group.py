"""A worker that spans a tensor-parallel group (`--tp N`): rank 0 is the worker process the
gateway talks to (gRPC, readiness, health); it spawns ranks 1..N-1 as its own children
(`python -m gateway.tp_follower`), joins one torch.distributed group with them (gloo over a
rendezvous file on CPU, NCCL on CUDA, rank r on cuda:r), and sends them its engine's inputs
over one pipe each (runtime/engine/tp_leader.py).

The group lives and dies as one: a follower that exits while rank 0 serves ends rank 0 at
once with a typed log line (`TensorParallelGroupLost`), so the supervisor sees a dead worker
and restarts it as any other; rank 0's exit ends the followers (their pipe closes, and they
watch their parent). No process is left waiting on a peer that is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import TYPE_CHECKING

from gateway.logs import get_logger
from runtime.config import EngineConfig
from runtime.engine.tp_inputs import BeginGroup, StepInput, StopGroup, encode
from runtime.errors import InvalidArgument

if TYPE_CHECKING:
    from runtime.async_engine import AsyncLLM
    from runtime.engine import LLMEngine

log = get_logger("tessera.tp_group")
GROUP_LOST_EXIT = 3  # a worker whose group broke exits with this code


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank `rank`'s engine configuration: its own CUDA device (cuda:rank, the local rank) on
    CUDA; on CPU the same one (its share of threads is already in `config`)."""
    from runtime.platform import platform_for, resolve_device

    device = resolve_device(config.device)
    if platform_for(device).kind == "cuda":
        if ":" in device and device != "cuda:0":
            raise InvalidArgument(f"--tp places rank r on cuda:r; --device {device} names one "
                                  f"device (use cuda, or CUDA_VISIBLE_DEVICES to pick them)",
                                  field="device")
        return dataclasses.replace(config, device=f"cuda:{rank}")
    return dataclasses.replace(config, device=device)


def split_threads(num_threads: int, size: int) -> int:
    """Each rank's compute threads when one worker's `num_threads` are split over `size`."""
    return max(1, num_threads // size)


class FollowerGroup:
    """Rank 0's handle on its followers: start them, send them step inputs, watch them."""

    def __init__(self, size: int, worker_id: str, folder: str | None = None) -> None:
        self.size = size
        self.worker_id = worker_id
        # NOTE: `folder` is the one the worker's exit-with-gateway hook removes (a SIGKILLed
        # gateway runs no close()); a temporary folder otherwise.
        if folder is None:
            self._dir = tempfile.mkdtemp(prefix="tessera-tp-")
        else:
            os.makedirs(folder, mode=0o700)
            self._dir = folder
        self.init_method = f"file://{os.path.join(self._dir, 'rendezvous')}"
        self._procs: list[subprocess.Popen[bytes]] = []
        self._pipes: list[int] = []  # write ends, one per follower
        self._lock = threading.Lock()
        self._ending = False  # from here on, a follower's exit is expected
        self._closed = False

    def start(self, config: EngineConfig, model: str | None) -> None:
        """Spawn ranks 1..size-1, send each its configuration, and watch them; rank 0 joins
        the process group next (runtime.distributed.init_tensor_parallel)."""
        for rank in range(1, self.size):
            read_end, write_end = os.pipe()
            cmd = [sys.executable, "-m", "gateway.tp_follower", "--rank", str(rank), "--size",
                   str(self.size), "--init-method", self.init_method, "--inputs-fd",
                   str(read_end), "--worker-id", self.worker_id]
            # NOTE: stdout/stderr inherited: a follower's log lines land in the worker's, which
            # the supervisor reads for a failed start's cause.
            proc = subprocess.Popen(cmd, pass_fds=(read_end,), stdin=subprocess.DEVNULL)
            os.close(read_end)
            self._procs.append(proc)
            self._pipes.append(write_end)
            self._write(write_end, encode(BeginGroup(rank_config(config, rank), model)))
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True,
                             name=f"tessera-tp-watch-{rank}").start()

    def send(self, message: StepInput) -> None:
        """One input to every follower, in the order of the calls (the engine thread's)."""
        frame = encode(message)
        with self._lock:
            for fd in self._pipes:
                self._write(fd, frame)

    def _write(self, fd: int, frame: bytes) -> None:
        try:
            view = memoryview(frame)
            while view:
                view = view[os.write(fd, view):]
        except OSError as e:  # the follower is gone; its watcher ends this process
            self._lost(f"a follower's step-input pipe closed ({e.strerror})")

    def stop_with_engine(self, llm: AsyncLLM) -> None:
        """End this worker once rank 0's engine loop dies (a desync, a failed forward: it
        raised TensorParallelGroupLost), rather than keep answering health until probed."""
        def watch() -> None:
            llm.wait_until_stopped()
            self._lost(f"rank 0's engine loop ended: {llm.liveness().error}")

        threading.Thread(target=watch, daemon=True, name="tessera-tp-engine-watch").start()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self._ending:
            self._lost(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with {code}")

    def _lost(self, why: str) -> None:
        """The group cannot go on: end this worker now (its streams fail, and the supervisor
        replaces it), never wait on collectives whose peer is gone."""
        if self._ending:
            return
        self._ending = True
        log.error("tensor-parallel group lost: the worker exits", reason="TensorParallelGroupLost",
                  worker=self.worker_id, error=why)
        for proc in self._procs:
            with contextlib.suppress(OSError):
                proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
        os._exit(GROUP_LOST_EXIT)

    def begin_stop(self) -> None:
        """This worker is stopping: the engine loop's end and the followers' exits are
        expected from now on."""
        self._ending = True

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the followers (a StopGroup frame, then SIGKILL past `timeout_s`); after the
        engine loop has stopped."""
        if self._closed:
            return
        self._closed = self._ending = True
        self.send(StopGroup())
        for fd in self._pipes:
            with contextlib.suppress(OSError):
                os.close(fd)
        for proc in self._procs:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def rendezvous_folder(socket_path: str) -> str:
    """Where a worker listening on `socket_path` keeps its group's rendezvous: beside its
    socket, in the gateway's private folder, so the worker's exit hook can remove it."""
    return f"{socket_path}.tp"


def start_leader(config: EngineConfig, model: str | None, size: int, worker_id: str,
                 folder: str | None = None) -> tuple[FollowerGroup, LLMEngine]:
    """Rank 0 of a `size`-rank worker: its followers started, the group joined, and its own
    engine (a TensorParallelLeader, each rank on its share of `config.num_threads`) built.
    Returns both; `FollowerGroup.close` after the engine loop has stopped. The group's
    rendezvous lives in `folder` (created; `rendezvous_folder(socket)` for a worker)."""
    from runtime.distributed import init_tensor_parallel
    from runtime.engine.tp_leader import TensorParallelLeader
    from runtime.loader import open_checkpoint
    from runtime.threads import resolve_num_threads

    threads = split_threads(resolve_num_threads(config.num_threads), size)
    config = dataclasses.replace(config, tensor_parallel_size=size, num_threads=threads)
    rank0 = rank_config(config, 0)  # refuses a device choice before any follower starts
    if rank0.device == "cpu":  # gloo over loopback (followers inherit it), whatever the hostname
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    group = FollowerGroup(size, worker_id, folder)
    group.start(config, model)
    init_tensor_parallel(0, size, group.init_method, device=rank0.device)
    return group, TensorParallelLeader(open_checkpoint(model), rank0, group.send)
