"""tessera runtime: the engine and its offline API (the worker process is `gateway/worker.py`).

`from runtime import LLM, SamplingParams` works as in vLLM. Heavy imports are lazy so that the
torch-free bookkeeping modules (scheduler, page pool) import in microseconds.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams",
           "ShadowedPackageError", "check_packages"]

_EXPORTS = {
    "LLM": "runtime.llm",
    "LLMEngine": "runtime.engine",
    "SamplingParams": "runtime.sampling_params",
    "RequestOutput": "runtime.outputs",
    "CompletionOutput": "runtime.outputs",
}


# tessera's top-level packages beside this one, each with a file no same-named package has.
_SIBLINGS = {"kernels": "cpu_ops.py", "gateway": "worker.py", "ops": "cli.py"}
_HINTS = {"kernels": "Hugging Face's `kernels`, which transformers >= 5.25 requires"}
_checked = False


class ShadowedPackageError(ImportError):
    """A top-level package of tessera's resolves to another distribution's module of the same
    name, so every `import kernels` (say) would get that one and fail far from the cause."""


def check_packages() -> None:
    """Raise ShadowedPackageError, naming the module found, where `import kernels`, `gateway`
    or `ops` would not import tessera's own (a same-named distribution earlier on sys.path,
    or one installed over it). Stdlib only; ~0.1 ms, once a process when it passes."""
    global _checked
    if _checked:
        return
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name, marker in _SIBLINGS.items():
        ours = os.path.join(root, name)
        spec = importlib.util.find_spec(name)
        found = os.path.dirname(spec.origin) if spec is not None and spec.origin else None
        if found is not None and os.path.samefile(found, ours) and \
                os.path.exists(os.path.join(found, marker)):
            continue
        what = _HINTS.get(name, "another distribution's top-level module of that name")
        raise ShadowedPackageError(
            f"tessera's `{name}` package ({ours}) is shadowed by {found or 'a namespace package'}"
            f" ({what}): `import {name}` gets that one. Uninstall it (pip uninstall {name}) or "
            f"run tessera in a virtual environment of its own.", name=name)
    _checked = True


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        check_packages()
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
