"""The stored tensors of each building block, with Hugging Face names and TP shard rules.

Shard rules follow vLLM/SGLang: q/k/v, gate/up, q_b_proj and kv_b_proj split their output rows
across ranks; o_proj and down_proj split their input columns; embeddings and lm_head split the
vocabulary; norms, the router, MLA's down-projections (q_a_proj, kv_a_proj_with_mqa), the DSA
indexer and the MTP eh_proj are replicated on every rank.
Routed experts split each expert's intermediate size (expert parallelism moves whole experts
instead; the bytes per rank are the same when the expert count divides by the TP degree).
"""

from __future__ import annotations

from ops.planner.model import TensorSpec


def embeddings(vocab: int, hidden: int, tied: bool) -> list[TensorSpec]:
    out = [TensorSpec("embeddings", "embed_tokens", vocab, hidden, shard="vocab")]
    if not tied:
        out.append(TensorSpec("lm_head", "lm_head", vocab, hidden, shard="vocab", linear=True))
    out.append(TensorSpec("norms", "norm", hidden))
    return out


def layer_norms(hidden: int, layers: int) -> list[TensorSpec]:
    return [TensorSpec("norms", "input_layernorm", hidden, count=layers, attention_side=True),
            TensorSpec("norms", "post_attention_layernorm", hidden, count=layers)]


def gqa_attention(hidden: int, heads: int, kv_heads: int, head_dim: int, layers: int, *,
                  bias: bool = False, qk_norm: bool = False) -> list[TensorSpec]:
    q, kv = heads * head_dim, kv_heads * head_dim
    out = [
        TensorSpec("attention", "self_attn.q_proj", q, hidden, layers, "column", linear=True,
                   attention_side=True),
        TensorSpec("attention", "self_attn.k_proj", kv, hidden, layers, "column", linear=True,
                   kv_heads=kv_heads, attention_side=True),
        TensorSpec("attention", "self_attn.v_proj", kv, hidden, layers, "column", linear=True,
                   kv_heads=kv_heads, attention_side=True),
        TensorSpec("attention", "self_attn.o_proj", hidden, q, layers, "row", linear=True,
                   attention_side=True),
    ]
    if bias:
        out += [
            TensorSpec("attention", "self_attn.q_proj.bias", q, 1, layers, "column",
                       attention_side=True),
            TensorSpec("attention", "self_attn.k_proj.bias", kv, 1, layers, "column",
                       kv_heads=kv_heads, attention_side=True),
            TensorSpec("attention", "self_attn.v_proj.bias", kv, 1, layers, "column",
                       kv_heads=kv_heads, attention_side=True),
        ]
    if qk_norm:
        out += [TensorSpec("norms", "self_attn.q_norm", head_dim, count=layers,
                           attention_side=True),
                TensorSpec("norms", "self_attn.k_norm", head_dim, count=layers,
                           attention_side=True)]
    return out


def mla_attention(hidden: int, heads: int, layers: int, *, q_lora_rank: int | None,
                  kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                  v_head_dim: int) -> list[TensorSpec]:
    qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
    out: list[TensorSpec] = []
    if q_lora_rank:
        out += [
            TensorSpec("attention", "self_attn.q_a_proj", q_lora_rank, hidden, layers,
                       linear=True, attention_side=True),
            TensorSpec("norms", "self_attn.q_a_layernorm", q_lora_rank, count=layers,
                       attention_side=True),
            TensorSpec("attention", "self_attn.q_b_proj", heads * qk_head_dim, q_lora_rank,
                       layers, "column", linear=True, attention_side=True),
        ]
    else:
        out.append(TensorSpec("attention", "self_attn.q_proj", heads * qk_head_dim, hidden,
                              layers, "column", linear=True, attention_side=True))
    out += [
        TensorSpec("attention", "self_attn.kv_a_proj_with_mqa", kv_lora_rank + qk_rope_head_dim,
                   hidden, layers, linear=True, attention_side=True),
        TensorSpec("norms", "self_attn.kv_a_layernorm", kv_lora_rank, count=layers,
                   attention_side=True),
        TensorSpec("attention", "self_attn.kv_b_proj", heads * (qk_nope_head_dim + v_head_dim),
                   kv_lora_rank, layers, "column", linear=True, attention_side=True),
        TensorSpec("attention", "self_attn.o_proj", hidden, heads * v_head_dim, layers, "row",
                   linear=True, attention_side=True),
    ]
    return out


def dsa_indexer(hidden: int, q_lora_rank: int, index_heads: int, index_head_dim: int,
                layers: int) -> list[TensorSpec]:
    """DeepSeek sparse attention's lightning indexer; weights_proj stays in the model dtype."""
    return [
        TensorSpec("indexer", "self_attn.indexer.wq_b", index_heads * index_head_dim,
                   q_lora_rank, layers, linear=True, attention_side=True),
        TensorSpec("indexer", "self_attn.indexer.wk", index_head_dim, hidden, layers,
                   linear=True, attention_side=True),
        TensorSpec("indexer", "self_attn.indexer.weights_proj", index_heads, hidden, layers,
                   attention_side=True),
        TensorSpec("norms", "self_attn.indexer.k_norm", 2 * index_head_dim, count=layers,
                   attention_side=True),  # LayerNorm: weight and bias
    ]


def swiglu_mlp(category: str, prefix: str, hidden: int, intermediate: int,
               count: int) -> list[TensorSpec]:
    return [
        TensorSpec(category, f"{prefix}.gate_proj", intermediate, hidden, count, "column",
                   linear=True),
        TensorSpec(category, f"{prefix}.up_proj", intermediate, hidden, count, "column",
                   linear=True),
        TensorSpec(category, f"{prefix}.down_proj", hidden, intermediate, count, "row",
                   linear=True),
    ]


def moe(hidden: int, layers: int, *, experts: int, intermediate: int, shared_intermediate: int,
        correction_bias: bool) -> list[TensorSpec]:
    out = swiglu_mlp("routed_experts", "mlp.experts", hidden, intermediate, layers * experts)
    out.append(TensorSpec("router", "mlp.gate", experts, hidden, layers))
    if correction_bias:
        out.append(TensorSpec("router", "mlp.gate.e_score_correction_bias", experts,
                              count=layers, dtype="fp32"))
    if shared_intermediate:
        out += swiglu_mlp("shared_experts", "mlp.shared_experts", hidden, shared_intermediate,
                          layers)
    return out


def mtp_extras(hidden: int, layers: int) -> list[TensorSpec]:
    """An MTP module's own tensors; its decoder layer is counted with the others, and its
    embedding and output head are shared with the main model."""
    return [
        TensorSpec("mtp", "eh_proj", hidden, 2 * hidden, layers, linear=True),
        TensorSpec("norms", "enorm", hidden, count=layers),
        TensorSpec("norms", "hnorm", hidden, count=layers),
        TensorSpec("norms", "shared_head.norm", hidden, count=layers),
    ]
