"""A model's worker template: one process that has imported torch and tessera, opened the
checkpoint (tokenizer, GGUF reader), mapped its weights (runtime/loader/mapped.py) and loaded
the native ops, and that runs no thread, no gRPC object and no OpenMP pool; workers are forked
from it (Android's zygote, SGLang's forkserver) and finish their start in the child. What no
first request needs (llguidance's tokenizer, the tokenizer's plain-text backend and chat
template) is built after "ready", once the template is idle (Template.finish_load), so the first
fork does not wait for it.

`python -m gateway.template_process --reply-fd N -- WORKER-ARGV`, started by
gateway/template_launch.py (`tessera serve` starts it before the gateway's own modules load).
Commands arrive as JSON lines on stdin (`{"op": "fork", "argv": [...]}`); replies go to the
reply fd (`ready`, `forked` with a pid or `error`, `exited` with a pid and exit code). The
template reaps its children and exits when the gateway closes its stdin (or dies).
"""

from __future__ import annotations

import gc
import json
import os
import random
import select
import sys
import time
from pathlib import Path
from typing import Any

# NOTE: before numpy or torch load: their BLAS pools start threads at import, and a thread in
# the template would be copied into every fork half-alive. Workers set their own threads.
os.environ["OPENBLAS_NUM_THREADS"] = "1"


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


