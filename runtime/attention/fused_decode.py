"""The fused step for Llama-family models served from GGUF blocks on CPU
(`kernels.decode_llama`): when it applies, and its build from a model and its KV cache, kept
per model by the `cpu` attention backend (`runtime/attention/cpu.py`).

It applies to any step, decodes and prefill chunks alike (each chunk token is one row of the
decode kernel over its sequence's pages: `fused_rows`), of a model that allows it
(`LlamaModel.fused_decode`) whose four projections in every layer are `BlockLinear`s with no
hooks (tensor-parallel shards add an all-reduce hook) and whose activations stay in float32 or
int8 at the step's row count (bf16's many-row path runs in Python). Otherwise the model's
Python forward runs; both give the same numbers (tests/runtime/test_fused_decode.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.decode_llama import (
    BlockProjSpec,
    DecodeLayerSpec,
    FusedLlamaDecode,
    fused_decode_available,
)
from runtime.context import AttentionMetadata
from runtime.models.layers import RotaryEmbedding
from runtime.quant.blocks import BlockLinear


def _proj(linear: nn.Module) -> BlockProjSpec | None:
    if (type(linear) is not BlockLinear or linear._forward_hooks or linear._forward_pre_hooks
            or linear.qs.device.type != "cpu"):
        return None
    bias = None if linear.bias is None else linear.bias.detach()
    if bias is not None and bias.dtype != torch.float32:
        return None
    if linear.pw is not None:  # the panel-major copy the int8 kernels read (BlockLinear)
        return BlockProjSpec(linear.kind == "q8", linear.limbs, linear.pw, linear.pd, linear.pm,
                             bias)
    return BlockProjSpec(linear.kind == "q8", linear.limbs, linear.qs, linear.d, linear.m, bias)


def max_fused_rows(model: nn.Module) -> int:
    """The most decode rows the fused step serves: with bf16 activations, past
    `BlockLinear.bf16_min_rows` the projections leave the float32 kernels."""
    first = model.layers[0].self_attn.qkv_proj
    return BlockLinear.bf16_min_rows if getattr(first, "bf16", False) else 1 << 30


def build_fused_decode(model: nn.Module, kv_cache: object) -> FusedLlamaDecode | None:
    """The fused step over a `LlamaModel`'s layers and `kv_cache`'s pages, or None where it does not
    apply (see the module docstring)."""
    if not fused_decode_available():
        return None
    specs: list[DecodeLayerSpec] = []
    for index, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        projs = [_proj(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        hooked = any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules())
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if (None in projs or hooked or type(attn.rotary) is not RotaryEmbedding
                or any(w.dtype != torch.float32 for w in norms)):
            return None
        kv = kv_cache.layer(index)  # type: ignore[attr-defined]
        if kv.v is None:
            return None
        qkv, o, gate_up, down = projs
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        specs.append(DecodeLayerSpec(norms[0].detach(), norms[1].detach(), qkv, o, gate_up,
                                     down, kv.k, kv.v, kv.k_scale, kv.v_scale, kv.hadamard,
                                     kv.k_shift, kv.k_channel_scale, kv.v_channel_scale))
    first = model.layers[0].self_attn
    eps = model.layers[0].input_layernorm.eps
    return FusedLlamaDecode(first.num_heads, first.num_kv_heads, first.head_dim, eps,
                            first.attn.scale, specs)


def fused_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of the step as one row of the fused step's attention: its page-table row
    [T, max_pages] and its context length [T]. A decode is its sequence's row; token i of a
    prefill chunk of c tokens ending at context length n attends to the first n - c + i + 1
    tokens over its sequence's pages, which is what `paged_prefill_attention` computes on CPU
    (the decode kernel, one row per token, `kernels.paged_attention`): the masks of
    `BatchLayout.prefill_slices` are that causal mask by construction."""
    if not meta.prefills and len(meta.decodes) == 1:
        return meta.decodes[0].page_table, meta.decodes[0].context_lens
    width = max([g.page_table.shape[1] for g in meta.decodes]
                + [p.page_ids.shape[0] for p in meta.prefills])
    tables, lens = [], []
    for g in meta.decodes:
        tables.append(F.pad(g.page_table, (0, width - g.page_table.shape[1])))
        lens.append(g.context_lens)
    for p in meta.prefills:
        chunk = p.end - p.start
        row = F.pad(p.page_ids, (0, width - p.page_ids.shape[0]))
        tables.append(row.unsqueeze(0).expand(chunk, width))
        lens.append(torch.arange(p.context_len - chunk + 1, p.context_len + 1,
                                 device=row.device))
    return torch.cat(tables), torch.cat(lens)


class FusedSteps:
    """The fused step of each model, built on first use and again when the KV cache it reads
    (its pages or their key smoothing) is replaced; None where it does not apply."""

    def __init__(self) -> None:
        # model -> (the cache's k pages, its key smoothing, the step or None)
        self.built: dict[nn.Module, tuple[object, object, FusedLlamaDecode | None]] = {}

    def step_for(self, model: nn.Module, x: torch.Tensor,
                 kv_cache: object) -> FusedLlamaDecode | None:
        """The step for this batch `x` [T, hidden]: float32 activations, within the
        rows it serves, a model that allows it."""
        if (not getattr(model, "fused_decode", False) or x.dtype != torch.float32
                or x.shape[0] > max_fused_rows(model)):
            return None
        cache: Any = kv_cache
        built = self.built.get(model)
        if built is None or built[0] is not cache.k or built[1] is not cache.key_smoothing:
            built = (cache.k, cache.key_smoothing, build_fused_decode(model, cache))
            self.built[model] = built
        return built[2]
