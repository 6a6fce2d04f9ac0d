"""The one place a model becomes a serving weight format: its linear projections (and a
mixture-of-experts model's routed experts, `runtime.quant.experts`) are replaced by packed
FP8/INT4 modules, everything else (embeddings, norms, rotary tables, routers, lm_head) is
shared with the source model, so a BF16 prefill model and an INT4 decode model can be resident
at once and the second costs only its own linear layers and experts. (DeepSeek-V3's MLA
projections other than o_proj stay in the model dtype.)"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn

from runtime.errors import InvalidArgument
from runtime.formats import TensorBytes, WeightFormat
from runtime.models.layers import RotaryEmbedding
from runtime.models.moe import FusedExperts
from runtime.progress import progress
from runtime.quant.experts import QuantizedExperts
from runtime.quant.fp8 import quantize_fp8_blockwise, quantize_fp8_per_channel
from runtime.quant.linear import Fp8Linear, Int4Linear, quantize_int4_packed

CONVERTIBLE_ARCHITECTURES = ("LlamaForCausalLM",)  # offline, to a checkpoint (tessera convert)
# in memory at load, per phase (`convert_model`)
SERVING_ARCHITECTURES = (*CONVERTIBLE_ARCHITECTURES, "MixtralForCausalLM", "Qwen3MoeForCausalLM",
                         "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")
# Projections that are quantized; lm_head stays in the model dtype (as vLLM's AWQ/GPTQ do).
LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The same layers under their checkpoint (unfused Hugging Face) names.
CHECKPOINT_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj")
FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LinearLike = nn.Linear | Fp8Linear | Int4Linear


def check_architecture(architecture: str,
                       supported: tuple[str, ...] = CONVERTIBLE_ARCHITECTURES) -> None:
    if architecture not in supported:
        raise InvalidArgument(f"cannot convert architecture {architecture!r} to a weight "
                              f"format; supported: {', '.join(supported)}",
                              field="architectures")


def check_group_fits(name: str, in_features: int, fmt: WeightFormat,
                     partial_groups: bool = True) -> None:
    if fmt.name == "int4" and in_features % fmt.group_size and not partial_groups:
        raise InvalidArgument(f"group size {fmt.group_size} does not divide the input dimension "
                              f"{in_features} of tensor {name}", tensor=name)


def linear_layers(model: nn.Module) -> Iterator[tuple[str, LinearLike]]:
    """(qualified name, module) of every quantizable projection (never lm_head)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEAR_NAMES:
            yield name, module  # type: ignore[misc]


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: WeightFormat,
                    name: str = "weight", partial_groups: bool = True) -> LinearLike:
    """One [out, in] weight (and bias) as a module in `fmt`."""
    check_group_fits(name, weight.shape[1], fmt, partial_groups)
    w = weight.detach()
    if fmt.name == "fp8":
        return Fp8Linear.from_float(w, bias, name=name, block=fmt.block)
    if fmt.name == "int4":
        return Int4Linear.from_float(w, bias, fmt.group_size, fmt.symmetric, name=name)
    linear = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(w.to(FLOAT_DTYPES[fmt.name]), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


def quantize_checkpoint_tensor(name: str, tensor: torch.Tensor, fmt: WeightFormat,
                               partial_groups: bool = True,
                               hessian: torch.Tensor | None = None,
                               act_order: bool = False) -> dict[str, torch.Tensor]:
    """One checkpoint weight `...proj.weight` -> its packed tensors, named as the loader reads
    them (`...proj.weight_packed`, `...proj.weight_scale`, ...). A calibration `hessian` of the
    projection's inputs makes the int4 or fp8 codes GPTQ's."""
    prefix = name.removesuffix(".weight")
    check_group_fits(name, tensor.shape[1], fmt, partial_groups)
    if fmt.name == "int4":
        parts = quantize_int4_packed(tensor.float(), fmt.group_size, fmt.symmetric, name,
                                     hessian, act_order)
    else:  # fp8: per-channel `weight_scale`, or DeepSeek-V3's block `weight_scale_inv`
        if hessian is not None:
            from runtime.quant.gptq_fp8 import gptq_fp8

            q, scale = gptq_fp8(tensor.float(), hessian, fmt.block, name)
        elif fmt.block is not None:
            q, scale = quantize_fp8_blockwise(tensor.float(), fmt.block)
        else:
            q, scale = quantize_fp8_per_channel(tensor.float())
        parts = {"weight": q, ("weight_scale" if fmt.block is None else "weight_scale_inv"): scale}
    return {f"{prefix}.{suffix}": t for suffix, t in parts.items()}


def is_quantized_checkpoint_weight(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in CHECKPOINT_LINEAR_NAMES


def convert_model(model: nn.Module, fmt: WeightFormat, partial_groups: bool = True) -> nn.Module:
    """A model whose projections are in `fmt`, sharing every other tensor with `model` (left
    intact). With `partial_groups`, an int4 input dimension that the group size does not divide
    gets a shorter last group (as `WeightFormat.matrix_bytes` counts it); without, it is refused.
    """
    layers = dict(linear_layers(model))
    experts = {name: m for name, m in model.named_modules() if isinstance(m, FusedExperts)}
    if fmt.name in FLOAT_DTYPES and all(
            isinstance(m, nn.Linear) and m.weight.dtype == FLOAT_DTYPES[fmt.name]
            for m in layers.values()) and all(
            m.w13.dtype == FLOAT_DTYPES[fmt.name] for m in experts.values()):
        return model  # nothing to convert, whatever the architecture
    check_architecture(getattr(getattr(model, "config", None), "architecture", "?"),
                       SERVING_ARCHITECTURES)
    if fmt.name in FLOAT_DTYPES:  # NOTE: experts stay as loaded (shared): the engine
        experts = {}  # serves float weights in the compute dtype only (ServingFormats)
    for name, module in layers.items():
        if not isinstance(module, nn.Linear):
            raise InvalidArgument(f"{name} is already {type(module).__name__}: convert the "
                                  f"unquantized model", tensor=f"{name}.weight")
        check_group_fits(f"{name}.weight", module.in_features, fmt, partial_groups)
    clone = _clone_sharing_tensors(model, skip=[*layers.values(), *experts.values()])
    for name, module in progress(layers.items(), f"quantize to {fmt.label}", unit="layers"):
        parent_name, _, child = name.rpartition(".")
        bias = None if module.bias is None else module.bias
        setattr(clone.get_submodule(parent_name), child,
                quantize_linear(module.weight, bias, fmt, f"{name}.weight", partial_groups))
    for name, module in experts.items():
        parent_name, _, child = name.rpartition(".")
        setattr(clone.get_submodule(parent_name), child,
                QuantizedExperts.from_float(module.w13, module.w2, fmt, name))
    return clone


def linear_weight_bytes(model: nn.Module) -> TensorBytes:
    """Stored bytes of the projections' weights (data + scales + zeros; biases excluded), as
    `WeightFormat.matrix_bytes` defines them."""
    total = TensorBytes()
    for _, m in linear_layers(model):
        if isinstance(m, Int4Linear):
            zeros = m.weight_zero_point
            total += TensorBytes(_nbytes(m.weight_packed), _nbytes(m.weight_scale),
                                 0 if zeros is None else _nbytes(zeros))
        elif isinstance(m, Fp8Linear):
            total += TensorBytes(_nbytes(m.weight), _nbytes(m.weight_scale))
        else:
            total += TensorBytes(_nbytes(m.weight))
    return total


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _clone_sharing_tensors(model: nn.Module, skip) -> nn.Module:
    """Deep-copy the module tree, but not its tensors or rotary tables (`skip`: modules about
    to be replaced, shared too rather than copied for nothing)."""
    memo: dict[int, object] = {}
    for module in model.modules():
        if isinstance(module, RotaryEmbedding) or any(module is s for s in skip):
            memo[id(module)] = module
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                memo[id(value)] = value
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None:
                memo[id(t)] = t
    return copy.deepcopy(model, memo)
