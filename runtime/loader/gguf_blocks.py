"""Serving a GGUF file's quantized tensors as stored: the model's projections, embedding and
lm_head are built from Q4_0 / Q4_1 / Q8_0 block planes (`runtime.quant.blocks`) before the
remaining tensors load, so no fp32 copy of them is ever made.

A fused projection (q/k/v, gate/up) is built from blocks only when all its shards share one
block kind; otherwise it, like every F32/F16 or other-typed tensor, loads dequantized.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from runtime.errors import InvalidArgument
from runtime.loader.gguf_loader import GGUFCheckpoint
from runtime.loader.gguf_planes import stored_planes
from runtime.quant.blocks import BlockEmbedding, BlockLinear, BlockPlanes
from runtime.serving_formats import ServingFormats

log = logging.getLogger("tessera.loader")



def load_gguf_as_stored(model: nn.Module, checkpoint: GGUFCheckpoint,
                        dtype: torch.dtype, activations: str = "float32",
                        mapped: bool = False) -> int:
    """Put block modules into `model` (on meta) for every block tensor it can serve, then
    load the rest with `model.load_weights`. `activations` (see `resolve_activations`) is
    what the block linears multiply (`BlockLinear`). With `mapped`, every tensor is read in
    place from the checkpoint's mapped file (`runtime.loader.mapped`, made on first use), else
    imported from the GGUF into this process's memory. Returns the bytes of the planes kept."""
    if mapped:
        from runtime.loader.mapped_gguf import mapped_stored_tensors

        planes, dense = mapped_stored_tensors(checkpoint)
    else:
        planes, used = stored_planes(model.config, checkpoint)
        dense = checkpoint.tensors(skip=used)
    kept = install_planes(model, planes, activations)
    model.load_weights(dense, dtype)
    log.info("GGUF weights served as stored%s: %d modules in blocks (%.1f MB), the rest "
             "dequantized", " from the mapped file" if mapped else "", len(planes), kept / 1e6)
    return kept


def install_planes(model: nn.Module, planes: dict[str, BlockPlanes], activations: str) -> int:
    """Replace each named module of `model` by a block module over its planes (a tied
    `lm_head` reads the embedding's). Returns the bytes of the planes."""
    kept = 0
    for name, p in planes.items():
        if name == "model.embed_tokens":
            _replace(model, name, BlockEmbedding(p))
            if model.config.tie_word_embeddings:
                _replace(model, "lm_head", BlockLinear(p, activations=activations))
        else:
            _replace(model, name, BlockLinear(p, activations=activations))
        kept += p.nbytes()
    return kept


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


GGUF_WEIGHTS = ("auto", "stored", "dequantize")


def serves_as_stored(choice: str, checkpoint: object, formats: ServingFormats,
                     dtype: torch.dtype, device: torch.device) -> bool:
    """Whether to serve a checkpoint's GGUF blocks as stored. `choice` "dequantize": never;
    "stored": yes for a GGUF file with block tensors (InvalidArgument if the serving formats
    ask for other weights: fp8/int4 are converted from the dequantized model); "auto": only
    where it is the faster path (fp32 compute on CPU with the C++ kernels loaded)."""
    if choice not in GGUF_WEIGHTS:
        raise InvalidArgument(f"gguf_weights must be one of {', '.join(GGUF_WEIGHTS)}, got "
                              f"{choice!r}", field="gguf_weights")
    if choice == "dequantize" or not _has_blocks(checkpoint):
        return False
    dense = formats.prefill.weights == formats.decode.weights and \
        formats.decode.weights.name in ("fp32", "bf16", "fp16")
    if choice == "stored":
        if not dense:
            raise InvalidArgument(f"gguf_weights=stored serves the file's own blocks; the "
                                  f"formats ask for {formats.decode.weights.label} weights "
                                  f"(use gguf_weights=dequantize to convert)",
                                  field="gguf_weights")
        return True
    from kernels.cpu_ops import native

    return (dense and dtype == torch.float32 and device.type == "cpu"
            and native() is not None)


def stored_blocks_label(checkpoint: GGUFCheckpoint, activations: str) -> str:
    """What a model served as stored computes with, e.g. "gguf-Q8_0+Q4_1-int8x2": the file's
    block types (in the order first met) and the activations of its block linears,
    the `gguf_activations` choice, "auto" resolved."""
    from runtime.quant.blocks import GGUF_BLOCK_TYPES, resolve_activations

    kinds = dict.fromkeys(t.tensor_type.name for t in checkpoint.reader.tensors
                          if t.tensor_type.name in GGUF_BLOCK_TYPES)
    return f"gguf-{'+'.join(kinds)}-{resolve_activations(activations)}"


def _has_blocks(checkpoint: object) -> bool:
    if not isinstance(checkpoint, GGUFCheckpoint):
        return False
    from runtime.quant.blocks import GGUF_BLOCK_TYPES

    return any(t.tensor_type.name in GGUF_BLOCK_TYPES for t in checkpoint.reader.tensors)
