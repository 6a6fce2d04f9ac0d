"""Quantized checkpoints: the `quantization_config` block of config.json, and building packed
projection modules from their stored tensors as they are, never re-quantizing. Every
disagreement between the config and a tensor is a ModelLoadError naming it.

Two methods are read: `tessera` (written by `tessera convert`: per-channel fp8, int4) and `fp8`,
the block-scaled FP8 that DeepSeek-V3 and Kimi-K2 ship (Hugging Face's FineGrainedFP8Config):
`{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}`, each projection an e4m3 `weight` and a float32
`weight_scale_inv` [ceil(out/128), ceil(in/128)] (see `runtime/quant/fp8.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from runtime.errors import ModelLoadError, TesseraError
from runtime.formats import WeightFormat

QUANT_METHOD = "tessera"
BLOCK_FP8_METHOD = "fp8"
# checkpoint projection name -> (fused module name, shard index)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "o_proj": ("o_proj", 0), "down_proj": ("down_proj", 0)}
_SHARDS = {"qkv_proj": 3, "gate_up_proj": 2, "o_proj": 1, "down_proj": 1}


def quantization_config(fmt: WeightFormat, not_quantized: list[str]) -> dict[str, Any]:
    """The config.json block, shaped like the ecosystem's (compressed-tensors / AWQ names; for
    block-scaled fp8, exactly DeepSeek-V3's)."""
    if fmt.block is not None:
        return {"quant_method": BLOCK_FP8_METHOD, "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(fmt.block)}
    block: dict[str, Any] = {"quant_method": QUANT_METHOD, "format": fmt.name,
                             "modules_not_quantized": not_quantized}
    if fmt.name == "int4":
        block.update(bits=4, group_size=fmt.group_size, symmetric=fmt.symmetric,
                     scale_dtype="bfloat16", packing="uint8, two codes a byte, low nibble first",
                     partial_last_group=True)
    else:
        block.update(bits=8, scale_dtype="float32", strategy="channel")
    return block


def parse_quantization_config(cfg: dict[str, Any]) -> WeightFormat | None:
    block = cfg.get("quantization_config")
    if block is None:
        return None
    if isinstance(block, dict) and block.get("quant_method") == BLOCK_FP8_METHOD:
        return _parse_block_fp8(block)
    if not isinstance(block, dict) or block.get("quant_method") != QUANT_METHOD:
        method = block.get("quant_method") if isinstance(block, dict) else block
        raise ModelLoadError(f"quantization method {method!r} is not supported (only "
                             f"{QUANT_METHOD!r}, written by tessera convert, and "
                             f"{BLOCK_FP8_METHOD!r}, DeepSeek-V3-style block FP8)",
                             field="quantization_config")
    try:
        return WeightFormat.parse(str(block["format"]), int(block.get("group_size", 128)),
                                  bool(block.get("symmetric", True)))
    except (KeyError, TypeError, ValueError, TesseraError) as e:
        raise ModelLoadError(f"bad quantization_config: {e}", field="quantization_config") from e


def _parse_block_fp8(block: dict[str, Any]) -> WeightFormat:
    def bad(message: str) -> ModelLoadError:
        return ModelLoadError(f"bad quantization_config: {message}", field="quantization_config")

    if block.get("fmt", "e4m3") != "e4m3":
        raise bad(f"fp8 format {block.get('fmt')!r} is not served (only e4m3)")
    if block.get("activation_scheme", "dynamic") != "dynamic":
        raise bad(f"activation_scheme {block.get('activation_scheme')!r} is not served (only "
                  f"dynamic: activations stay in the compute dtype)")
    size = block.get("weight_block_size")
    if (not isinstance(size, list) or len(size) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in size)):
        raise bad(f"weight_block_size must be two positive integers, got {size!r}")
    return WeightFormat("fp8", block=(size[0], size[1]))


def load_quantized_projections(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                               dtype: torch.dtype, fmt: WeightFormat
                               ) -> tuple[list[tuple[str, torch.Tensor]], tuple[str, ...]]:
    """Build every projection of `model` (on meta) from its packed shards; return the other
    tensors and the prefixes of the modules built."""
    parts: dict[str, dict[int, tuple[str, dict[str, torch.Tensor]]]] = {}
    rest: list[tuple[str, torch.Tensor]] = []
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj not in _FUSED:
            rest.append((name, tensor))
            continue
        target, shard = _FUSED[proj]
        entry = parts.setdefault(f"{parent}.{target}", {}).setdefault(shard, (module, {}))
        entry[1][leaf] = tensor
    built = []
    for name, meta in list(model.named_modules()):
        if name.rpartition(".")[2] not in _SHARDS:
            continue
        shards = parts.pop(name, {})
        if sorted(shards) != list(range(_SHARDS[name.rpartition(".")[2]])):
            raise ModelLoadError(f"checkpoint lacks some of the shards of {name}", tensor=name)
        module = _build(meta, [shards[i] for i in sorted(shards)], dtype, fmt)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)
        built.append(f"{name}.")
    for name in parts:
        raise ModelLoadError(f"checkpoint has unexpected tensors for {name}", tensor=name)
    return rest, tuple(built)


