"""Tensor parallelism across processes with torch.distributed (gloo on CPU, NCCL on CUDA).

Every rank runs the same engine (SPMD, as vLLM's and SGLang's TP workers run the same model
code): the launcher feeds each rank the same requests in the same order, and the ranks stay in
step because everything the scheduler and sampler see is identical on every rank. What differs
is the model's share: each rank holds a slice of every layer's heads and MLP columns
(`runtime/models/tensor_parallel.py`) and the KV pages of its own heads, and the attention
output and MLP down projections are summed across ranks with one all-reduce each.

Once per step, before anything reads KV, the ranks exchange what they are about to run (a
fingerprint of the batch and the pool's free count) and how many integrity violations each
found; if any rank found one, they exchange the details and every rank aborts the same
sequences (`TensorParallelIntegrityTracker`). A rank that disagrees on the batch stops the
group with `TensorParallelDesync` rather than compute on mismatched KV.

Reference: Megatron-LM (Shoeybi et al., 2019) for the column/row-parallel split; vLLM's
`parallel_state` for one process group per engine.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from runtime.config import ModelConfig
from runtime.errors import InvalidArgument, TesseraError
from runtime.integrity import IntegrityCounters, Violation
from runtime.kv.cache import KVCacheSpec
from runtime.platform import platform_for, resolve_device
from runtime.sequence import Sequence


class TensorParallelDesync(TesseraError):
    """The ranks of a tensor-parallel group are about to run different batches: fatal."""


class TensorParallelGroupLost(BaseException):
    """A rank of the group failed, left or disagreed (a failed collective, a desync, a dead
    follower): the whole group stops. A BaseException so that neither a step's nor the engine
    loop's `except Exception` keeps serving from ranks whose KV no longer agree."""


def check_tensor_parallel(model_config: ModelConfig, size: int, device: str) -> None:
    """Raise InvalidArgument, before any weight is read, for a group this model or host cannot
    run: more ranks than KV heads (MLA: than query heads, its latent is replicated), or on
    CUDA more ranks than visible devices. Uneven splits are fine (3 KV heads over 2 ranks:
    2 + 1)."""
    if size == 1:
        return
    latent = model_config.kv_latent_dim is not None
    heads = model_config.num_attention_heads if latent else model_config.num_key_value_heads
    if size > heads:
        raise InvalidArgument(f"tensor_parallel_size={size} exceeds the model's {heads} "
                              f"{'attention' if latent else 'KV'} heads",
                              field="tensor_parallel_size")
    platform = platform_for(device)
    visible = platform.visible_devices()
    if visible is not None and size > visible:
        raise InvalidArgument(f"tensor_parallel_size={size} needs {size} "
                              f"{platform.kind.upper()} devices, one per rank; torch sees "
                              f"{visible}", field="tensor_parallel_size")


