"""Building a model's modules on the meta device without running their weight initializers.

The loader replaces every parameter (`load_weights(..., assign=True)` or block modules), so
initial values are never read. Running the initializers is not free even on meta: the first
`nn.init.normal_` on a meta tensor (nn.Embedding's) imports torch._dynamo, inductor and sympy
(~800 modules: ~68 MB of a worker's resident memory and over a second of its start-up,
ops/bench/RESULTS.md#worker-start-up-phases).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

_INITIALIZERS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_", "constant_", "zeros_", "ones_")
_lock = threading.Lock()


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def meta_without_init() -> Iterator[None]:
    """Modules constructed inside are on the meta device and their `nn.init` initializers do
    nothing (the functions are swapped back on exit; one builder at a time)."""
    with _lock:
        saved = {name: getattr(nn.init, name) for name in _INITIALIZERS}
        for name in _INITIALIZERS:
            setattr(nn.init, name, _keep)
        try:
            with torch.device("meta"):
                yield
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)
