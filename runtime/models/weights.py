"""Checkpoint tensors (Hugging Face names) onto a model built on the meta device, through one
explicit table per family: each rule maps a checkpoint name to a parameter and, for fused
parameters, to the part it fills (q/k/v, gate/up, or one expert's slice of a stacked tensor).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from runtime.errors import ModelLoadError


@dataclass(frozen=True)
class Rule:
    """`pattern` (a full-match regex over the checkpoint name) -> `target` (a re.sub template).
    Fused targets concatenate `num_parts` parts along dim 0, `part` being this tensor's; a
    pattern with an `(?P<expert>...)` group fills that expert's slice of a stacked
    [num_experts, ...] parameter."""

    pattern: str
    target: str
    part: int = 0
    num_parts: int = 1


# Shared by the GQA families: fused q/k/v, fused gate/up of dense MLPs and shared experts, and
# routed experts stored per expert (HF's Qwen3-MoE, GLM-4-MoE and DeepSeek-V3 checkpoints).
LAYER = r"(model\.layers\.\d+)"
GQA_RULES = (
    Rule(LAYER + r"\.self_attn\.q_proj\.(weight|bias)", r"\1.self_attn.qkv_proj.\2", 0, 3),
    Rule(LAYER + r"\.self_attn\.k_proj\.(weight|bias)", r"\1.self_attn.qkv_proj.\2", 1, 3),
    Rule(LAYER + r"\.self_attn\.v_proj\.(weight|bias)", r"\1.self_attn.qkv_proj.\2", 2, 3),
)
MLP_RULES = (
    Rule(LAYER + r"\.mlp(\.shared_experts)?\.gate_proj\.weight", r"\1.mlp\2.gate_up_proj.weight",
         0, 2),
    Rule(LAYER + r"\.mlp(\.shared_experts)?\.up_proj\.weight", r"\1.mlp\2.gate_up_proj.weight",
         1, 2),
    Rule(LAYER + r"\.mlp\.experts\.(?P<expert>\d+)\.gate_proj\.weight", r"\1.mlp.experts.w13",
         0, 2),
    Rule(LAYER + r"\.mlp\.experts\.(?P<expert>\d+)\.up_proj\.weight", r"\1.mlp.experts.w13",
         1, 2),
    Rule(LAYER + r"\.mlp\.experts\.(?P<expert>\d+)\.down_proj\.weight", r"\1.mlp.experts.w2"),
)
# Kept in float32 whatever the model dtype: the routers' bias (as the references keep it).
FLOAT32_SUFFIXES = ("e_score_correction_bias",)
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def load_checkpoint(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                    dtype: torch.dtype, rules: tuple[Rule, ...], num_layers: int,
                    tie_word_embeddings: bool) -> None:
    """Assign every tensor of the checkpoint to `model` (built on the meta device) with
    `assign=True`. Layers at or past `num_layers` (multi-token-prediction layers that DeepSeek-V3
    and GLM-4.5 checkpoints ship) are skipped. Raises ModelLoadError naming the first missing,
    unexpected or misshapen tensor."""
    compiled = [(re.compile(r.pattern), r) for r in rules]
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    num_parts: dict[str, int] = {}
    for name, tensor in tensors:
        layer = _LAYER_INDEX.match(name)
        if "rotary_emb.inv_freq" in name or (layer and int(layer.group(1)) >= num_layers):
            continue
        tensor = tensor.to(torch.float32 if name.endswith(FLOAT32_SUFFIXES) else dtype)
        for regex, rule in compiled:
            match = regex.fullmatch(name)
            if match is None:
                continue
            target = match.expand(rule.target)
            expert = match.groupdict().get("expert")
            parts.setdefault(target, {})[(int(expert or 0), rule.part)] = tensor
            num_parts[target] = rule.num_parts
            break
        else:
            state[name] = tensor
    expected = dict(model.state_dict())
    for target, pieces in parts.items():
        state[target] = _assemble(target, pieces, num_parts[target], target.endswith(
            (".w13", ".w2")), expected.get(target))
    if tie_word_embeddings or "lm_head.weight" not in state:
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    check_state(state, {k: v.shape for k, v in expected.items()})
    model.load_state_dict(state, assign=True, strict=True)


def check_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> None:
    """Refuse a state that lacks, adds or misshapes any of the `expected` tensors."""
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"checkpoint is missing tensor {missing[0]} "
                             f"({len(missing)} missing in all)", tensor=missing[0])
    for key, tensor in state.items():
        if key not in expected:
            raise ModelLoadError(f"checkpoint has unexpected tensor {key}", tensor=key)
        if tuple(tensor.shape) != tuple(expected[key]):
            raise ModelLoadError(f"tensor {key} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(expected[key])}", tensor=key)


def _assemble(target: str, pieces: dict[tuple[int, int], torch.Tensor], num_parts: int,
              stacked: bool, like: torch.Tensor | None) -> torch.Tensor:
    experts = like.shape[0] if stacked and like is not None else 1
    want = {(e, p) for e in range(experts) for p in range(num_parts)}
    if set(pieces) != want:
        lacking = sorted(want - set(pieces))
        what = f"expert {lacking[0][0]} part {lacking[0][1]}" if lacking else "extra experts"
        raise ModelLoadError(f"checkpoint's shards of {target} do not add up ({what})",
                             tensor=target)
    rows = [torch.cat([pieces[(e, p)] for p in range(num_parts)], dim=0) for e in range(experts)]
    return torch.stack(rows) if stacked else rows[0]
