"""One engine over a tensor-parallel group of processes: rank 0's engine
(`TensorParallelLeader`) sends every input it takes to the followers as it takes it, and each
follower's engine (`follow`) takes the same inputs in the same order and runs the same steps,
so the ranks' schedulers, page pools and samplers stay identical (SPMD, runtime/distributed.py
checks it every step). Only rank 0's outputs leave the group.

The shape follows vLLM's multiproc executor and SGLang's TP workers: one driver that the
server talks to, followers that do what it does, and a group that fails as a whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, BinaryIO

from runtime.config import EngineConfig
from runtime.distributed import TensorParallelDesync, TensorParallelGroupLost
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.tp_inputs import (
    AbortRequest,
    AddRequest,
    BeginGroup,
    RunStep,
    StepInput,
    StopGroup,
    read_message,
)
from runtime.errors import RequestCancelled, TesseraError
from runtime.input_processor import Prompt
from runtime.loader import Checkpoint
from runtime.outputs import EngineCoreOutput, RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence

log = logging.getLogger("tessera.tensor_parallel")


def stop_group_on_failed_forward(engine: LLMEngine) -> None:
    """Make a failed forward stop the group: one process's step fails its requests and goes
    on (runtime/engine/step.py), but a rank that failed mid-step has left the others inside a
    collective or ahead of it, with KV that no longer matches theirs."""
    execute = engine.runner.execute

    def guarded(batch: Any) -> Any:
        try:
            return execute(batch)
        except Exception as e:
            raise TensorParallelGroupLost(f"a forward failed on this rank: "
                                          f"{type(e).__name__}: {e}") from e

    engine.runner.execute = guarded  # type: ignore[method-assign]


class TensorParallelLeader(LLMEngine):
    """Rank 0's engine: an LLMEngine that sends each input it takes (admissions, aborts, the
    start of each step) through `send` before acting on it, in the order it takes them.
    `send` raises (a follower's pipe is closed) only when the group is already lost."""

    def __init__(self, checkpoint: Checkpoint, config: EngineConfig,
                 send: Callable[[StepInput], None]) -> None:
        self._send = send
        self._stepping = False  # aborts inside a step are the step's own: every rank makes them
        super().__init__(checkpoint, config)
        stop_group_on_failed_forward(self)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    tenant: str = "default", *, prompt_text: str | None = None) -> Sequence:
        seq = super().add_request(request_id, prompt, params, tenant, prompt_text=prompt_text)
        # NOTE: only once admitted here: a refused request never reaches the followers.
        self._send(AddRequest(request_id, prompt, params, tenant, prompt_text))
        return seq

    def abort_request(self, request_id: str,
                      error: TesseraError | None = None) -> RequestOutput | None:
        self._send_abort(request_id)
        return super().abort_request(request_id, error)

    def abort_request_core(self, request_id: str,
                           error: TesseraError | None = None) -> EngineCoreOutput | None:
        self._send_abort(request_id)
        return super().abort_request_core(request_id, error)

    def _send_abort(self, request_id: str) -> None:
        if not self._stepping and request_id in self.requests:
            self._send(AbortRequest(request_id))

    def _step(self) -> list[tuple[Sequence, EngineCoreOutput]]:
        self._send(RunStep())
        self._stepping = True
        try:
            return super()._step()
        except TensorParallelDesync as e:
            raise TensorParallelGroupLost(str(e)) from e
        finally:
            self._stepping = False


def apply_input(engine: LLMEngine, message: StepInput) -> bool:
    """Apply one of rank 0's inputs to a follower's engine; False once the group stops."""
    if isinstance(message, AddRequest):
        engine.add_request(message.request_id, message.prompt, message.params, message.tenant,
                           prompt_text=message.prompt_text)
    elif isinstance(message, AbortRequest):
        engine.abort_request_core(message.request_id, RequestCancelled("aborted on rank 0"))
    elif isinstance(message, RunStep):
        try:
            engine.step_core()  # NOTE: outputs are rank 0's to send; a follower drops its own
        except TensorParallelDesync as e:
            raise TensorParallelGroupLost(str(e)) from e
    elif isinstance(message, StopGroup):
        return False
    else:  # BeginGroup comes once, before the engine exists
        raise TensorParallelGroupLost(f"unexpected {type(message).__name__} from rank 0")
    return True


def follow(engine: LLMEngine, stream: BinaryIO) -> None:
    """A follower's loop: rank 0's inputs, one at a time, until it stops the group or is gone
    (the end of `stream`). Any failure raises TensorParallelGroupLost."""
    stop_group_on_failed_forward(engine)
    engine.grammars.prepare()  # as rank 0's warm-up does; its request arrives as inputs
    while (message := read_message(stream)) is not None:
        try:
            if not apply_input(engine, message):
                return
        except TensorParallelGroupLost:
            raise
        except Exception as e:  # rank 0 took this input: a follower that cannot is out of step
            raise TensorParallelGroupLost(f"{type(message).__name__} failed on a follower: "
                                          f"{type(e).__name__}: {e}") from e
    log.warning("rank 0 closed the step inputs without stopping the group")


def first_message(stream: BinaryIO) -> BeginGroup:
    """The group's first frame (its configuration); raises TensorParallelGroupLost otherwise."""
    message = read_message(stream)
    if not isinstance(message, BeginGroup):
        raise TensorParallelGroupLost(f"expected the group's configuration from rank 0, got "
                                      f"{type(message).__name__}")
    return message
