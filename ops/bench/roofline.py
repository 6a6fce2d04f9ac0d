"""The machine's compute roof: measured matmul throughput and the model's FLOPs per token."""

from __future__ import annotations

import time

import torch

from runtime.config import ModelConfig


def matmul_gflops(m: int, k: int, n: int, repeats: int = 10) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best / 1e9


def flops_per_token(cfg: ModelConfig, context_len: int) -> float:
    """Matmul FLOPs to produce one token at a given context length (lm_head included)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    linear = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    attention = 2 * cfg.num_attention_heads * cfg.head_dim * context_len  # QK^T and PV
    return 2 * (layers * (linear + attention) + h * cfg.vocab_size)
