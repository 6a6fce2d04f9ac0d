"""Weights kept in 32-weight blocks as a GGUF file stores them (Q4_0, Q4_1, Q8_0): the planes,
their import from GGUF bytes, and the modules that serve them without a dense copy. The planes'
`linear` is the one linear over the block layout: `BlockLinear` and tessera INT4 in the
"q4_blocks" layout (`runtime.quant.linear.Int4Linear`) both call it.

The planes are `kernels.qgemv`'s layout (it documents it): Q4 `qs` [N, K/2] with fp16 `d`, `m`
[N, K/32] (w = d*q + m; Q4_0's m = -8d, exact in fp16), Q8 `qs` int8 [N, K] with fp16 `d`.
Import moves bytes only: every weight dequantizes to exactly what `gguf.quants.dequantize`
gives (tested bit for bit), so a model served from blocks computes with the very weights of
the dequantized fp32 model, in a different summation order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels.block_linear import block_linear
from kernels.block_panels import BlockPanels, block_panels_linear, pack_block_panels, panels_fit
from kernels.qgemm_bf16 import bf16_linear
from kernels.qgemv import (
    BLOCK,
    q4_dequantize,
    q8_dequantize,
    ref_q4_dequantize,
    ref_q8_dequantize,
)
from kernels.qgemv_i8 import int8_kernels_available
from runtime.errors import ModelLoadError

# GGUF type name -> (bytes per 32-weight block, plane kind)
GGUF_BLOCK_TYPES = {"Q4_0": (18, "q4"), "Q4_1": (20, "q4"), "Q8_0": (34, "q8")}


@dataclass
class BlockPlanes:
    """One [N, K] weight matrix as block planes (kind "q4": qs, d, m; "q8": qs, d). GGUF's Q4
    planes have `m` and groups of 32; tessera INT4 has groups of `group_size` and, instead of
    `m`, 4-bit `zeros` (asymmetric) or neither (symmetric), as `kernels.qgemv` lays them out."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    group_size: int = BLOCK

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * (2 if self.kind == "q4" else 1)

    def rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockPlanes:
        """The same planes with `fn` applied to every plane's rows (a row permutation). Raises
        ValueError for planes with packed zero points (their nibbles do not follow rows)."""
        if self.zeros is not None:
            raise ValueError("planes with packed zero points cannot be permuted by rows")
        return BlockPlanes(self.kind, fn(self.qs), fn(self.d), None if self.m is None
                           else fn(self.m), group_size=self.group_size)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] (the torch twin: the reference the kernels are tested against)."""
        if self.kind == "q4":
            return ref_q4_dequantize(self.qs, self.d, self.m, self.group_size, self.zeros)
        return ref_q8_dequantize(self.qs, self.d)

    def to_dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype` through the dequantize ops (the same values as `dequantize`)."""
        if self.kind == "q4":
            return q4_dequantize(self.qs, self.d, self.m, self.group_size, self.zeros).to(dtype)
        return q8_dequantize(self.qs, self.d).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               limbs: int = 0) -> torch.Tensor:
        """y = x @ W^T (+ bias), x [..., K] -> [..., N]: for float32 x the block linear op
        (`kernels.block_linear`: int8 limbs of x at every row count when `limbs` > 0,
        else float32 x, exact up to summation order); other dtypes dequantize and matmul."""
        if x.dtype != torch.float32:  # the block ops take float32 activations
            return F.linear(x, self.to_dense(x.dtype), bias)
        y = block_linear(x, self.qs, self.d, self.m, self.zeros, self.group_size, limbs)
        return y if bias is None else y + bias

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m, self.zeros)
                   if t is not None)


