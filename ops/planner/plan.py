"""Apply formats and tensor-parallel rules to a ModelSpec: bytes per category, per device, KV.

Units: bytes in every field; GiB (2**30 bytes) on the command line and in tables. An H200's
"141 GB" is 140.4 GiB as the driver reports it, so `--device-memory-gb 141` is a slight
overestimate; give the driver's figure when it matters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ops.planner.model import CATEGORIES, QUANTIZABLE, ModelSpec, TensorSpec
from runtime.errors import InvalidArgument
from runtime.formats import (
    DTYPES,
    QUANTIZED_KV_FORMATS,
    KVFormat,
    TensorBytes,
    WeightFormat,
    dense_bytes,
)

GIB = 1 << 30
DEFAULT_RESERVE_FRACTION = 0.10  # vLLM's default gpu_memory_utilization=0.9 leaves 10%


@dataclass(frozen=True)
class PlanConfig:
    """A deployment: formats, parallelism and the memory it gets. Names are canonical
    (fp32/bf16/fp16/fp8/int4); `runtime.formats.canonical_name` maps torch-style names."""

    weights: str = "bf16"  # format of linear-layer weights
    dtype: str = "bf16"  # embeddings, norms, router, lm_head, and anything not quantized
    int4_targets: tuple[str, ...] = ("routed_experts",)
    # NOTE: these int4 defaults are Kimi-K2-Thinking's released INT4 layout (compressed-tensors
    # W4A16: routed experts int4, group 32, symmetric; everything else bf16), which also
    # reproduces the reference GLM-5 INT4 checkpoint size.
    int4_rest: str = "bf16"  # linear weights outside int4_targets when weights == int4
    int4_group_size: int = 32
    int4_symmetric: bool = True
    kv_cache_dtype: str = "bf16"
    tp: int = 1
    attention: str = "tp"  # "tp": heads split, MLA latent replicated; "dp": one rank per seq
    device_memory_bytes: int | None = None
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION
    reserve_bytes: int | None = None  # overrides reserve_fraction
    kv_cache_bytes: int | None = None  # a fixed KV budget per device; overrides device memory
    page_size: int = 16
    # MLA latents in fp8 / int8: "bf16" keeps the RoPE part bf16 in the row (what tessera's
    # pages hold, kernels/latent.py); "shared" quantizes it under the row's one scale (the
    # reference's capacity figures imply it; kept to recover them)
    mla_rope: str = "bf16"

    def __post_init__(self) -> None:
        WeightFormat(self.weights, self.int4_group_size, self.int4_symmetric)
        KVFormat(self.kv_cache_dtype)
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}",
                                  field="dtype")
        if self.int4_rest not in ("fp32", "bf16", "fp16", "fp8"):
            raise InvalidArgument(f"int4_rest must be a non-int4 weight format, got "
                                  f"{self.int4_rest!r}", field="int4_rest")
        for target in self.int4_targets:
            if target not in QUANTIZABLE:
                raise InvalidArgument(f"int4 target {target!r} is not a quantizable category "
                                      f"({', '.join(QUANTIZABLE)})", field="int4_targets")
        if self.tp < 1:
            raise InvalidArgument(f"tp must be at least 1, got {self.tp}", field="tp")
        if self.attention not in ("tp", "dp"):
            raise InvalidArgument(f"attention must be 'tp' or 'dp', got {self.attention!r}",
                                  field="attention")
        if self.mla_rope not in ("bf16", "shared"):
            raise InvalidArgument(f"mla_rope must be 'bf16' or 'shared', got {self.mla_rope!r}",
                                  field="mla_rope")
        if self.page_size < 1:
            raise InvalidArgument(f"page_size must be positive, got {self.page_size}",
                                  field="page_size")
        if not 0 <= self.reserve_fraction < 1:
            raise InvalidArgument(f"reserve_fraction must be in [0, 1), got "
                                  f"{self.reserve_fraction}", field="reserve_fraction")
        for name in ("device_memory_bytes", "reserve_bytes", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidArgument(f"{name} must not be negative, got {value}", field=name)

    def weight_format(self, tensor: TensorSpec) -> WeightFormat | None:
        """The format of a linear weight, or None for a tensor stored unquantized."""
        if not tensor.linear:
            return None
        if self.weights == "int4" and tensor.category in self.int4_targets:
            return WeightFormat("int4", self.int4_group_size, self.int4_symmetric)
        if tensor.category == "lm_head":
            return None
        return WeightFormat(self.int4_rest if self.weights == "int4" else self.weights)


@dataclass(frozen=True)
class CategoryBytes:
    category: str
    parameters: int
    formats: tuple[str, ...]
    data_bytes: int
    scale_bytes: int
    zero_bytes: int
    total_bytes: int
    per_device_bytes: int


@dataclass(frozen=True)
class Plan:
    architecture: str
    family: str
    config: PlanConfig
    parameters: int
    breakdown: tuple[CategoryBytes, ...]
    weight_bytes_total: int
    weight_bytes_per_device: int
    kv_bytes_per_token: int  # what one cached token costs on one device
    kv_bytes_per_token_model: int  # one unsharded copy of a token's KV (all layers)
    reserve_bytes: int | None
    kv_budget_bytes_per_device: int | None
    kv_capacity_tokens: int | None
    assumptions: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool | None:
        """Whether one page of KV fits next to the weights; None when no budget is known."""
        if self.kv_budget_bytes_per_device is None:
            return None
        return self.kv_budget_bytes_per_device >= self.kv_bytes_per_token * self.config.page_size

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["breakdown"] = {c["category"]: {k: v for k, v in c.items() if k != "category"}
                            for c in out["breakdown"]}
        out["config"]["int4_targets"] = list(self.config.int4_targets)
        out["assumptions"] = list(self.assumptions)
        out["fits"] = self.fits
        return out


def shard_shape(tensor: TensorSpec, config: PlanConfig) -> tuple[int, int]:
    """The [rows, cols] one rank stores."""
    tp = config.tp
    if tp == 1 or tensor.shard == "replicated" or (
            tensor.attention_side and config.attention == "dp"):
        return tensor.rows, tensor.cols
    if tensor.shard == "column" and tensor.kv_heads:
        # NOTE: with fewer KV heads than ranks, each rank keeps one whole head (replicated).
        per_rank = max(1, tensor.kv_heads // tp)
        return tensor.rows * per_rank // tensor.kv_heads, tensor.cols
    if tensor.shard in ("column", "vocab"):
        return -(-tensor.rows // tp), tensor.cols
    return tensor.rows, -(-tensor.cols // tp)


def tensor_bytes(tensor: TensorSpec, config: PlanConfig, rows: int, cols: int) -> TensorBytes:
    fmt = config.weight_format(tensor)
    one = (fmt.matrix_bytes(rows, cols) if fmt is not None
           else dense_bytes(rows * cols, tensor.dtype or config.dtype))
    return one.times(tensor.count)


def check_parallelism(spec: ModelSpec, config: PlanConfig) -> None:
    tp = config.tp
    if tp == 1 or config.attention == "dp":
        return
    if spec.num_attention_heads % tp:
        raise InvalidArgument(f"tensor-parallel degree {tp} does not divide "
                              f"num_attention_heads ({spec.num_attention_heads})",
                              field="num_attention_heads")
    kv = spec.kv.num_kv_heads
    if spec.kv.kind == "gqa" and (kv % tp if kv >= tp else tp % kv):
        raise InvalidArgument(f"tensor-parallel degree {tp} and num_key_value_heads ({kv}) "
                              f"do not divide one another", field="num_key_value_heads")


def kv_bytes_per_token(spec: ModelSpec, config: PlanConfig) -> tuple[int, int]:
    """(bytes one token costs on one device, bytes of one unsharded copy)."""
    fmt, kv = KVFormat(config.kv_cache_dtype), spec.kv
    if kv.kind == "mla":
        # NOTE: every TP rank attends with all its heads over the same latent, so the latent
        # (and the indexer key) is stored whole on every rank: per device == per model.
        rope = kv.rope_dim if config.mla_rope == "bf16" else 0
        one = (kv.num_layers * fmt.latent_bytes_per_token_layer(kv.latent_dim, rope)
               + kv.indexer_layers * fmt.latent_bytes_per_token_layer(kv.indexer_dim))
        return one, one
    full = kv.num_layers * fmt.gqa_bytes_per_token_layer(kv.num_kv_heads, kv.head_dim)
    if config.tp == 1 or config.attention == "dp":
        return full, full
    heads = max(1, kv.num_kv_heads // config.tp)
    return kv.num_layers * fmt.gqa_bytes_per_token_layer(heads, kv.head_dim), full


def capacity_tokens(budget_bytes: int, bytes_per_token: int, page_size: int) -> int:
    """Tokens that fit in whole pages, exactly as the engine sizes its pool."""
    if budget_bytes <= 0:
        return 0
    return budget_bytes // (bytes_per_token * page_size) * page_size


def make_plan(spec: ModelSpec, config: PlanConfig) -> Plan:
    check_parallelism(spec, config)
    by_category: dict[str, list[TensorSpec]] = {c: [] for c in CATEGORIES}
    for tensor in spec.tensors:
        by_category[tensor.category].append(tensor)
    breakdown = []
    for category, tensors in by_category.items():
        if not tensors:
            continue
        total, per_device = TensorBytes(), 0
        formats: list[str] = []
        for t in tensors:
            total = total + tensor_bytes(t, config, t.rows, t.cols)
            per_device += tensor_bytes(t, config, *shard_shape(t, config)).total
            fmt = config.weight_format(t)
            label = fmt.label if fmt is not None else (t.dtype or config.dtype)
            if label not in formats:
                formats.append(label)
        breakdown.append(CategoryBytes(category, sum(t.parameters for t in tensors),
                                       tuple(formats), total.data, total.scales, total.zeros,
                                       total.total, per_device))
    weights_total = sum(c.total_bytes for c in breakdown)
    weights_device = sum(c.per_device_bytes for c in breakdown)
    per_token, per_token_model = kv_bytes_per_token(spec, config)
    reserve, budget, capacity = None, config.kv_cache_bytes, None
    if budget is None and config.device_memory_bytes is not None:
        reserve = (config.reserve_bytes if config.reserve_bytes is not None
                   else int(config.device_memory_bytes * config.reserve_fraction))
        budget = config.device_memory_bytes - weights_device - reserve
    if budget is not None:
        per_rank = capacity_tokens(budget, per_token, config.page_size)
        capacity = per_rank * (config.tp if config.attention == "dp" else 1)
    return Plan(spec.architecture, spec.family, config, spec.parameters(), tuple(breakdown),
                weights_total, weights_device, per_token, per_token_model, reserve, budget,
                capacity, tuple(assumptions(spec, config, reserve)))


def assumptions(spec: ModelSpec, config: PlanConfig, reserve: int | None) -> list[str]:
    out = []
    linear = config.int4_rest if config.weights == "int4" else config.weights
    if config.weights == "int4":
        fmt = WeightFormat("int4", config.int4_group_size, config.int4_symmetric)
        zero = "" if config.int4_symmetric else " and a 4-bit zero point"
        out.append(f"int4 ({fmt.label}: 0.5 B/param, one bf16 scale{zero} per "
                   f"{config.int4_group_size} inputs of a row) on: "
                   f"{', '.join(config.int4_targets)}")
    if linear == "fp8":
        out.append("fp8 e4m3 linear weights carry one fp32 scale per output channel")
    out.append(f"other linear weights {linear}; embeddings, norms, router"
               f"{'' if 'lm_head' in config.int4_targets else ', lm_head'} {config.dtype}")
    if config.kv_cache_dtype in QUANTIZED_KV_FORMATS:
        unit = "token" if spec.kv.kind == "mla" else "(token, kv head)"
        code = "e4m3" if config.kv_cache_dtype == "fp8" else "symmetric"
        out.append(f"{config.kv_cache_dtype} {code} KV carries one bf16 scale per {unit}")
        if spec.kv.kind == "mla" and config.mla_rope == "bf16":
            out.append(f"the latent's {spec.kv.rope_dim} RoPE values stay bf16 (2 B each), "
                       "outside the scale; --mla-rope shared quantizes them with the rest")
    if config.tp > 1:
        out.append(f"TP {config.tp}: q/k/v/o, MLP, experts, embeddings and lm_head split; "
                   "norms, router, q_a_proj, kv_a_proj_with_mqa, DSA indexer and MTP eh_proj "
                   "replicated; experts split by intermediate size (EP moves whole experts, "
                   "same bytes)")
        if spec.kv.kind == "gqa" and spec.kv.num_kv_heads < config.tp \
                and config.attention == "tp":
            out.append(f"{spec.kv.num_kv_heads} KV heads < TP {config.tp}: each rank keeps one "
                       "whole KV head (replicated K/V projections and cache)")
    if config.attention == "dp":
        out.append(f"data-parallel attention: attention weights replicated on all {config.tp} "
                   f"ranks; each rank caches only its own sequences, so capacity is "
                   f"{config.tp} x one rank's")
    elif spec.kv.kind == "mla" and config.tp > 1:
        out.append("MLA latent KV replicated on every TP rank (attention=tp): capacity is one "
                   "rank's; --attention dp caches each sequence on one rank instead")
    if spec.kv.indexer_layers:
        out.append(f"DSA indexer keys cached in {spec.kv.indexer_layers} layers "
                   f"({spec.kv.indexer_dim} per token, same format as the KV)")
    if spec.num_mtp_layers:
        out.append(f"{spec.num_mtp_layers} MTP layer(s) counted (weights and KV), as the "
                   "checkpoint ships them; --mtp-layers 0 drops them")
    if reserve is not None:
        how = (f"{config.reserve_fraction:.0%} of device memory" if config.reserve_bytes is None
               else "as given")
        out.append(f"reserve {reserve / GIB:.1f} GiB per device ({how}) for activations, CUDA "
                   "graphs, communication buffers and allocator slack")
    out.append(f"KV rounded down to whole pages of {config.page_size} tokens")
    return out + list(spec.notes)
