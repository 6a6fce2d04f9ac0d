"""Calibration for GPTQ: real text that ships with Python, run through the engine's own prefill
path with hooks that sum x^T x of every projection's input (one Hessian per fused module).

The text is the standard library's docstrings (module and public member docs of a fixed list
of modules), deliberately not the pydoc topics the quality harness (`ops/eval`) scores on.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from runtime.errors import InvalidArgument
from runtime.progress import progress

_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses",
            "datetime", "decimal", "email.message", "functools", "http.client", "itertools",
            "json", "logging", "os", "pathlib", "pickle", "random", "re", "shutil", "socket",
            "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
            "typing", "unittest", "urllib.parse", "uuid", "zipfile")


def calibration_text() -> str:
    """Docstrings of the modules above and their public classes and functions, in a fixed
    order, paragraphs joined by blank lines."""
    parts: list[str] = []
    for module_name in _MODULES:
        module = importlib.import_module(module_name)
        docs = [inspect.getdoc(module)]
        for name in sorted(getattr(module, "__all__", None) or dir(module)):
            member = getattr(module, name, None)
            if not name.startswith("_") and (inspect.isclass(member) or inspect.isfunction(member)):
                docs.append(inspect.getdoc(member))
        parts.extend(d for d in docs if d and len(d) > 80)
    return "\n\n".join(dict.fromkeys(parts))  # de-duplicated, order kept


def calibration_windows(token_ids: list[int], window: int, count: int) -> list[list[int]]:
    """`count` windows of `window` tokens spread evenly over the text."""
    if window < 2 or count < 1:
        raise InvalidArgument("calibration needs windows of >= 2 tokens and at least one window")
    if len(token_ids) < window:
        raise InvalidArgument(f"calibration text has {len(token_ids)} tokens, fewer than one "
                              f"window of {window}")
    last = len(token_ids) - window
    starts = sorted({round(i * last / max(count - 1, 1)) for i in range(count)})
    return [token_ids[s : s + window] for s in starts]


def collect_hessians(engine: Any, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """{module name: sum over calibration tokens of x x^T (float64 [in, in])} for every
    projection of the engine's prefill model, filled by running `windows` through it."""
    from runtime.quant.convert import linear_layers

    sums: dict[str, torch.Tensor] = {}
    handles = []

    def hook_for(name: str):
        def hook(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            prev = sums.get(name)
            sums[name] = x.T @ x if prev is None else prev.addmm_(x.T, x)
        return hook

    for name, module in linear_layers(engine.prefill_model):
        handles.append(module.register_forward_pre_hook(hook_for(name)))
    try:
        for ids in progress(windows, "calibrate (gptq)", unit="windows"):
            engine.prompt_logits(ids, "calibration")
    finally:
        for h in handles:
            h.remove()
    return sums