class Template:
    """What the template holds for its children: the opened checkpoint and its mapped file."""

    def __init__(self, worker_argv: list[str]) -> None:
        self.worker_argv = worker_argv
        self.phases: dict[str, float] = {}
        self.cpu_phases: dict[str, float] = {}
        self._cpu_at = time.process_time()
        self.checkpoint: Any = None
        self.key: Any = None
        self.engine: Any = None  # built and warmed here, for workers (gateway/template_warm.py)
        self.engine_config: Any = None  # its configuration (warm_config of the workers')
        self.finished = False  # finish_load() has run for this load
        # NOTE: the workers exit with the gateway, not with the template (gateway/worker.py).
        self.gateway_pidfd = os.pidfd_open(os.getppid())
        self.load()

    def _mark(self, name: str, since: float) -> float:
        """Phase `name` ended: its wall seconds since `since` (perf_counter) in `phases`, its
        CPU seconds since the previous mark in `cpu_phases` (the steadier number when the host
        is busy)."""
        now, cpu = time.perf_counter(), time.process_time()
        self.phases[name] = round(now - since, 4)
        self.cpu_phases[name] = round(cpu - self._cpu_at, 4)
        self._cpu_at = cpu
        return now

    def load(self) -> None:
        """(Re)open the checkpoint and map its weights, with torch on one thread so that no
        OpenMP pool starts here."""
        t, self._cpu_at = time.perf_counter(), time.process_time()
        import torch

        torch.set_num_threads(1)
        import gateway.worker  # noqa: F401  (the modules every worker imports, once, here)
        from runtime.engine import LLMEngine  # noqa: F401

        t = self._mark("import", t)
        from kernels.cpu_ops import native

        native()
        t = self._mark("native_ops", t)
        from gateway.worker import parse_args
        from runtime.engine_flags import engine_config
        from runtime.loader import open_checkpoint

        args = parse_args(self.worker_argv)
        config = engine_config(args)
        checkpoint = open_checkpoint(args.model)
        from runtime.models import model_class

        model_class(checkpoint.config)  # its architecture's module, imported once here
        t = self._mark("checkpoint", t)
        from runtime.loader.gguf_loader import GGUFCheckpoint

        if (config.mapped_weights and config.gguf_weights != "dequantize"
                and isinstance(checkpoint, GGUFCheckpoint)):
            from runtime.loader.mapped_gguf import checkpoint_mapping

            checkpoint_mapping(checkpoint).prefault()
        t = self._mark("map_weights", t)
        engine = None
        if _computes_on_cpu(config.device):  # NOTE: on a GPU, CUDA and the engine start in a child
            from gateway.template_warm import build_warm_engine, warm_config

            self.engine = self.engine_config = None  # the old model's, freed before the new
            engine = build_warm_engine(checkpoint, config)
            t = self._mark("engine_warm_up", t)
        reseed()  # NOTE: its first calls import and set up lazily (50 ms); the children's are quick
        # NOTE: swapped in whole, once loaded: a failed reload keeps the previous model, and the
        # next fork tries again. The key is the opened file's: a rename over the path since
        # the open makes the next fork reload.
        self.checkpoint, self.key = checkpoint, _opened_stamp(checkpoint)
        self.engine, self.engine_config = engine, None if engine is None else warm_config(config)
        self.finished = False

    def finish_load(self) -> dict[str, float]:
        """What no first worker waits for, done once (per load) when the template is idle:
        llguidance's tokenizer (~0.4 s), the tokenizer's plain-text backend (~0.15 s) and its
        chat template (jinja2), all kept on the checkpoint's tokenizer, so every later fork
        inherits them (a worker forked before makes its own on first use). The phases it ran,
        {} when there was nothing left."""
        from runtime.grammar import llguidance_tokenizer

        if self.finished:
            return {}
        self.finished = True  # NOTE: before the build: one that fails is not retried here
        cfg, tokenizer = self.checkpoint.config, self.checkpoint.tokenizer
        t, self._cpu_at = time.perf_counter(), time.process_time()
        llguidance_tokenizer(tokenizer, cfg.vocab_size, sorted(set(cfg.eos_token_ids)))
        t = self._mark("grammar_tokenizer", t)
        tokenizer.prepare()
        self._mark("text_tokenizer", t)
        return {k: self.phases[k] for k in ("grammar_tokenizer", "text_tokenizer")}

    def fork(self, argv: list[str]) -> int:
        """A worker for `argv` (gateway.worker's): its pid. A replaced model file is opened
        and mapped again first, so the child serves what is on disk now."""
        if self.key != _source_stamp(self.checkpoint.path):
            self.load()
        if _threads() != 1:
            raise RuntimeError(f"the template runs {_threads()} threads: forking it is unsafe")
        import torch

        if torch.cuda.is_initialized():  # NOTE: a child cannot re-initialise CUDA after a fork
            raise RuntimeError("CUDA is initialised in the template: forking it is unsafe")
        engine = self.engine if self._same_engine(argv) else None
        gc.freeze()  # NOTE: the child's refcount writes then leave the template's pages shared
        # NOTE: collection was off for the load (main()); on from here, in the template and
        # in every child, with the load's objects frozen: no pass ever walks them
        gc.enable()
        pid = os.fork()
        if pid == 0:
            _become_worker(argv, self.checkpoint, self.gateway_pidfd, engine)
        return pid

    def _same_engine(self, argv: list[str]) -> bool:
        """Whether a worker of `argv` can adopt the engine built here (same configuration but
        for threads and seed)."""
        if self.engine is None:
            return False
        from gateway.template_warm import warm_config
        from gateway.worker import parse_args
        from runtime.engine_flags import engine_config

        return bool(warm_config(engine_config(parse_args(argv))) == self.engine_config)


def _computes_on_cpu(device: str) -> bool:
    """Whether workers of `device` (EngineConfig.device) compute on the CPU, decided without
    initialising CUDA (a forked child could not): "auto" is the CPU only on a torch built
    without CUDA; on a CUDA build it is left to the child."""
    import torch

    return device == "cpu" or (device == "auto" and not torch.backends.cuda.is_built())