def import_gguf_blocks(raw: np.ndarray, type_name: str, name: str = "tensor") -> BlockPlanes:
    """GGUF block bytes (uint8 [N, K/32 * block bytes], as `GGUFReader` maps them) -> planes.

    Raises ModelLoadError for a type this does not import or bytes that are not whole blocks.
    """
    if type_name not in GGUF_BLOCK_TYPES:
        raise ModelLoadError(f"tensor {name} is {type_name}; blocks are imported only from "
                             f"{', '.join(GGUF_BLOCK_TYPES)}", tensor=name)
    size, kind = GGUF_BLOCK_TYPES[type_name]
    with warnings.catch_warnings():  # a read-only memory map: only ever copied out of, below
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8))
    if data.dim() != 2 or data.shape[1] % size:
        raise ModelLoadError(f"tensor {name} holds {tuple(data.shape)} bytes, not rows of "
                             f"{size}-byte {type_name} blocks", tensor=name)
    n, nb = data.shape[0], data.shape[1] // size
    blocks = data.view(n, nb, size)

    def f16(lo: int) -> torch.Tensor:
        return blocks[:, :, lo : lo + 2].contiguous().view(torch.float16).view(n, nb)

    if kind == "q8":
        qs = blocks[:, :, 2:].contiguous().view(torch.int8).view(n, nb * BLOCK)
        return BlockPlanes("q8", qs, f16(0))
    d = f16(0)
    if type_name == "Q4_0":  # w = d * (q - 8) = d * q + (-8 d): exact in fp16 unless it overflows
        m = -8.0 * d.float()
        if not torch.isfinite(m.half()).all():
            raise ModelLoadError(f"tensor {name} has Q4_0 scales too large to offset in fp16",
                                 tensor=name)
        m = m.half()
        qs = blocks[:, :, 2:]
    else:
        m, qs = f16(2), blocks[:, :, 4:]
    return BlockPlanes("q4", d=d, m=m, qs=qs.contiguous().view(n, nb * 16))


def cat_planes(parts: list[BlockPlanes]) -> BlockPlanes:
    """Shards stacked along the output rows (fused q/k/v, gate/up); one kind and K only."""
    kinds = {(p.kind, p.in_features, p.group_size) for p in parts}
    if any(p.zeros is not None for p in parts):
        raise ValueError("cannot fuse planes with packed zero points")
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse blocks of different kinds or widths: {sorted(kinds)}")
    m = None if parts[0].m is None else torch.cat([p.m for p in parts])  # type: ignore[misc]
    return BlockPlanes(parts[0].kind, torch.cat([p.qs for p in parts]),
                       torch.cat([p.d for p in parts]), m, group_size=parts[0].group_size)


ACTIVATIONS = ("auto", "int8", "int8x2", "float32", "bf16")
# int8 limbs of x per activation kind (0: the float32 kernels)
INT8_LIMBS = {"int8": 1, "int8x2": 2}


def resolve_activations(choice: str) -> str:
    """`int8`, `int8x2`, `float32` or `bf16` for a BlockLinear; "auto" is int8x2 where the CPU
    has the int8 kernels (AVX-512 VNNI): x in two int8 limbs, KL 5e-8 nats against the dense
    model and faster than float32 at every batch size measured
    (ops/bench/RESULTS.md#gguf-activation-quality); float32 elsewhere. Raises ValueError for
    an unknown choice."""
    if choice not in ACTIVATIONS:
        raise ValueError(f"block activations must be one of {', '.join(ACTIVATIONS)}, got "
                         f"{choice!r}")
    if choice == "auto":
        return "int8x2" if int8_kernels_available() else "float32"
    return choice


