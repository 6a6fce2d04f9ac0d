"""What the planner knows about a model: its stored tensors by category, and what a token caches."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import InvalidArgument

CATEGORIES = ("embeddings", "attention", "indexer", "dense_mlp", "routed_experts",
              "shared_experts", "router", "norms", "mtp", "lm_head")
# Categories whose weights are linear-layer matrices, so a weight format applies to them.
QUANTIZABLE = ("attention", "indexer", "dense_mlp", "routed_experts", "shared_experts", "mtp",
               "lm_head")
SHARDS = ("column", "row", "vocab", "replicated")


@dataclass(frozen=True)
class TensorSpec:
    """`count` stored tensors of one shape (e.g. one projection in every layer, or every expert).

    Matrices are [rows = output features, cols = input features]; vectors have cols == 1.
    `shard` is how tensor parallelism splits it: column (rows), row (cols), vocab (rows of an
    embedding), or replicated on every rank. `kv_heads` > 0 marks K/V projections, whose rows
    are replicated rather than split once the TP degree exceeds the KV head count.
    """

    category: str
    name: str
    rows: int
    cols: int = 1
    count: int = 1
    shard: str = "replicated"
    linear: bool = False
    kv_heads: int = 0
    attention_side: bool = False  # replicated when attention runs data-parallel
    dtype: str | None = None  # a fixed storage dtype (fp32 router bias); None: the model dtype

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise InvalidArgument(f"unknown tensor category {self.category!r}", field="category")
        if self.shard not in SHARDS:
            raise InvalidArgument(f"unknown shard rule {self.shard!r}", field="shard")
        for name in ("rows", "cols", "count"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{self.name}: {name} must not be negative", field=name)

    @property
    def parameters(self) -> int:
        return self.rows * self.cols * self.count


@dataclass(frozen=True)
class KVLayout:
    """What one token caches in one layer: K and V per KV head (GQA) or one MLA latent vector,
    plus, for DeepSeek sparse attention, the indexer's key in the layers that run an indexer."""

    kind: str  # "gqa" | "mla"
    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0
    rope_dim: int = 0  # MLA: the latent's RoPE part, kept bf16 in 1-byte formats
    indexer_layers: int = 0
    indexer_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("gqa", "mla"):
            raise InvalidArgument(f"unknown KV layout {self.kind!r}", field="kind")


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    family: str  # "dense" | "moe" | "mla"
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_mtp_layers: int
    num_attention_heads: int
    kv: KVLayout
    tensors: tuple[TensorSpec, ...]
    notes: tuple[str, ...] = ()

    def parameters(self, category: str | None = None) -> int:
        return sum(t.parameters for t in self.tensors if category in (None, t.category))

    def parameters_by_category(self) -> dict[str, int]:
        return {c: self.parameters(c) for c in CATEGORIES}