def init_tensor_parallel(rank: int, size: int, init_method: str,
                         backend: str | None = None, device: str = "auto") -> None:
    """Join the process group that one engine's ranks share. `init_method` is a torch.distributed
    URL (`file:///tmp/x`, `tcp://host:port`, or `env://` under torchrun); `backend` defaults to
    the platform's of `device` (runtime/platform.py: NCCL on CUDA, gloo on CPU; `auto`: CUDA
    when present)."""
    resolved = resolve_device(device)
    backend = backend or platform_for(resolved).distributed_backend
    platform_for(resolved).bind(resolved)  # NCCL binds each rank's communicator to its device
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when n items are split into `parts` contiguous parts whose
    sizes differ by at most one (the first n % parts parts take one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the group: `rank` of `size`, over the default process group;
    `device` is where the group's small exchanges live (NCCL reduces device tensors only)."""

    rank: int
    size: int
    device: str = "cpu"

    @classmethod
    def join(cls, size: int, device: str = "cpu") -> TensorParallel:
        """The group the launcher already initialized (`init_tensor_parallel`); raises
        InvalidArgument unless it has exactly `size` ranks."""
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgument(f"tensor_parallel_size={size} needs torch.distributed "
                                  f"initialized by the launcher (init_tensor_parallel)",
                                  field="tensor_parallel_size")
        if dist.get_world_size() != size:
            raise InvalidArgument(f"tensor_parallel_size={size} but the process group has "
                                  f"{dist.get_world_size()} ranks", field="tensor_parallel_size")
        return cls(dist.get_rank(), size, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` across ranks, in place; every rank gets the same bits."""
        dist.all_reduce(x)
        return x

    def min_across_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (each rank gets the same)."""
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return int(x.item())

    def shard_kv_spec(self, spec: KVCacheSpec, budget_bytes: int) -> tuple[KVCacheSpec, int]:
        """This rank's KV layout (its KV heads; the MLA latent, shared by all heads, is
        replicated) and the page count every rank uses: what the largest shard fits in
        `budget_bytes`, so that page ids mean the same tokens on every rank."""
        if spec.latent:
            return spec, spec.pages_in(budget_bytes)
        if spec.num_kv_heads < self.size:
            raise InvalidArgument(f"tensor_parallel_size={self.size} exceeds the model's "
                                  f"{spec.num_kv_heads} KV heads", field="tensor_parallel_size")
        start, end = split_range(spec.num_kv_heads, self.size, self.rank)
        largest = dataclasses.replace(spec, num_kv_heads=-(-spec.num_kv_heads // self.size))
        return (dataclasses.replace(spec, num_kv_heads=end - start),
                largest.pages_in(budget_bytes))


def batch_fingerprint(seqs: list[Sequence]) -> int:
    """A process-independent hash of what a step runs (request ids, tokens computed so far)."""
    text = ";".join(f"{s.request_id}:{s.num_computed_tokens}" for s in seqs)
    return zlib.crc32(text.encode())


class TensorParallelIntegrityTracker:
    """The page check on every rank, agreed across ranks: a violation any rank finds aborts the
    sequence on all of them. On ranks where the page still looked fine, the page is retired as
    the finding rank's is (its tag moves on, so releasing the sequence skips it), which keeps
    every rank's pool in the same state."""

    def __init__(self, local: Any, tp: TensorParallel) -> None:
        self.local = local
        self.tp = tp
        self.name = local.name
        self.pool = local.pool

    @property
    def counters(self) -> IntegrityCounters:
        return self.local.counters  # type: ignore[no-any-return]

    def verify_batch(self, seqs: list[Sequence]) -> list[Violation]:
        found = self.local.verify_batch(seqs)
        header = torch.tensor([batch_fingerprint(seqs), self.pool.num_free_pages, len(found)],
                              dtype=torch.int64, device=self.tp.device)
        headers = [torch.empty_like(header) for _ in range(self.tp.size)]
        dist.all_gather(headers, header)
        if any(not torch.equal(h[:2], header[:2]) for h in headers):
            raise TensorParallelDesync(
                f"tensor-parallel rank {self.tp.rank} is about to run another batch than its "
                f"peers (fingerprint, free pages by rank: {[h[:2].tolist() for h in headers]})")
        if not any(int(h[2]) for h in headers):
            return found
        index = {id(s): i for i, s in enumerate(seqs)}
        mine = [(index[id(v.seq)], v.page_id, v.expected_tag, v.found_tag, v.cause)
                for v in found]
        everyone: list[Any] = [None] * self.tp.size
        dist.all_gather_object(everyone, mine)
        first: dict[int, Violation] = {}  # per sequence, the lowest rank's first violation
        for rank, rows in enumerate(everyone):
            for i, page_id, expected, found_tag, cause in rows:
                if i not in first:
                    where = "" if rank == self.tp.rank else f" on tensor-parallel rank {rank}"
                    first[i] = Violation(seqs[i], page_id, expected, found_tag, cause + where)
        for i, v in first.items():
            for ref in seqs[i].recorded_pages:
                if ref.page_id == v.page_id and self.pool.is_live(ref):
                    self.pool.tags[ref.page_id] += 1  # retire it here too
                    self.pool.touch(ref.page_id)
        return [first[i] for i in sorted(first)]
