"""Byte costs of the serving formats, as the engine defines them.

One definition shared by the capacity planner and the quantization code: what one weight
matrix or one token of KV costs in each format, scales and zero points included. Torch-free.

Weights (a linear layer's matrix is [rows = out_features, cols = in_features]):
- fp32 / bf16 / fp16: 4 / 2 / 2 bytes per element, nothing else.
- fp8 (e4m3): 1 byte per element plus one float32 scale per output channel (row); or, as
  DeepSeek-V3 / Kimi-K2 ship FP8 (`fp8-block`), one float32 scale per 128x128 block, held in
  memory as one per (row, 128-column block) so fused projections concatenate exactly.
- int4 (group-wise along the input dim, groups of 32, 64 or 128): 0.5 byte per element plus one
  bf16 scale per group; asymmetric adds one 4-bit zero point per group (0.5 byte).
Tensors that are never quantized (embeddings, norms, router) are stored in the model dtype.

KV cache, per stored vector (one token of one KV head, or one token's MLA latent):
- fp32 / bf16 / fp16: 4 / 2 / 2 bytes per element.
- fp8 (e4m3) / int8 (symmetric, amax / 127): 1 byte per element plus one bf16 scale per vector.
  An MLA latent's RoPE part (k_pe) is not quantized: it stays bf16 in the row, 2 bytes per
  element, outside the scale (FlashMLA's choice: one scale over both parts loses RoPE scores).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import InvalidArgument

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
DTYPES = ("fp32", "bf16", "fp16")
WEIGHT_FORMATS = ("fp32", "bf16", "fp16", "fp8", "int4")
KV_FORMATS = ("fp32", "bf16", "fp16", "fp8", "int8")
# 1-byte KV formats with one bf16 scale per vector (kernels/fp8.py, kernels/int8.py): the same
# bytes, the same page layout, rotation and smoothing; they differ in the code grid only.
QUANTIZED_KV_FORMATS = ("fp8", "int8")
INT4_GROUP_SIZES = (32, 64, 128)
# how `tessera convert` rounds: round to nearest, or GPTQ's calibrated rounding
CONVERT_METHODS = ("rtn", "gptq")
FP8_BLOCK = (128, 128)  # DeepSeek-V3's quantization_config.weight_block_size

FP8_WEIGHT_SCALE_BYTES = 4  # float32, one per output channel
INT4_SCALE_BYTES = 2  # bf16, one per group
KV_FP8_SCALE_BYTES = 2  # bf16, one per (token, kv head) or per token of MLA latent (fp8, int8)

_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
            "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8"}
# NOTE: "int8" is its own canonical name (a KV format only; int8 weights are not a format).


def canonical_name(name: str) -> str:
    """'bfloat16' -> 'bf16', 'torch.float32' -> 'fp32'; unknown names pass through unchanged."""
    key = name.strip().lower().removeprefix("torch.")
    return _ALIASES.get(key, key)


@dataclass(frozen=True)
class TensorBytes:
    """Bytes of one stored tensor (or a sum of them), split by what they hold."""

    data: int = 0
    scales: int = 0
    zeros: int = 0

    @property
    def total(self) -> int:
        return self.data + self.scales + self.zeros

    def __add__(self, other: TensorBytes) -> TensorBytes:
        return TensorBytes(self.data + other.data, self.scales + other.scales,
                           self.zeros + other.zeros)

    def times(self, count: int) -> TensorBytes:
        return TensorBytes(self.data * count, self.scales * count, self.zeros * count)


@dataclass(frozen=True)
class WeightFormat:
    """How one linear layer's weight matrix is stored."""

    name: str
    group_size: int = 128
    symmetric: bool = True
    block: tuple[int, int] | None = None  # fp8 only: [rows, cols] of each block's scale

    def __post_init__(self) -> None:
        if self.name not in WEIGHT_FORMATS:
            raise InvalidArgument(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, "
                                  f"or fp8-block, got {self.name!r}", field="weights")
        if self.block is not None and (self.name != "fp8" or len(self.block) != 2
                                       or min(self.block) < 1):
            raise InvalidArgument(f"block scales are an fp8 option of two positive sizes, got "
                                  f"{self.name} {self.block!r}", field="weight_block_size")
        if self.name == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise InvalidArgument(f"int4 group size must be one of {INT4_GROUP_SIZES}, "
                                  f"got {self.group_size}", field="int4_group_size")

    @classmethod
    def parse(cls, name: str, group_size: int = 128, symmetric: bool = True) -> WeightFormat:
        """A format name: fp32, bf16, fp16, fp8 (per-channel scales), fp8-block (128x128 block
        scales), int4 (with `group_size` and `symmetric`)."""
        name = canonical_name(name)
        if name != "int4":  # group and symmetry mean nothing outside int4: one value per format
            group_size, symmetric = 128, True
        if name == "fp8-block":
            return cls("fp8", block=FP8_BLOCK)
        return cls(name, group_size, symmetric)

    @property
    def label(self) -> str:
        if self.block is not None:
            rows, cols = self.block
            return "fp8-block" if self.block == FP8_BLOCK else f"fp8-block{rows}x{cols}"
        if self.name != "int4":
            return self.name
        return f"int4-g{self.group_size}{'' if self.symmetric else '-asym'}"

    def matrix_bytes(self, rows: int, cols: int) -> TensorBytes:
        """Bytes of a [rows, cols] weight matrix (rows = output channels) in this format."""
        elements = rows * cols
        if self.name in ELEMENT_BYTES and self.name != "fp8":
            return TensorBytes(data=elements * ELEMENT_BYTES[self.name])
        if self.name == "fp8" and self.block is not None:  # resident: one per row and block
            col_blocks = -(-cols // self.block[1])
            return TensorBytes(data=elements, scales=rows * col_blocks * FP8_WEIGHT_SCALE_BYTES)
        if self.name == "fp8":
            return TensorBytes(data=elements, scales=rows * FP8_WEIGHT_SCALE_BYTES)
        groups = rows * -(-cols // self.group_size)
        zeros = 0 if self.symmetric else -(-groups // 2)
        return TensorBytes(data=-(-elements // 2), scales=groups * INT4_SCALE_BYTES, zeros=zeros)


def dense_bytes(elements: int, dtype: str) -> TensorBytes:
    """Bytes of an unquantized tensor (embedding, norm, bias, router) stored in `dtype`."""
    if dtype not in ELEMENT_BYTES or dtype == "fp8":
        raise InvalidArgument(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}",
                              field="dtype")
    return TensorBytes(data=elements * ELEMENT_BYTES[dtype])


@dataclass(frozen=True)
class KVFormat:
    """How the KV cache stores one vector: a token's K (or V) for one head, or an MLA latent."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in KV_FORMATS:
            raise InvalidArgument(f"kv cache dtype must be one of {', '.join(KV_FORMATS)}, "
                                  f"got {self.name!r}", field="kv_cache_dtype")

    @classmethod
    def parse(cls, name: str) -> KVFormat:
        return cls(canonical_name(name))

    def vector_bytes(self, dim: int) -> int:
        if self.quantized:
            return dim + KV_FP8_SCALE_BYTES
        return dim * ELEMENT_BYTES[self.name]

    @property
    def quantized(self) -> bool:
        """A 1-byte format with one bf16 scale per vector (fp8 or int8)."""
        return self.name in QUANTIZED_KV_FORMATS

    def gqa_bytes_per_token_layer(self, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one token in one layer: 2 * kv_heads * (head_dim + 2) bytes in fp8 or
        int8."""
        return 2 * num_kv_heads * self.vector_bytes(head_dim)

    def latent_bytes_per_token_layer(self, latent_dim: int, rope_dim: int = 0) -> int:
        """MLA's cached latent (kv_lora_rank + qk_rope_head_dim = latent_dim) in one row: in
        fp8 / int8, kv_lora_rank codes and one bf16 scale, then its `rope_dim` RoPE elements
        in bf16 (DeepSeek-V3: 512 + 2 + 128 = 642 bytes); other formats latent_dim elements."""
        if rope_dim < 0 or (rope_dim and rope_dim >= latent_dim):
            raise InvalidArgument(f"rope_dim must be in [0, {latent_dim}), got {rope_dim}",
                                  field="rope_dim")
        if self.quantized:
            return self.vector_bytes(latent_dim - rope_dim) + rope_dim * ELEMENT_BYTES["bf16"]
        return self.vector_bytes(latent_dim)
