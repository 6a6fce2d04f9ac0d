"""Read a Hugging Face config.json into a ModelSpec: every stored tensor, by category.

Families: dense Llama-like (Llama, Mistral, Qwen2, Qwen3), GQA mixture-of-experts (Mixtral,
Qwen3-MoE, GLM-4-MoE) and MLA mixture-of-experts (DeepSeek-V3, Kimi-K2, DeepSeek-V3.2 and
GLM-5 with the sparse-attention indexer). Multi-token-prediction layers that a checkpoint ships
(`num_nextn_predict_layers`) are counted unless the caller asks for fewer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ops.planner import blocks
from ops.planner.model import KVLayout, ModelSpec, TensorSpec
from runtime.errors import InvalidArgument

Config = dict[str, Any]


def _int(cfg: Config, name: str, default: int | None = None, *, positive: bool = True) -> int:
    value = cfg.get(name, default)
    if value is None:
        raise InvalidArgument(f"config.json is missing required field {name!r}", field=name)
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
        kind = "a positive" if positive else "a non-negative"
        raise InvalidArgument(f"config field {name!r} must be {kind} integer, got {value!r}",
                              field=name)
    return value


def _head_dim(cfg: Config) -> int:
    if cfg.get("head_dim"):
        return _int(cfg, "head_dim")
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    if hidden % heads:
        raise InvalidArgument(f"hidden_size ({hidden}) is not a multiple of num_attention_heads "
                              f"({heads}) and config.json has no head_dim", field="head_dim")
    return hidden // heads


def _kv_heads(cfg: Config) -> int:
    heads = _int(cfg, "num_attention_heads")
    kv = _int(cfg, "num_key_value_heads", heads)
    if heads % kv:
        raise InvalidArgument(f"num_attention_heads ({heads}) is not a multiple of "
                              f"num_key_value_heads ({kv})", field="num_key_value_heads")
    return kv


def _mtp_layers(cfg: Config, requested: int | None) -> int:
    shipped = _int(cfg, "num_nextn_predict_layers", 0, positive=False)
    if requested is None:
        return shipped
    if requested < 0 or requested > shipped:
        raise InvalidArgument(f"mtp layers must be between 0 and the {shipped} the config "
                              f"declares (num_nextn_predict_layers), got {requested}",
                              field="num_nextn_predict_layers")
    return requested


def _count_moe_layers(cfg: Config, layers: int, style: str) -> int:
    """How many of the `layers` main decoder layers hold a routed MoE block."""
    if style == "all":
        return layers
    if style == "qwen":
        step = _int(cfg, "decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    types = cfg.get("mlp_layer_types")
    if isinstance(types, list) and len(types) == layers:
        return sum(1 for t in types if t == "sparse")
    first = _int(cfg, "first_k_dense_replace", 0, positive=False)
    freq = _int(cfg, "moe_layer_freq", 1)
    return sum(1 for i in range(first, layers) if i % freq == 0)


def _indexer_layers(cfg: Config, layers: int) -> int:
    """Layers that run their own DSA indexer (GLM-5 lets later layers reuse an earlier top-k)."""
    types = cfg.get("indexer_types")
    if isinstance(types, list) and len(types) == layers:
        return sum(1 for t in types if t == "full")
    pattern = cfg.get("index_topk_pattern")
    if isinstance(pattern, str) and len(pattern) == layers:
        return pattern.count("F")
    freq = max(int(cfg.get("index_topk_freq") or 1), 1)
    offset = int(cfg.get("index_skip_topk_offset", 2))
    return sum(1 for i in range(layers) if max(i - offset + 1, 0) % freq == 0)


def dense(cfg: Config, arch: str, mtp_layers: int | None) -> ModelSpec:
    return _gqa_model(cfg, arch, mtp_layers, moe_style=None)


def gqa_moe(cfg: Config, arch: str, mtp_layers: int | None) -> ModelSpec:
    style = {"MixtralForCausalLM": "all", "Qwen3MoeForCausalLM": "qwen"}.get(arch, "deepseek")
    return _gqa_model(cfg, arch, mtp_layers, moe_style=style)


def _gqa_model(cfg: Config, arch: str, mtp_layers: int | None,
               moe_style: str | None) -> ModelSpec:
    hidden, vocab = _int(cfg, "hidden_size"), _int(cfg, "vocab_size")
    layers, heads = _int(cfg, "num_hidden_layers"), _int(cfg, "num_attention_heads")
    kv_heads, head_dim = _kv_heads(cfg), _head_dim(cfg)
    mtp = _mtp_layers(cfg, mtp_layers)
    bias = bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM"))
    qk_norm = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or bool(
        cfg.get("use_qk_norm", False))
    tensors = blocks.embeddings(vocab, hidden, bool(cfg.get("tie_word_embeddings", False)))
    tensors += blocks.gqa_attention(hidden, heads, kv_heads, head_dim, layers + mtp, bias=bias,
                                    qk_norm=qk_norm)
    tensors += blocks.layer_norms(hidden, layers + mtp)
    moe_layers = 0 if moe_style is None else _count_moe_layers(cfg, layers, moe_style)
    if moe_style is not None and moe_layers + mtp:
        tensors += _moe_blocks(cfg, arch, hidden, moe_layers + mtp)
    if layers - moe_layers:
        tensors += blocks.swiglu_mlp("dense_mlp", "mlp", hidden, _int(cfg, "intermediate_size"),
                                     layers - moe_layers)
    if mtp:
        tensors += blocks.mtp_extras(hidden, mtp)
    family = "dense" if moe_style is None else "moe"
    kv = KVLayout("gqa", layers + mtp, num_kv_heads=kv_heads, head_dim=head_dim)
    return ModelSpec(arch, family, hidden, vocab, layers, mtp, heads, kv, tuple(tensors))


def _moe_blocks(cfg: Config, arch: str, hidden: int, layers: int) -> list[TensorSpec]:
    if arch == "MixtralForCausalLM":
        experts = _int(cfg, "num_local_experts")
        return blocks.moe(hidden, layers, experts=experts,
                          intermediate=_int(cfg, "intermediate_size"), shared_intermediate=0,
                          correction_bias=False)
    if arch == "Qwen3MoeForCausalLM":
        experts = _int(cfg, "num_experts")
        return blocks.moe(hidden, layers, experts=experts,
                          intermediate=_int(cfg, "moe_intermediate_size"),
                          shared_intermediate=0, correction_bias=False)
    moe_inter = _int(cfg, "moe_intermediate_size")
    shared = _int(cfg, "n_shared_experts", 0, positive=False)
    return blocks.moe(hidden, layers, experts=_int(cfg, "n_routed_experts"),
                      intermediate=moe_inter, shared_intermediate=shared * moe_inter,
                      correction_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc")


def mla_moe(cfg: Config, arch: str, mtp_layers: int | None) -> ModelSpec:
    hidden, vocab = _int(cfg, "hidden_size"), _int(cfg, "vocab_size")
    layers, heads = _int(cfg, "num_hidden_layers"), _int(cfg, "num_attention_heads")
    mtp = _mtp_layers(cfg, mtp_layers)
    q_lora = cfg.get("q_lora_rank")
    q_lora = None if q_lora is None else _int(cfg, "q_lora_rank")
    kv_lora, rope = _int(cfg, "kv_lora_rank"), _int(cfg, "qk_rope_head_dim")
    tensors = blocks.embeddings(vocab, hidden, bool(cfg.get("tie_word_embeddings", False)))
    nope, v_dim = _int(cfg, "qk_nope_head_dim"), _int(cfg, "v_head_dim")
    tensors += blocks.mla_attention(hidden, heads, layers + mtp, q_lora_rank=q_lora,
                                    kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
                                    qk_rope_head_dim=rope, v_head_dim=v_dim)
    tensors += blocks.layer_norms(hidden, layers + mtp)
    moe_layers = _count_moe_layers(cfg, layers, "deepseek")
    tensors += _moe_blocks(cfg, arch, hidden, moe_layers + mtp)
    if layers - moe_layers:
        tensors += blocks.swiglu_mlp("dense_mlp", "mlp", hidden, _int(cfg, "intermediate_size"),
                                     layers - moe_layers)
    indexer_layers, index_dim = 0, 0
    if arch in ("GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM"):
        if q_lora is None:
            raise InvalidArgument("the sparse-attention indexer needs q_lora_rank",
                                  field="q_lora_rank")
        index_dim = _int(cfg, "index_head_dim")
        indexer_layers = _indexer_layers(cfg, layers) + mtp
        tensors += blocks.dsa_indexer(hidden, q_lora, _int(cfg, "index_n_heads"), index_dim,
                                      indexer_layers)
    if mtp:
        tensors += blocks.mtp_extras(hidden, mtp)
    kv = KVLayout("mla", layers + mtp, latent_dim=kv_lora + rope, rope_dim=rope,
                  indexer_layers=indexer_layers, indexer_dim=index_dim)
    return ModelSpec(arch, "mla", hidden, vocab, layers, mtp, heads, kv, tuple(tensors))


Builder = Callable[[Config, str, int | None], ModelSpec]

# architecture (config.json "architectures"[0]) -> builder
REGISTRY: dict[str, Builder] = {
    "LlamaForCausalLM": dense,
    "MistralForCausalLM": dense,
    "Qwen2ForCausalLM": dense,
    "Qwen3ForCausalLM": dense,
    "MixtralForCausalLM": gqa_moe,
    "Qwen3MoeForCausalLM": gqa_moe,
    "Glm4MoeForCausalLM": gqa_moe,
    "DeepseekV3ForCausalLM": mla_moe,
    "DeepseekV32ForCausalLM": mla_moe,
    "GlmMoeDsaForCausalLM": mla_moe,
}
# model_type -> architecture, for configs without "architectures" (and Kimi's own names)
MODEL_TYPES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}
ALIASES = {"KimiK2ForCausalLM": "DeepseekV3ForCausalLM"}


def resolve_architecture(cfg: Config) -> str:
    archs = cfg.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not archs
                              or not isinstance(archs[0], str)):
        raise InvalidArgument(f"config field 'architectures' must be a list of names, "
                              f"got {archs!r}", field="architectures")
    name = archs[0] if archs else None
    if name is None:
        model_type = cfg.get("model_type")
        if model_type is None:
            raise InvalidArgument("config.json names neither 'architectures' nor 'model_type'",
                                  field="architectures")
        if model_type not in MODEL_TYPES:
            raise InvalidArgument(f"unknown model_type {model_type!r}; the planner knows "
                                  f"{', '.join(sorted(MODEL_TYPES))}", field="model_type")
        return MODEL_TYPES[model_type]
    name = ALIASES.get(name, name)
    if name not in REGISTRY:
        raise InvalidArgument(f"unknown architecture {name!r}; the planner knows "
                              f"{', '.join(sorted(REGISTRY))}", field="architectures")
    return name


def parse_config(cfg: Config, *, mtp_layers: int | None = None) -> ModelSpec:
    """A config.json dict -> ModelSpec. Multimodal wrappers (Kimi-K2.5) are read through their
    `text_config`. Raises InvalidArgument naming the offending field."""
    if not isinstance(cfg, dict):
        raise InvalidArgument("config.json must hold a JSON object", field="config")
    text = cfg.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in cfg:
        cfg = {**text, "architectures": text.get("architectures") or None}
    arch = resolve_architecture(cfg)
    return REGISTRY[arch](cfg, arch, mtp_layers)
