"""Hugging Face checkpoint directories: config.json, *.safetensors, tokenizer.json."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from runtime.config import ModelConfig
from runtime.errors import ModelLoadError, ModelNotFound
from runtime.loader.checkpoint import Checkpoint
from runtime.loader.quantized import parse_quantization_config
from runtime.tokenizer import Tokenizer


class HFCheckpoint(Checkpoint):
    files: list[Path]

    @classmethod
    def open(cls, path: Path) -> HFCheckpoint:
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelNotFound(f"{path} has no config.json: not a model directory", path=path)
        raw = cfg_file.read_bytes()
        try:
            cfg = json.loads(raw)
        except ValueError as e:
            raise ModelLoadError(f"cannot parse {cfg_file}: {e}", field="config.json") from e
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{cfg_file} is not a JSON object", field="config.json")
        _merge_generation_config(path, cfg)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path} has no *.safetensors files", path=path)
        ckpt = cls(ModelConfig.from_hf_config(cfg), Tokenizer.from_hf_dir(path), path,
                   f"{path.name}@{hashlib.sha256(raw).hexdigest()[:12]}",
                   parse_quantization_config(cfg))
        ckpt.files = files
        return ckpt

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import SafetensorError, safe_open

        for file in self.files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except (SafetensorError, OSError, RuntimeError) as e:
                raise ModelLoadError(f"cannot read {file.name}: {e}", path=file) from e


def _merge_generation_config(path: Path, cfg: dict) -> None:
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return
    try:
        gen = json.loads(gen_file.read_text())
    except ValueError:
        return
    eos = gen.get("eos_token_id")
    if eos is not None:
        cfg["eos_token_id"] = eos
