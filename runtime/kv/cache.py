"""KV storage tensors. A page id names the same slot range in every layer.

Layout per layer: [num_kv_heads, num_pages, page_size, head_dim]. Head-major keeps each
head's context contiguous after a page gather, so decode attention is plain batched matmuls
on CPU; GPU kernels index pages directly and do not care.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: ModelConfig, page_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                   page_size, dtype)

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def pages_in(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_page


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_pages: int, device: torch.device | str) -> None:
        self.spec = spec
        self.num_pages = num_pages
        shape = (spec.num_layers, spec.num_kv_heads, num_pages, spec.page_size, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)

    @property
    def num_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]
