"""A follower rank of a tensor-parallel worker (gateway/tp_group.py starts it; never by hand).

`python -m gateway.tp_follower --rank R --size N --init-method URL --inputs-fd FD`: reads its
engine configuration from rank 0's pipe, joins the group, builds its shard of the engine and
then runs the inputs rank 0 sends (runtime/engine/tp_leader.py) until rank 0 stops the group
or is gone. It serves nothing itself; its exit code tells rank 0's watcher how it ended.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from gateway.logs import configure, get_logger
from gateway.tp_group import GROUP_LOST_EXIT

log = get_logger("tessera.tp_follower")


def _exit_with_parent(period_s: float = 0.5) -> None:
    """Rank 0 gone (even by SIGKILL, even while this rank waits in a collective that will
    never complete): exit."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(0)

    threading.Thread(target=watch, name="tessera-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.tp_follower", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--inputs-fd", type=int, required=True)
    p.add_argument("--worker-id", default="worker")
    args = p.parse_args(argv)
    configure()
    _exit_with_parent()
    import torch.distributed as dist

    from runtime.distributed import TensorParallelGroupLost, init_tensor_parallel
    from runtime.engine import LLMEngine
    from runtime.engine.tp_leader import first_message, follow
    from runtime.errors import TesseraError
    from runtime.loader import open_checkpoint

    stream = os.fdopen(args.inputs_fd, "rb")
    try:
        begin = first_message(stream)
        init_tensor_parallel(args.rank, args.size, args.init_method, device=begin.config.device)
        engine = LLMEngine(open_checkpoint(begin.model), begin.config)
        log.info("tensor-parallel follower ready", worker=args.worker_id, rank=args.rank,
                 size=args.size, device=str(engine.device), threads=engine.num_threads)
        follow(engine, stream)
    except (TensorParallelGroupLost, TesseraError) as e:
        log.error("tensor-parallel follower stops", worker=args.worker_id, rank=args.rank,
                  reason=type(e).__name__, error=str(e))
        return GROUP_LOST_EXIT
    except Exception:
        log.exception("tensor-parallel follower failed", worker=args.worker_id, rank=args.rank)
        return GROUP_LOST_EXIT
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
