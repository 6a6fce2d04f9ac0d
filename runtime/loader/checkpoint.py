"""What every checkpoint format gives the engine: config, tokenizer, and tensors streamed by
their Hugging Face names."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.config import ModelConfig
from runtime.formats import WeightFormat
from runtime.tokenizer import Tokenizer


@dataclass
class Checkpoint(abc.ABC):
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    revision: str  # names the exact weights served (file name and size, or config hash)
    quantization: WeightFormat | None = None  # how the projections are stored (config.json)

    @abc.abstractmethod
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) pairs, streamed from disk."""
