"""Split a loaded model across the ranks of a tensor-parallel group (Megatron-style), in place.

Per decoder layer:
- attention: heads split across ranks by KV-head groups (a rank takes a contiguous range of
  KV heads and the query heads that read them; uneven counts allowed, e.g. SmolLM2's 3 KV heads
  over 2 ranks as 2 + 1). q/k/v is column-parallel (output rows of this rank's heads), o_proj
  row-parallel (its input columns), and the attention output is all-reduced. MLA (DeepSeek-V3):
  q_b_proj / kv_b_proj rows and o_proj columns of this rank's heads; the latent projections
  and the latent pages they fill are replicated, since every head reads the whole latent.
- MLP: gate/up column-parallel, down row-parallel, one all-reduce of the output.
- MoE: every expert is split the same way (tensor-parallel experts, not expert-parallel), the
  router and its scores are replicated, and routed plus shared experts' partial sums take one
  all-reduce together. Tensor-parallel experts keep the ranks balanced whatever the routing
  and need no token all-to-all; expert parallelism pays off with hundreds of experts on many
  GPUs (DeepSeek-V3's 256), which is where it belongs next.
Embeddings, norms and lm_head are replicated (small next to the layers at this model size;
a vocab-parallel head would save memory at 150k-entry vocabularies).

The all-reduces are forward hooks on the attention and MLP modules, so the model files stay
single-device code and a later format conversion that swaps projections keeps them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from runtime.distributed import TensorParallel, split_range
from runtime.errors import InvalidArgument
from runtime.models.llama import LlamaAttention, LlamaMLP
from runtime.models.mla import DeepseekV3Attention
from runtime.models.moe import SparseMoeBlock, SwiGLU
from runtime.models.moe_decoder import GQAAttention


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def column_parallel(linear: nn.Linear, rows: list[tuple[int, int]]) -> None:
    """Keep only these [start, end) ranges of output rows (weight rows and bias)."""
    linear.weight = _param(torch.cat([linear.weight[a:b] for a, b in rows]))
    if linear.bias is not None:
        linear.bias = _param(torch.cat([linear.bias[a:b] for a, b in rows]))
    linear.out_features = linear.weight.shape[0]


def row_parallel(linear: nn.Linear, cols: tuple[int, int], tp: TensorParallel) -> None:
    """Keep only input columns [start, end); the bias stays on rank 0 alone, so the all-reduce
    of the partial outputs adds it once."""
    linear.weight = _param(linear.weight[:, cols[0] : cols[1]])
    if linear.bias is not None and tp.rank != 0:
        linear.bias = _param(torch.zeros_like(linear.bias))
    linear.in_features = linear.weight.shape[1]


def _scaled(r: tuple[int, int], unit: int, offset: int = 0) -> tuple[int, int]:
    return offset + r[0] * unit, offset + r[1] * unit


def _shard_gqa(attn: LlamaAttention | GQAAttention, tp: TensorParallel) -> None:
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if kv_heads < tp.size:
        raise InvalidArgument(f"tensor_parallel_size={tp.size} exceeds the model's {kv_heads} "
                              f"KV heads", field="tensor_parallel_size")
    kv = split_range(kv_heads, tp.size, tp.rank)
    group = heads // kv_heads
    q = (kv[0] * group, kv[1] * group)
    q_size, kv_size = heads * dim, kv_heads * dim
    column_parallel(attn.qkv_proj, [_scaled(q, dim), _scaled(kv, dim, q_size),
                                    _scaled(kv, dim, q_size + kv_size)])
    row_parallel(attn.o_proj, _scaled(q, dim), tp)
    attn.num_heads = attn.attn.num_heads = q[1] - q[0]
    attn.num_kv_heads = attn.attn.num_kv_heads = kv[1] - kv[0]
    attn.q_size, attn.kv_size = attn.num_heads * dim, attn.num_kv_heads * dim


def _shard_mla(attn: DeepseekV3Attention, tp: TensorParallel) -> None:
    m = attn.mla
    heads = split_range(m.num_heads, tp.size, tp.rank)
    q_proj = attn.q_proj if m.q_lora_rank is None else attn.q_b_proj
    column_parallel(q_proj, [_scaled(heads, m.qk_head_dim)])
    kv_b = attn.kv_b_proj
    rows = _scaled(heads, m.qk_nope_head_dim + m.v_head_dim)
    kv_b.weight = _param(kv_b.weight[rows[0] : rows[1]])
    row_parallel(attn.o_proj, _scaled(heads, m.v_head_dim), tp)
    attn.mla = dataclasses.replace(m, num_heads=heads[1] - heads[0])


def _shard_swiglu(mlp: LlamaMLP | SwiGLU, tp: TensorParallel) -> None:
    inter = mlp.down_proj.in_features
    cols = split_range(inter, tp.size, tp.rank)
    column_parallel(mlp.gate_up_proj, [cols, _scaled(cols, 1, inter)])
    row_parallel(mlp.down_proj, cols, tp)


def _shard_moe(block: SparseMoeBlock, tp: TensorParallel) -> None:
    experts = block.experts
    inter = experts.w2.shape[2]
    a, b = split_range(inter, tp.size, tp.rank)
    experts.w13 = _param(torch.cat((experts.w13[:, a:b], experts.w13[:, inter + a : inter + b]),
                                   dim=1))
    experts.w2 = _param(experts.w2[:, :, a:b])
    if block.shared_experts is not None:
        _shard_swiglu(block.shared_experts, tp)


def _all_reduce_hook(tp: TensorParallel) -> Callable[..., torch.Tensor]:
    def hook(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(output)

    return hook


def shard_model(model: nn.Module, tp: TensorParallel) -> None:
    """Keep this rank's share of every decoder layer of a loaded model (float weights), and
    all-reduce each attention and MLP output. Raises InvalidArgument for a layer kind it
    cannot split or a group larger than the model's KV heads."""
    for layer in model.model.layers:  # type: ignore[union-attr]
        attn = layer.self_attn
        if isinstance(attn, (LlamaAttention, GQAAttention)):
            _shard_gqa(attn, tp)
        elif isinstance(attn, DeepseekV3Attention):
            _shard_mla(attn, tp)
        else:
            raise InvalidArgument(f"tensor parallelism cannot split {type(attn).__name__}",
                                  field="tensor_parallel_size")
        mlp = getattr(layer, getattr(layer, "mlp_name", "mlp"))
        if isinstance(mlp, SparseMoeBlock):
            _shard_moe(mlp, tp)
        elif isinstance(mlp, (LlamaMLP, SwiGLU)):
            _shard_swiglu(mlp, tp)
        else:
            raise InvalidArgument(f"tensor parallelism cannot split {type(mlp).__name__}",
                                  field="tensor_parallel_size")
        attn.register_forward_hook(_all_reduce_hook(tp))
        mlp.register_forward_hook(_all_reduce_hook(tp))