def _source_stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat() if path.is_file() else (path / "config.json").stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _opened_stamp(checkpoint: Any) -> tuple[int, int, int]:
    """The stamp of the file `checkpoint` reads (a GGUF's open file), else of its path."""
    source_stat = getattr(checkpoint, "source_stat", None)
    if source_stat is None:
        return _source_stamp(checkpoint.path)
    st = source_stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _become_worker(argv: list[str], checkpoint: Any, gateway_pidfd: int, engine: Any) -> None:
    """In the child: a session of its own, only the fds it needs, fresh random state, then the
    worker's own start (threads, sockets; the engine, KV pool and warm-up too when the template
    has no `engine` for this worker's configuration). Never returns."""
    code = 1
    marks = {"forked": time.monotonic()}
    try:
        os.setsid()
        _close_fds_but(_files_to_keep() | {gateway_pidfd})
        reseed()
        # NOTE: the template's objects stay frozen: a collection that walked them would write
        # their headers and copy every page they sit on into this worker.
        from gateway.worker import main

        marks["setup"] = time.monotonic()
        code = main(argv, checkpoint=checkpoint, parent_pidfd=gateway_pidfd, marks=marks,
                    engine=engine)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# The fds a forked worker keeps of its template's: stdin is replaced by /dev/null, stdout and
# stderr are the gateway's log stream, the model's files stay open for their read-only mappings.
KEPT_FDS = ("0 (/dev/null)", "1 and 2 (the log stream)", "a pidfd of the gateway",
            "the model's files behind read-only mappings (GGUF, mapped weights)")


def _files_to_keep() -> set[int]:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    keep = {0, 1, 2}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("/") and os.path.isfile(target) and _read_only(fd):
            keep.add(fd)  # a file behind a mapping (mmap holds its own fd)
    return keep


def _read_only(fd: int) -> bool:
    import fcntl

    try:
        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    except OSError:
        return False


def _close_fds_but(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def reseed() -> None:
    """Fresh state for every process-wide random source a fork copies: random, numpy, torch."""
    import numpy as np
    import torch

    random.seed(os.urandom(32))
    np.random.seed(int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))


def _reply(fd: int, **message: Any) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _reap(reply_fd: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply(reply_fd, op="exited", pid=pid, code=os.waitstatus_to_exitcode(status))


def _finish_load(template: Template, reply_fd: int) -> None:
    try:
        phases = template.finish_load()
    except Exception as e:  # NOTE: a worker builds it itself then, on its first grammar
        print(f"worker template: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return
    if phases:
        _reply(reply_fd, op="phases", phases=phases,
               cpu_phases={k: template.cpu_phases[k] for k in phases})


def serve(reply_fd: int, worker_argv: list[str]) -> int:
    try:
        template = Template(worker_argv)
    except Exception as e:
        _reply(reply_fd, op="error", error=f"{type(e).__name__}: {e}")
        return 2
    _reply(reply_fd, op="ready", pid=os.getpid(), phases=template.phases,
           cpu_phases=template.cpu_phases, threads=_threads())
    buffer = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.2)
        _reap(reply_fd)
        if not readable:
            _finish_load(template, reply_fd)
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return 0  # the gateway went away: the workers watch it themselves
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            command = json.loads(line)
            if command.get("op") != "fork":
                _reply(reply_fd, op="error", error=f"unknown command {command.get('op')!r}")
                continue
            started = time.perf_counter()
            try:
                pid = template.fork(list(command["argv"]))
            except Exception as e:
                _reply(reply_fd, op="error", error=f"{type(e).__name__}: {e}")
                continue
            _reply(reply_fd, op="forked", pid=pid,
                   fork_s=round(time.perf_counter() - started, 4))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[0] != "--reply-fd" or argv[2] != "--":
        print("usage: python -m gateway.template_process --reply-fd N -- WORKER-ARGV",
              file=sys.stderr)
        return 2
    # NOTE: no cyclic garbage collection while the template loads: its passes over what
    # importing torch allocates cost ~0.25 s of CPU (~15% of the load, all before the first
    # fork); the load leaves few cycles (~7,000 objects), frozen with the rest at the first
    # fork, where collection is turned back on (Template.fork).
    gc.disable()
    return serve(int(argv[1]), argv[3:])


if __name__ == "__main__":
    sys.exit(main())
