"""`tessera serve --tp N`'s checks before any worker starts: choices no tensor-parallel worker
could start with (its workers would fail and be restarted until the start timeout) end `serve`
with one line naming the cause."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# Runs in a child process: it opens the checkpoint (its config: heads, stored format) and imports
# torch (CUDA devices), which the gateway process never loads. The same checks the engine makes.
_CHECK_IN_CHILD = """
import dataclasses, sys
from gateway.worker import parse_args
from runtime.engine.build import check_tensor_parallel_choices
from runtime.engine_flags import engine_config
from runtime.errors import TesseraError
from runtime.loader import open_checkpoint
args = parse_args(["--socket", "check.sock", *sys.argv[2:]])
try:
    config = dataclasses.replace(engine_config(args), tensor_parallel_size=int(sys.argv[1]))
    check_tensor_parallel_choices(open_checkpoint(args.model), config)
except TesseraError as e:
    print(e.message)
    sys.exit(2)
"""


def check_tensor_parallel_layout(args: argparse.Namespace) -> None:
    """Exit with one line when `--tp` is below 1 or asked of disaggregated pools (not built
    yet). Reads flags only."""
    if args.tp < 1:
        raise SystemExit("tessera serve: --tp must be at least 1")
    if args.tp > 1 and args.prefill_workers > 0:
        raise SystemExit("tessera serve: --tp works with colocated workers only; disaggregated "
                         "serving (--prefill-workers) does not move KV between "
                         "tensor-parallel groups yet")


def check_tensor_parallel_model(args: argparse.Namespace, worker_words: list[str]) -> None:
    """Exit with one line when the model or host cannot run `--tp` ranks: more ranks than the
    model's KV heads, than the visible CUDA devices, or quantized weights (TP splits float
    weights only). `worker_words`: the engine flags every worker gets (the model included).
    Takes a few seconds (a child process opens the checkpoint); nothing when --tp is 1."""
    tp = args.tp
    if tp == 1:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", _CHECK_IN_CHILD, str(tp), *worker_words],
                          capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0:
        why = proc.stdout.strip() or (proc.stderr.strip().splitlines()
                                      or [f"the check exited {proc.returncode}"])[-1]
        raise SystemExit(f"tessera serve: --tp {tp}: {why}")
