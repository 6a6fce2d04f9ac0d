"""Model registry: architecture name -> lazily imported model class."""

from __future__ import annotations

import importlib

from torch import nn

from runtime.config import ModelConfig
from runtime.errors import ModelLoadError

_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "runtime.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "runtime.models.mixtral:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "runtime.models.qwen3_moe:Qwen3MoeForCausalLM",
    "Glm4MoeForCausalLM": "runtime.models.glm4_moe:Glm4MoeForCausalLM",
    "DeepseekV3ForCausalLM": "runtime.models.deepseek_v3:DeepseekV3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(config: ModelConfig) -> type[nn.Module]:
    target = _REGISTRY.get(config.architecture)
    if target is None:
        raise ModelLoadError(
            f"unsupported architecture {config.architecture!r}; supported: "
            f"{', '.join(supported_architectures())}", field="architectures")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
