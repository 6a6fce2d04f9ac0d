"""A GGUF checkpoint's served-as-stored tensors through its mapped file (runtime.loader.mapped):
the block planes each module serves (imported, permuted and fused once, at conversion) and the
dequantized float32 remainder (norms), all read in place from one shared read-only mapping."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from runtime.errors import ModelLoadError
from runtime.loader.gguf_loader import GGUFCheckpoint
from runtime.loader.gguf_planes import stored_planes
from runtime.loader.mapped import MappedWeights, open_or_make
from runtime.quant.blocks import BlockPlanes

FORMAT = "gguf-stored"  # blocks as stored + float32 remainder, by module / HF name
_PLANE_FIELDS = ("qs", "d", "m")


def mapped_stored_tensors(checkpoint: GGUFCheckpoint
                          ) -> tuple[dict[str, BlockPlanes], Iterator[tuple[str, torch.Tensor]]]:
    """(module name -> planes, dense (HF name, tensor) pairs), every tensor a read-only view of
    the mapped file. The file is made from `checkpoint` when no valid one exists."""
    weights = checkpoint_mapping(checkpoint)
    held = weights.index["tensors"]
    planes = {}
    for module, kind in weights.meta["planes"].items():
        fields = [f"{module}.{f}" for f in _PLANE_FIELDS]
        planes[module] = BlockPlanes(kind, *(weights.tensor(f) if f in held else None
                                             for f in fields))
    return planes, ((name, weights.tensor(name)) for name in weights.meta["dense"])


def checkpoint_mapping(checkpoint: GGUFCheckpoint) -> MappedWeights:
    """The mapped file of `checkpoint`'s served-as-stored tensors, made first if needed. It is
    kept on the checkpoint, so a template and the workers forked from it map the file once."""
    mapped = getattr(checkpoint, "mapped", None)
    if isinstance(mapped, MappedWeights):
        return mapped
    mapped = open_or_make(checkpoint.path, FORMAT, lambda: _convert(checkpoint),
                          stat=checkpoint.source_stat)
    checkpoint.mapped = mapped  # type: ignore[attr-defined]
    return mapped


def _convert(checkpoint: GGUFCheckpoint) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    planes, used = stored_planes(checkpoint.config, checkpoint)
    tensors: list[tuple[str, torch.Tensor]] = []
    kinds: dict[str, str] = {}
    for module, p in planes.items():
        kinds[module] = p.kind
        for field in _PLANE_FIELDS:
            t = getattr(p, field)
            if t is not None:
                tensors.append((f"{module}.{field}", t))
    dense = []
    for name, t in checkpoint.tensors(skip=used):
        if t.dtype != torch.float32:
            raise ModelLoadError(f"tensor {name} dequantized to {t.dtype}", tensor=name)
        dense.append(name)
        tensors.append((name, t))
    return tensors, {"planes": kinds, "dense": dense, "revision": checkpoint.revision}
