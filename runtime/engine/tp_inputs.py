"""What a tensor-parallel group's rank 0 tells its followers, in order: the configuration to
build with, then every input of its engine as it happens (a request admitted, a request
aborted, a step about to run), so that each follower's engine takes the same inputs and runs
the same steps (runtime/engine/tp_leader.py).

Frames on a pipe per follower: a 4-byte big-endian length, then a pickle. vLLM's
multiproc executor broadcasts the scheduler's output through a shared-memory queue once per
step; here the scheduler runs on every rank, so what travels is its inputs, not its output.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import BinaryIO

from runtime.config import EngineConfig
from runtime.input_processor import Prompt
from runtime.sampling_params import SamplingParams

_LENGTH = struct.Struct(">I")


@dataclass(frozen=True)
class BeginGroup:
    """The first frame: this follower's engine configuration and the checkpoint to open."""

    config: EngineConfig
    model: str | None


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    tenant: str
    prompt_text: str | None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class RunStep:
    """Rank 0 is about to run one engine step."""


@dataclass(frozen=True)
class StopGroup:
    """Rank 0 is shutting down: leave the process group and exit."""


StepInput = BeginGroup | AddRequest | AbortRequest | RunStep | StopGroup


def encode(message: StepInput) -> bytes:
    """One frame: length, then the pickled message."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def read_message(stream: BinaryIO) -> StepInput | None:
    """The next frame's message, or None at the end of the stream (rank 0 is gone). Raises
    EOFError for a frame cut short."""
    header = stream.read(_LENGTH.size)
    if not header:
        return None
    if len(header) < _LENGTH.size:
        raise EOFError("a step-input frame was cut short")
    (length,) = _LENGTH.unpack(header)
    body = stream.read(length)
    if len(body) < length:
        raise EOFError("a step-input frame was cut short")
    message = pickle.loads(body)  # NOTE: from our own parent process only, over a private pipe
    if not isinstance(message, BeginGroup | AddRequest | AbortRequest | RunStep | StopGroup):
        raise TypeError(f"not a step input: {type(message).__name__}")
    return message
