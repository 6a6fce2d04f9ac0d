"""`tessera convert`: write a GGUF file or Hugging Face directory as a safetensors checkpoint whose
projections are FP8 or INT4 (packed, with scales), described by config.json's
`quantization_config`, which the loader reads back without re-quantizing.

    tessera convert --weights int4 --group-size 128 SRC DST
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from runtime.errors import InvalidArgument
from runtime.formats import CONVERT_METHODS, WeightFormat
from runtime.loader import Checkpoint, open_checkpoint
from runtime.loader.quantized import quantization_config
from runtime.models.llama import map_checkpoint_name
from runtime.progress import progress
from runtime.quant.convert import (
    check_architecture,
    is_quantized_checkpoint_weight,
    quantize_checkpoint_tensor,
)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")
METHODS = CONVERT_METHODS


def convert_checkpoint(src: str | Path | None, dst: str | Path, fmt: WeightFormat,
                       dtype: torch.dtype | None = None, partial_groups: bool = True,
                       method: str = "rtn", calibration_windows: int = 64,
                       act_order: bool | None = None) -> tuple[int, int]:
    """Write `src` to the directory `dst` in `fmt`; returns (source bytes, destination bytes).
    Unquantized tensors keep a safetensors source's dtype unless `dtype` is given; a GGUF's come
    dequantized to float32 (never its storage type) and are written as bfloat16 by default.
    `method="gptq"` (int4 or fp8) first runs `calibration_windows` windows of 256 tokens of
    standard-library docstrings through the model to weigh each projection's rounding, with
    columns in act order unless `act_order=False` (on the default model it cut the KL to the
    unquantized model from 0.26 to 0.15, ops/bench/RESULTS.md#weight-format-quality)."""
    from safetensors.torch import save_file

    if fmt.name not in ("fp8", "int4"):
        raise InvalidArgument(f"convert writes fp8 or int4 weights, not {fmt.name}",
                              field="weights")
    if method not in METHODS:
        raise InvalidArgument(f"method must be one of {METHODS}, got {method!r}", field="method")
    if act_order is not None and method != "gptq":
        raise InvalidArgument("act order is a gptq option", field="act_order")
    if act_order is False and fmt.name == "fp8":
        raise InvalidArgument("fp8 gptq always rounds in act order (its scales are fixed up "
                              "front, so the order costs nothing)", field="act_order")
    act_order = method == "gptq" and act_order is not False
    ckpt = open_checkpoint(src)
    check_architecture(ckpt.config.architecture)
    hessians = _calibrate(ckpt, calibration_windows) if method == "gptq" else {}
    if dtype is None and ckpt.path.is_file():
        dtype = torch.bfloat16
    out = Path(dst)
    if out.exists() and any(out.iterdir()):
        raise InvalidArgument(f"destination {out} exists and is not empty", field="dst")
    tensors: dict[str, torch.Tensor] = {}
    not_quantized = {"lm_head"}
    for name, tensor in progress(ckpt.tensors(), f"convert to {fmt.label}", unit="tensors"):
        if "rotary_emb.inv_freq" in name:
            continue
        if is_quantized_checkpoint_weight(name):
            module = map_checkpoint_name(name)[0].removesuffix(".weight")
            if method == "gptq" and module not in hessians:
                raise InvalidArgument(f"no calibration inputs reached {module}", tensor=name)
            tensors.update(quantize_checkpoint_tensor(name, tensor, fmt, partial_groups,
                                                      hessians.get(module), act_order))
        else:
            tensors[name] = tensor if dtype is None else tensor.to(dtype)
            not_quantized.add(name.rpartition(".")[0])
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = _hf_config(ckpt)
    config["quantization_config"] = quantization_config(fmt, _collapse(not_quantized))
    if fmt.block is None:  # the DeepSeek-V3 block stays exactly as that format ships it
        config["quantization_config"]["method"] = method
    if method == "gptq" and fmt.block is None:
        config["quantization_config"].update(
            calibration=f"{calibration_windows} windows of 256 tokens of standard-library "
                        f"docstrings", act_order=act_order, static_groups=act_order)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(ckpt, out)
    return _size(ckpt.path), _size(out)


def _calibrate(ckpt: Checkpoint, windows: int) -> dict[str, torch.Tensor]:
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.quant.calibration import (
        calibration_text,
        calibration_windows,
        collect_hessians,
    )

    engine = LLMEngine(ckpt, EngineConfig(kv_cache_bytes=64 << 20, enable_prefix_caching=False))
    ids = engine.tokenizer.encode(calibration_text())
    return collect_hessians(engine, calibration_windows(ids, 256, windows))


def _collapse(modules: set[str]) -> list[str]:
    """model.layers.3.input_layernorm -> input_layernorm: one entry per kind of module."""
    return sorted({m if not m.startswith("model.layers.") else m.split(".", 3)[3]
                   for m in modules})


def _hf_config(ckpt: Checkpoint) -> dict[str, Any]:
    if ckpt.path.is_dir():
        return json.loads((ckpt.path / "config.json").read_text())
    return ckpt.config.to_hf_config()


def _write_tokenizer(ckpt: Checkpoint, out: Path) -> None:
    if ckpt.path.is_dir():
        for name in _TOKENIZER_FILES:
            if (ckpt.path / name).is_file():
                shutil.copyfile(ckpt.path / name, out / name)
        return
    tok = ckpt.tokenizer
    tok.backend.save(str(out / "tokenizer.json"))
    cfg = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "add_bos_token": tok.add_bos,
           "chat_template": tok.chat_template, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