def _build(meta: nn.Linear, shards: list[tuple[str, dict[str, torch.Tensor]]], dtype: torch.dtype,
           fmt: WeightFormat) -> nn.Module:
    from runtime.quant.fp8 import expand_block_rows
    from runtime.quant.linear import Fp8Linear, Int4Linear

    in_features = meta.in_features
    leaves = ({"weight_packed", "weight_scale"} | ({"weight_zero_point"} if not fmt.symmetric
              else set())) if fmt.name == "int4" else {"weight", "weight_scale"}
    if fmt.block is not None:
        leaves = {"weight", "weight_scale_inv"}
    if meta.bias is not None:
        leaves |= {"bias"}
    checked: list[dict[str, torch.Tensor]] = []
    for name, shard in shards:
        for leaf in sorted(leaves - set(shard)):
            raise ModelLoadError(f"checkpoint is missing tensor {name}.{leaf} that "
                                 f"{fmt.label} weights need", tensor=f"{name}.{leaf}")
        for leaf in sorted(set(shard) - leaves):
            raise ModelLoadError(f"tensor {name}.{leaf} does not belong in a {fmt.label} "
                                 f"checkpoint (quantization_config says {fmt.label})",
                                 tensor=f"{name}.{leaf}")
        _check_shard(name, shard, in_features, fmt)
        checked.append(shard)
    bias = torch.cat([s["bias"] for s in checked]).to(dtype) if meta.bias is not None else None
    rows = sum(s["weight" if fmt.block else "weight_scale"].shape[0] for s in checked)
    if rows != meta.out_features:
        names = "+".join(n for n, _ in shards)
        raise ModelLoadError(f"{names} hold {rows} rows, the model needs {meta.out_features}",
                             tensor=f"{shards[0][0]}.weight_scale")
    if fmt.block is not None:  # one scale per (row, column block), so shards concatenate
        scales = [expand_block_rows(s["weight_scale_inv"], s["weight"].shape[0], fmt.block[0])
                  for s in checked]
        return Fp8Linear(torch.cat([s["weight"] for s in checked]), torch.cat(scales), bias,
                         block_cols=fmt.block[1])
    if fmt.name == "fp8":
        return Fp8Linear(torch.cat([s["weight"] for s in checked]),
                         torch.cat([s["weight_scale"] for s in checked]), bias)
    zeros = None
    if not fmt.symmetric:  # zeros are packed over each shard's row-major [rows, groups]
        from runtime.quant.linear import _pack_rows, _unpack_rows

        flat = torch.cat([_unpack_rows(s["weight_zero_point"])[: s["weight_scale"].numel()]
                          for s in checked])
        zeros = _pack_rows(torch.nn.functional.pad(flat, (0, flat.numel() % 2)))
    return Int4Linear(torch.cat([s["weight_packed"] for s in checked]),
                      torch.cat([s["weight_scale"] for s in checked]), zeros, in_features,
                      fmt.group_size, bias)


def _check_shard(name: str, shard: dict[str, torch.Tensor], in_features: int,
                 fmt: WeightFormat) -> None:
    if fmt.block is not None:
        weight = shard["weight"]
        rows = weight.shape[0] if weight.dim() == 2 else -1
        blocks = (-(-rows // fmt.block[0]), -(-in_features // fmt.block[1]))
        want = {"weight": (torch.float8_e4m3fn, (rows, in_features)),
                "weight_scale_inv": (torch.float32, blocks)}
        _check_leaves(name, shard, want, fmt)
        return
    scale = shard["weight_scale"]
    rows = scale.shape[0] if scale.dim() >= 1 else -1
    if fmt.name == "fp8":
        want = {"weight": (torch.float8_e4m3fn, (rows, in_features)),
                "weight_scale": (torch.float32, (rows,))}
    else:
        groups = -(-in_features // fmt.group_size)
        want = {"weight_packed": (torch.uint8, (rows, -(-in_features // 2))),
                "weight_scale": (torch.bfloat16, (rows, groups))}
        if not fmt.symmetric:
            want["weight_zero_point"] = (torch.uint8, (-(-rows * groups // 2),))
    _check_leaves(name, shard, want, fmt, in_features)


def _check_leaves(name: str, shard: dict[str, torch.Tensor],
                  want: dict[str, tuple[torch.dtype, tuple[int, ...]]], fmt: WeightFormat,
                  in_features: int = 0) -> None:
    for leaf, (dt, shape) in want.items():
        t = shard[leaf]
        if t.dtype != dt:
            raise ModelLoadError(f"tensor {name}.{leaf} is {t.dtype}, {fmt.label} stores "
                                 f"{dt}", tensor=f"{name}.{leaf}")
        if tuple(t.shape) != shape:
            hint = (f" (group size {fmt.group_size} over {in_features} inputs makes "
                    f"{shape[-1]} groups)" if leaf == "weight_scale" and fmt.name == "int4" else "")
            raise ModelLoadError(f"tensor {name}.{leaf} has shape {tuple(t.shape)}, expected "
                                 f"{shape}{hint}", tensor=f"{name}.{leaf}")
