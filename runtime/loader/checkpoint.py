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

    def release_file_pages(self) -> None:
        """Drop the pages of the file mapping this checkpoint read its tensors through from
        the process's resident set, once the model holds its own copies (a later read maps
        them in again from the file). A no-op for formats that keep no mapping open."""
        return None

    def populate_pages(self) -> None:
        """Map the pages of the weights this checkpoint serves in place into this process's
        page table now, from the page cache (a worker forked from a template does this rather
        than fault them in during its first request). A no-op for formats that copy."""
        return None
