"""The per-device weight prepare hook: once a model is on its device, each quantized module
takes the layout that device's kernels read (`Int4Linear` repacks to the GPU tiles where the
device has `w4a16_linear`, `Fp8Linear` picks the block-FP8 kernel where it has
`fp8_block_linear`, block-FP8 `QuantizedExperts` run W8A8 where it has `fused_moe`). Runs
once at load, never per call."""

from __future__ import annotations

from torch import nn


def prepare_weights(model: nn.Module) -> int:
    """Call `prepare_for_device()` on every module of `model` that has one; returns how many."""
    prepared = 0
    for module in model.modules():
        hook = getattr(module, "prepare_for_device", None)
        if callable(hook):
            hook()
            prepared += 1
    return prepared