class BlockLinear(nn.Module):
    """y = x @ W^T (+ bias) with W held as block planes, never as a dense tensor.

    float32 x, through `BlockPlanes.linear`: with `activations="int8"` / `"int8x2"` (the
    default where the CPU has VNNI) the int8-activation kernel at every row count
    (`kernels.qgemv_i8`: x rounded to one int8 limb per block of 32, as llama.cpp does, or to
    two, the second carrying the first's rounding residual; VNNI dot products, exact in
    integers, each output row summed in one order whatever the row count: batch-invariant,
    docs/DESIGN.md). With "float32", up to
    `kernel_max_rows` rows (decode) the float kernel (`kernels.qgemv`: blocks decoded in
    registers, exact up to summation order); past that
    (prefill, mixed steps, large batches) the same float op dequantizes tiles of W into a
    cache-resident buffer and multiplies them by BLAS, never the whole matrix at once (see
    ops/bench/RESULTS.md#weight-kernels). With `activations="bf16"`, past `bf16_min_rows` rows
    x and the weights are rounded to bf16 for the CPU's bf16 GEMM (`kernels.qgemm_bf16`, vLLM-CPU's
    precision), ~4x the float32 GEMM here; the bf16 weights are a copy made on the first such
    step and kept until `release_cache()` (the engine calls it when idle). Other dtypes:
    dequantize and matmul.
    Buffers are non-persistent: the planes come from the GGUF file, not from a state dict.
    """

    kernel_max_rows = 16  # kernels/cpu/qgemv.cpp kKernelMaxRows: register tiles up to here
    bf16_min_rows = 16  # with "bf16": float32 kernel up to here, bf16 tiles past (RESULTS.md)
    weight = None  # no dense weight; a tied assignment (`lm_head.weight = ...`) is a no-op

    def __init__(self, planes: BlockPlanes, bias: torch.Tensor | None = None,
                 activations: str = "float32") -> None:
        super().__init__()
        self.activations = resolve_activations(activations)
        self.limbs = INT8_LIMBS.get(self.activations, 0)
        self.int8 = self.limbs > 0
        self.bf16 = self.activations == "bf16"
        # "bf16": the blocks dequantized to bf16 [out, in] while the engine is busy with many-row
        # steps (2 bytes a weight), so they are not decoded again every step; None when idle.
        self.bf16_weight: torch.Tensor | None = None
        self.kind = planes.kind
        self.in_features, self.out_features = planes.in_features, planes.out_features
        self.register_buffer("qs", planes.qs, persistent=False)
        self.register_buffer("d", planes.d, persistent=False)
        self.register_buffer("m", planes.m, persistent=False)
        # NOTE: int8 activations read a panel-major copy (kernels/block_panels.py), laid out once
        # here: the same bits as the planes above, without a transpose per call (1.6-2.2x at
        # one row of x, 1.1-1.3x at 128: ops/bench/RESULTS.md, issue 32's session-15 peers run).
        panels = (pack_block_panels(planes.qs, planes.d, planes.m)
                  if self.int8 and int8_kernels_available() and planes.zeros is None
                  and planes.group_size == BLOCK
                  and panels_fit(planes.out_features) else None)
        self.register_buffer("pw", None if panels is None else panels.pw, persistent=False)
        self.register_buffer("pd", None if panels is None else panels.pd, persistent=False)
        self.register_buffer("pm", None if panels is None else panels.pm, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "weight":
            return  # a tied lm_head: the model assigns the embedding's; both read these planes
        super().__setattr__(name, value)

    def planes(self) -> BlockPlanes:
        return BlockPlanes(self.kind, self.qs, self.d, self.m)

    def release_cache(self) -> None:
        """Drops the bf16 copy (rebuilt by the next many-row step); the engine calls it when
        idle, so an idle worker holds only the blocks."""
        self.bf16_weight = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.planes().to_dense(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.bf16 and x.dtype == torch.float32 and rows > self.bf16_min_rows:
            if self.bf16_weight is None:  # NOTE: dropped again by release_cache() when idle
                self.bf16_weight = self.dequantize(torch.bfloat16)
            y = bf16_linear(x, self.bf16_weight)
            return y if self.bias is None else y + self.bias
        if self.pw is not None and x.dtype == torch.float32:
            y = block_panels_linear(x, BlockPanels(self.pw, self.pd, self.pm), self.limbs)
            return y if self.bias is None else y + self.bias
        return self.planes().linear(x, self.bias, self.limbs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.kind} blocks of {BLOCK} (GGUF, as stored), "
                f"{self.activations} activations")


class BlockEmbedding(nn.Module):
    """Token embedding read from block planes: the looked-up rows are dequantized, nothing else
    (the dequantized values equal the fp32 table's rows exactly)."""

    weight = None  # no dense table (see BlockLinear.weight)

    def __init__(self, planes: BlockPlanes) -> None:
        super().__init__()
        self.kind = planes.kind
        self.num_embeddings, self.embedding_dim = planes.out_features, planes.in_features
        self.register_buffer("qs", planes.qs, persistent=False)
        self.register_buffer("d", planes.d, persistent=False)
        self.register_buffer("m", planes.m, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, embedding_dim] float32
        flat = ids.reshape(-1)
        picked = BlockPlanes(self.kind, self.qs.index_select(0, flat),
                             self.d.index_select(0, flat),
                             None if self.m is None else self.m.index_select(0, flat))
        return picked.dequantize().view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind} blocks (GGUF, as stored)"
