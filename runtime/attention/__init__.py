"""Attention backends: a registry from name to a lazily imported backend class.

`cpu`: the C++ CPU kernels and the fused decode step. `torch`: the kernels' torch twins, any
device, the reference the others are tested against. `triton`: the Triton kernels, natively on
CUDA and in Triton's interpreter on CPU (the `cuda` extra). `auto` picks `cpu` on CPU, `triton`
on CUDA where triton is installed, else `torch` (docs/DESIGN.md, "Adding a backend").
"""

from __future__ import annotations

import importlib

import torch

from kernels.triton import triton_available
from runtime.attention.backend import AttentionBackend, BatchLayout
from runtime.context import ForwardContext
from runtime.errors import InvalidArgument

# name -> "module:class", imported when first asked for
BACKENDS: dict[str, str] = {
    "cpu": "runtime.attention.cpu:CPUAttentionBackend",
    "torch": "runtime.attention.pure_torch:TorchAttentionBackend",
    "triton": "runtime.attention.triton:TritonAttentionBackend",
}
CHOICES = ("auto", *BACKENDS)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`name` itself, or for `auto` the backend of `device`'s kind. InvalidArgument for an
    unknown name."""
    if name == "auto":
        if device.type == "cpu":
            return "cpu"
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name not in BACKENDS:
        raise InvalidArgument(f"attention_backend must be one of {', '.join(CHOICES)}, "
                              f"got {name!r}", field="attention_backend")
    return name


def make_backend(name: str, device: torch.device | None) -> AttentionBackend:
    """The backend `name` (or `auto`'s pick) for `device` (None: only for `torch`)."""
    if device is None and name != "torch":
        raise InvalidArgument(f"attention backend {name!r} needs a device",
                              field="attention_backend")
    key = name if device is None else resolve_backend_name(name, device)
    module, cls = BACKENDS[key].split(":")
    return getattr(importlib.import_module(module), cls)(device)


def backend_of(ctx: ForwardContext) -> AttentionBackend:
    """The step's backend; a context built by hand without one (calibration, tests) gets the
    `torch` reference."""
    if ctx.backend is None:
        ctx.backend = make_backend("torch", None)
    return ctx.backend


__all__ = ["BACKENDS", "CHOICES", "AttentionBackend", "BatchLayout", "backend_of",
           "make_backend", "resolve_backend_name"]
