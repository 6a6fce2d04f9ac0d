"""One decode step through every layer of a Llama-family decoder in one C++ call
(`kernels/cpu/decode_llama.cpp`): per layer, residual add + RMSNorm, the q/k/v block matmul,
rotate-half RoPE, the KV store, paged decode attention, o_proj, add + norm, gate/up, SiLU x up
and down_proj, the same kernels in the same order as the model's Python forward
(`runtime/models/llama.py`), which is its twin and test oracle. What it removes is the Python
and per-op dispatch between ~25 ops a layer: at one sequence, on one thread, a whole engine
step went from 38.9 to 28.7 ms (ops/bench/RESULTS-log.md#what-the-fused-step-removes). The op is
`torch.ops.tessera.llama_decode_step` over a `torch.classes.tessera.LlamaDecode` holding the
layers; the C++ build declares both (`kernels/ops.py` says why). CPU only: float32
activations in, weights as GGUF blocks (`kernels.qgemv`, `kernels.qgemv_i8`), pages in any of
the cache's formats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.cpu_ops import native


@dataclass(frozen=True)
class BlockProjSpec:
    """A block-weight projection: Q4 (`qs`, `d`, `m`) or Q8 (`qs`, `d`) planes as
    `kernels.qgemv` lays them out, an optional float32 bias, and in how many int8 limbs x goes
    to the VNNI kernels (`kernels.qgemv_i8`), at every row count (0: float32 x)."""

    q8: bool
    limbs: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bias: torch.Tensor | None

    def as_tuple(self) -> tuple[object, ...]:
        return (self.q8, self.limbs, self.qs, self.d, self.m, self.bias)


@dataclass(frozen=True)
class DecodeLayerSpec:
    """One decoder layer: its two RMSNorm weights [hidden], four projections, and its KV pages
    as `runtime.kv.cache.LayerKV` holds them (k, v [kv_heads, pages, page_size, head_dim];
    scales, Hadamard flag and key smoothing for 1-byte pages)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: BlockProjSpec
    o: BlockProjSpec
    gate_up: BlockProjSpec
    down: BlockProjSpec
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    hadamard: bool = False
    k_shift: torch.Tensor | None = None
    k_divisor: torch.Tensor | None = None
    v_divisor: torch.Tensor | None = None


# What `FusedLlamaDecode.phase_ms` accounts for, in the C++ step's order (decode_llama.cpp
# Phase): "norm" is both residual adds + RMSNorms and the last add, "silu_mul" SiLU(gate) x up.
PHASES = ("norm", "qkv", "rope", "store_kv", "attention", "o", "gate_up", "silu_mul", "down")


def fused_decode_available() -> bool:
    """Whether the C++ ops are built (else the model's Python forward runs)."""
    return native() is not None


class FusedLlamaDecode:
    """All layers of one decode step. Raises RuntimeError when the C++ ops are not built."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, eps: float, scale: float,
                 layers: Sequence[DecodeLayerSpec]) -> None:
        ops = native()
        if ops is None:
            raise RuntimeError("the C++ CPU ops are not built; the fused decode step needs them")
        self._op = ops.llama_decode_step
        self._step = torch.classes.tessera.LlamaDecode(heads, kv_heads, head_dim, eps, scale)
        for layer in layers:
            self._step.add_layer(layer.input_norm, layer.post_norm, layer.qkv.as_tuple(),
                                 layer.o.as_tuple(), layer.gate_up.as_tuple(),
                                 layer.down.as_tuple(),
                                 (layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale,
                                  layer.hadamard, layer.k_shift, layer.k_divisor,
                                  layer.v_divisor))

    @property
    def num_layers(self) -> int:
        return int(self._step.num_layers())

    def set_profiling(self, clock: str | None) -> None:
        """Per-phase timing by `clock`: "wall", "cpu" (the calling thread's CPU time: exact at
        one thread on a loaded machine, only the caller's share with more), or None (off, the
        default); one clock read a phase (~300 a step). Resets the totals. Raises ValueError
        for another clock."""
        modes = {None: 0, "wall": 1, "cpu": 2}
        if clock not in modes:
            raise ValueError(f"clock must be 'wall', 'cpu' or None, got {clock!r}")
        self._step.set_profiling(modes[clock])

    def phase_ms(self) -> dict[str, float]:
        """Milliseconds spent in each of `PHASES`, summed over every step since profiling was
        set (by the clock it was set with)."""
        ns = self._step.phase_ns().tolist()
        return {name: t / 1e6 for name, t in zip(PHASES, ns, strict=True)}

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slot_mapping: torch.Tensor, page_table: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] float32 embedded tokens (the residual stream, updated in place);
        cos, sin: [T, 1, head_dim / 2] at each token's position; slot_mapping [T],
        page_table [T, max_pages], context_lens [T] int64 (one decode token per sequence).
        Returns the last layer's hidden states [T, hidden] (before the final norm).
        Raises RuntimeError on shapes the kernels refuse."""
        return self._op(self._step, x, cos, sin, slot_mapping, page_table, context_lens)
