"""KV storage tensors. A page id names the same slot range in every layer.

Layout per layer: [num_kv_heads, num_pages, page_size, head_dim]. Head-major keeps each
head's context contiguous after a page gather, so decode attention is plain batched matmuls
on CPU; GPU kernels index pages directly and do not care.

The two 1-byte ("quantized") formats share one layout: FP8 (e4m3) pages hold the raw bytes as
uint8 (index_copy_ and index_select work on them on every device), INT8 pages symmetric int8
codes (kernels/int8.py), each plus one bf16 scale per (token, KV head) in a parallel
[kv_heads, pages, page_size] tensor: the scale lives beside its page, so a page is moved,
verified or freed as one unit (see kernels/fp8.py for why per token per head). The page dtype
(uint8 or int8) is what tells the kernels which code grid to decode. With `ROTATE_FP8_KV` (on),
quantized K/V pages of a power-of-two head_dim hold the Walsh-Hadamard rotation of each K and V
vector (QuaRot's online Hadamard, `kernels/hadamard.py`): the same bytes, ~27% less KL
divergence than the unrotated fp8 format on held-out text
(ops/bench/RESULTS-log.md#the-gate-with-the-issues-command); the attention kernels undo it.
MLA latent pages are never rotated.

MLA models (DeepSeek-V3) cache one latent vector per token and layer (kv_lora_rank normalised
latent, then the roped qk_rope_head_dim key part) instead of K and V per head: the same layout
with one "head" and no V tensor, [1, num_pages, page_size, latent_dim], the layout FlashMLA-style
GPU kernels read (values are the latent's first kv_lora_rank elements). In the 1-byte formats
(fp8, int8) a latent row is FlashMLA's: kv_lora_rank codes with one bf16 scale per token (the
scale tensor beside the page, as for K/V), then the roped k_pe part unquantized, as bf16 bytes in
the same row, so [1, num_pages, page_size, kv_lora_rank + 2 * rope] of uint8 / int8 (640 bytes
for DeepSeek-V3, 642 with the scale): one scale over all 576 values lost the RoPE scores
(docs/DESIGN.md, "MLA decode"). `kernels/latent.py` writes and reads that row. Tags and the
prefix cache apply to latent pages unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels.hadamard import kv_rotation_applies
from runtime.config import ModelConfig
from runtime.errors import InvalidArgument
from runtime.formats import KVFormat, canonical_name
from runtime.kv.budget import auto_kv_cache_bytes
from runtime.platform import platform_for

# NOTE: a prompt served from a prefix-cache hit recomputes only its uncached tail, with GEMMs over
# fewer rows that round differently (~1e-6); re-quantizing that tail's K/V to e4m3 can then land
# a whole step away where a value or a row's bf16 scale sits at a rounding midpoint, so its
# logits differ from a whole prefill's by up to ~0.4 (KL ~2e-3) on a few prompts in 10, rotated
# or not (measured in tests/runtime/test_kv_cache_dtype.py; the ops agree to 1e-5 given the
# same inputs, tests/kernels/test_rotated_prefix.py). It is not a rotation bug.
ROTATE_FP8_KV = True

def quantized_pages_rotated(head_dim: int, latent: bool = False) -> bool:
    """Whether quantized (fp8 / int8) pages of this head size hold Hadamard-rotated K and V
    (never MLA latents)."""
    return ROTATE_FP8_KV and not latent and kv_rotation_applies(head_dim)


fp8_pages_rotated = quantized_pages_rotated  # the name it had when fp8 was the only 1-byte format

STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                  "fp8": torch.uint8, "int8": torch.int8}
_LOGICAL = {**STORAGE_DTYPES, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    format: KVFormat
    latent: bool = False  # MLA: one latent vector per token (num_kv_heads 1), no V
    rope_dim: int = 0  # MLA: the latent's last rope_dim elements (k_pe), bf16 in 1-byte rows

    @classmethod
    def for_model(cls, config: ModelConfig, page_size: int,
                  fmt: KVFormat | torch.dtype | str) -> KVCacheSpec:
        if not isinstance(fmt, KVFormat):
            fmt = KVFormat.parse(canonical_name(str(fmt)))
        if config.kv_latent_dim is not None:
            return cls(config.num_hidden_layers, 1, config.kv_latent_dim, page_size, fmt, True,
                       config.kv_rope_dim or 0)
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                   page_size, fmt)

    @property
    def dtype(self) -> torch.dtype:
        """The logical element type (float8_e4m3fn for fp8, whose bytes are stored as uint8)."""
        return _LOGICAL[self.format.name]

    @property
    def storage_dtype(self) -> torch.dtype:
        return STORAGE_DTYPES[self.format.name]

    @property
    def is_fp8(self) -> bool:
        return self.format.name == "fp8"

    @property
    def quantized(self) -> bool:
        """1-byte pages with a bf16 scale per (token, KV head): fp8 or int8."""
        return self.format.quantized

    @property
    def hadamard(self) -> bool:
        """Whether pages hold Hadamard-rotated K and V (fp8 / int8 K/V pages, not MLA latent
        ones, with a power-of-two head_dim)."""
        return self.quantized and quantized_pages_rotated(self.head_dim, self.latent)

    @property
    def row_width(self) -> int:
        """Elements of the storage dtype in one page row: head_dim, except 1-byte MLA latent
        rows, whose RoPE part is bf16 bytes (kv_lora_rank + 2 * rope_dim)."""
        if self.latent and self.quantized:
            return self.head_dim + self.rope_dim
        return self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """K and V (or the MLA latent) of one token in every layer, scales included."""
        if self.latent:
            return self.num_layers * self.format.latent_bytes_per_token_layer(self.head_dim,
                                                                              self.rope_dim)
        per_layer = self.format.gqa_bytes_per_token_layer(self.num_kv_heads, self.head_dim)
        return self.num_layers * per_layer

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def pages_in(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_page


class KeySmoothing(NamedTuple):
    """Smoothing of quantized (fp8 / int8) K/V pages (calibrated by runtime/kv/smoothing.py),
    per (layer, KV head, channel), float32 [layers, kv_heads, head_dim]: keys are stored as
    (k - shift) / scale and queries read them as q * scale, so q.k moves by q.shift alone;
    values are stored as v / v_scale and the attention output read as o * v_scale."""

    shift: torch.Tensor
    scale: torch.Tensor
    v_scale: torch.Tensor


class LayerKV(NamedTuple):
    """One layer's view of the cache. Scales are None unless the pages are fp8 or int8;
    `hadamard` says the pages hold rotated vectors (pass it to the attention and store kernels)."""

    # [kv_heads, pages, page_size, head_dim]; MLA: [1, pages, page_size, row_width]
    k: torch.Tensor
    v: torch.Tensor | None  # None for MLA latent pages
    k_scale: torch.Tensor | None  # [kv_heads, pages, page_size] bf16
    v_scale: torch.Tensor | None
    hadamard: bool = False
    # [kv_heads, dim] float32 or None: keys are stored as (k - k_shift) / k_channel_scale and
    # queries multiplied by k_channel_scale (runtime/kv/smoothing.py)
    k_shift: torch.Tensor | None = None
    k_channel_scale: torch.Tensor | None = None
    v_channel_scale: torch.Tensor | None = None


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_pages: int, device: torch.device | str) -> None:
        self.spec = spec
        self.num_pages = num_pages
        self.budget_bytes = spec.bytes_per_page * num_pages  # what sized it (see `within`)
        zeros = platform_for(device).zeros
        shape = (spec.num_layers, spec.num_kv_heads, num_pages, spec.page_size, spec.row_width)
        self.k = zeros(shape, spec.storage_dtype, device)
        self.v: torch.Tensor | None = None
        if not spec.latent:
            self.v = zeros(shape, spec.storage_dtype, device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # quantized K/V pages: keys stored as (k - shift) / scale, read by q * scale
        # (runtime/kv/smoothing.py: KeySmoothing, [layers, kv_heads, head_dim]); None: plain.
        self.key_smoothing: KeySmoothing | None = None
        if spec.quantized:
            self.k_scale = zeros(shape[:-1], torch.bfloat16, device)
            if not spec.latent:
                self.v_scale = zeros(shape[:-1], torch.bfloat16, device)

    @classmethod
    def within(cls, spec: KVCacheSpec, budget_bytes: int | None,
               device: torch.device | str) -> KVCache:
        """As many whole pages as `budget_bytes` holds (None: the budget free memory allows,
        runtime.kv.budget); InvalidArgument when not one. `budget_bytes` is kept on it."""
        budget = auto_kv_cache_bytes() if budget_bytes is None else budget_bytes
        num_pages = spec.pages_in(budget)
        if num_pages < 1:
            raise InvalidArgument(f"kv_cache_bytes={budget} holds no page of "
                                  f"{spec.bytes_per_page} bytes", field="kv_cache_bytes")
        cache = cls(spec, num_pages, device)
        cache.budget_bytes = budget
        return cache

    @property
    def num_bytes(self) -> int:
        tensors = [self.k, self.v, self.k_scale, self.v_scale]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def layer(self, index: int) -> LayerKV:
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        smooth = (None,) * 3 if self.key_smoothing is None else tuple(
            t[index] for t in self.key_smoothing)
        return LayerKV(self.k[index], pick(self.v), pick(self.k_scale), pick(self.v_scale),
                       self.spec.hadamard, *smooth)
