"""From a checkpoint and an EngineConfig to a servable engine: device and dtype, serving
formats, tensor parallelism, the prefill and decode models, the KV pool, scheduler, model runner,
sampler and integrity tracker (nano-vllm's `LLMEngine.__init__` + `ModelRunner.__init__`)."""

from __future__ import annotations

import logging

import torch

from runtime.attention import AttentionBackend, make_backend
from runtime.config import EngineConfig, ModelConfig
from runtime.decode_graphs import DecodeGraphRunner, buckets_up_to
from runtime.distributed import (
    TensorParallel,
    TensorParallelIntegrityTracker,
    check_tensor_parallel,
)
from runtime.errors import InvalidArgument
from runtime.grammar import GrammarCompiler
from runtime.heap import release_free_heap
from runtime.input_processor import InputProcessor
from runtime.integrity import NoopIntegrityTracker, TagIntegrityTracker
from runtime.kv import smoothing
from runtime.kv.budget import auto_kv_cache_bytes
from runtime.kv.cache import KVCache, KVCacheSpec
from runtime.kv.pages import PagePool
from runtime.kv.prefix import PrefixCache
from runtime.loader import Checkpoint
from runtime.loader.weight_layout import use_column_major_weights
from runtime.model_runner import ModelRunner
from runtime.models import model_class
from runtime.models.meta_init import meta_without_init
from runtime.platform import Platform, platform_for, resolve_device
from runtime.progress import progress
from runtime.quant.prepare import prepare_weights
from runtime.sampler import Sampler
from runtime.scheduler import Scheduler, SchedulerConfig
from runtime.serving_formats import ServingFormats
from runtime.tokenizer import Tokenizer

log = logging.getLogger("tessera.engine")

Tracker = TagIntegrityTracker | NoopIntegrityTracker | TensorParallelIntegrityTracker


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype `name` names; "auto" is the device's platform default."""
    return getattr(torch, platform_for(device).default_dtype if name == "auto" else name)


class EngineBuild:
    """The engine's parts, built once by `_build` (the first half of `LLMEngine.__init__`)."""

    config: EngineConfig
    checkpoint: Checkpoint
    model_config: ModelConfig
    tokenizer: Tokenizer
    processor: InputProcessor
    device: torch.device
    platform: Platform
    dtype: torch.dtype
    num_threads: int
    formats: ServingFormats
    weight_labels: tuple[str, str]  # (prefill, decode): what the linears really compute with
    tp: TensorParallel | None
    attention: AttentionBackend
    prefill_model: torch.nn.Module
    decode_model: torch.nn.Module
    kv_cache: KVCache
    kv_cache_budget_bytes: int
    pool: PagePool
    max_model_len: int
    prefix_cache: PrefixCache | None
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    tracker: Tracker
    eos_ids: set[int]
    grammars: GrammarCompiler

    def _build(self, checkpoint: Checkpoint, config: EngineConfig) -> None:
        self.config = config
        self.checkpoint = checkpoint
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.processor = InputProcessor(self.tokenizer, self.model_config.vocab_size)
        self.device = torch.device(resolve_device(config.device))
        self.platform = platform_for(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.num_threads = self.platform.compute_threads(config.num_threads)
        self.formats = serving_formats(checkpoint, config, self.dtype)
        self.tp = self._join_tensor_parallel()
        self.attention = make_backend(config.attention_backend, self.device)
        self.prefill_model, self.decode_model = self._build_models()
        self.checkpoint.release_file_pages()  # the model holds its own copies now
        release_free_heap()  # the load's transient buffers, back to the OS before serving
        spec = self._build_kv_cache()
        num_pages, self.kv_cache_budget_bytes = self.kv_cache.num_pages, self.kv_cache.budget_bytes
        self.pool = PagePool(num_pages, config.page_size)
        self.max_model_len = min(self.model_config.max_position_embeddings,
                                 num_pages * config.page_size,
                                 config.max_model_len or 1 << 62)
        self.prefix_cache = PrefixCache(self.pool) if config.enable_prefix_caching else None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            tenant_page_quota=config.tenant_page_quota), self.pool,
            self.prefix_cache)
        self.runner = ModelRunner(self.prefill_model, self.decode_model, self.kv_cache,
                                  self.device, self.attention)
        self.sampler = Sampler(config.seed, self.model_config.eos_token_ids)
        self.tracker = self.attention.integrity_tracker(config.integrity, self.pool)
        if self.tp is not None:
            self.tracker = TensorParallelIntegrityTracker(self.tracker, self.tp)
        self.runner.valid_rows = getattr(self.tracker, "valid_rows", None)
        if (config.decode_graphs != "off" and self.tp is None
                and hasattr(self.attention, "static_decode_metadata")):
            self.runner.graphs = DecodeGraphRunner(
                self.decode_model, self.kv_cache, self.attention, self.device,
                buckets_up_to(config.max_num_seqs), self.pool.pages_for_tokens(self.max_model_len))
        self.eos_ids = set(self.model_config.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                        sorted(self.eos_ids))
        log.info("engine ready%s: %s on %s, %d pages of %d tokens: %d tokens of %s KV at %d bytes "
                 "each; prefill weights %s, decode weights %s",
                 "" if self.tp is None else f" (tensor-parallel rank {self.tp.rank} of "
                 f"{self.tp.size}, its share of the KV heads)", checkpoint.revision, self.device,
                 num_pages, config.page_size, num_pages * config.page_size,
                 self.formats.kv.name, spec.bytes_per_token, *self.weight_labels)

    def _build_kv_cache(self) -> KVCacheSpec:
        """The KV pages (`self.kv_cache`), sized by the budget; returns their spec."""
        config = self.config
        # NOTE: colocated, KV is written in the decode phase's format whoever writes it.
        spec = KVCacheSpec.for_model(self.model_config, config.page_size, self.formats.kv)
        if self.tp is None:
            self.kv_cache = KVCache.within(spec, config.kv_cache_bytes, self.device)
        else:  # this rank's heads; the same page count on every rank
            budget = config.kv_cache_bytes
            if budget is None:  # NOTE: each rank measures its free memory at its own moment
                budget = self.tp.min_across_ranks(auto_kv_cache_bytes())
            spec, tp_pages = self.tp.shard_kv_spec(spec, budget)
            if tp_pages < 1:
                raise InvalidArgument(f"kv_cache_bytes={budget} holds no page of "
                                      f"{spec.bytes_per_page} bytes", field="kv_cache_bytes")
            self.kv_cache = KVCache(spec, tp_pages, self.device)
            self.kv_cache.budget_bytes = budget
        if smoothing.SMOOTH_FP8_KEYS and spec.quantized and not spec.latent and self.tp is None:
            self.kv_cache.key_smoothing = smoothing.calibrate_key_smoothing(
                self.prefill_model, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                smoothing.calibration_windows(
                    lambda text: self.tokenizer.encode(text, add_special_tokens=False)),
                self.device, self.attention)
        return spec

    def _build_models(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """The prefill and decode models: one object when both phases serve the same weights,
        else two sharing everything but the linear layers (both resident, both counted)."""
        with meta_without_init():
            model = model_class(self.model_config)(self.model_config)
        from runtime.loader.gguf_blocks import (
            load_gguf_as_stored,
            serves_as_stored,
            stored_blocks_label,
        )

        # NOTE: tensor-parallel ranks shard dense weights: blocks are served on one rank only.
        if self.tp is None and serves_as_stored(self.config.gguf_weights, self.checkpoint,
                                                self.formats, self.dtype, self.device):
            load_gguf_as_stored(model, self.checkpoint, self.dtype,  # type: ignore[arg-type]
                                self.config.gguf_activations, self.config.mapped_weights)
            label = stored_blocks_label(self.checkpoint, self.config.gguf_activations)
            self.weight_labels = (label, label)
            base = model.to(self.device).eval()
            return base, base
        self.weight_labels = (self.formats.prefill.weights.label,
                              self.formats.decode.weights.label)
        stored = self.checkpoint.quantization
        tensors = progress(self.checkpoint.tensors(), "load weights", unit="tensors")
        model.load_weights(tensors, self.dtype, quantization=stored)
        if self.tp is not None:
            from runtime.models.tensor_parallel import shard_model

            shard_model(model, self.tp)
        base = model.to(self.device).eval()
        if stored is not None:
            return _lay_out(base), base  # served as stored (ServingFormats refuses the rest)
        from runtime.quant.convert import convert_model  # returns `base` for its own dtype

        prefill = convert_model(base, self.formats.prefill.weights)
        if self.formats.shares_weights:
            return _lay_out(prefill), prefill
        decode = convert_model(base, self.formats.decode.weights)
        return _lay_out(prefill), _lay_out(decode)

    def _join_tensor_parallel(self) -> TensorParallel | None:
        """This rank's place in the launcher's process group, or None for one process."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return None
        _check_tensor_parallel(self.checkpoint, self.formats, size, str(self.device))
        return TensorParallel.join(size, str(self.device))


def serving_formats(checkpoint: Checkpoint, config: EngineConfig,
                    dtype: torch.dtype) -> ServingFormats:
    """The weight and KV formats of each phase that `config` asks of `checkpoint`."""
    return ServingFormats.resolve(
        str(dtype).removeprefix("torch."), prefill_weights=config.prefill_weights,
        decode_weights=config.decode_weights, kv_cache_dtype=config.kv_cache_dtype,
        prefill_kv_cache_dtype=config.prefill_kv_cache_dtype,
        group_size=config.weight_group_size, symmetric=config.weight_symmetric,
        checkpoint_format=checkpoint.quantization)


def check_tensor_parallel_choices(checkpoint: Checkpoint, config: EngineConfig) -> None:
    """What an engine of `config` refuses about its tensor parallelism, checked without
    building it (no weight read, no process group): `tessera serve --tp` runs it before any
    worker starts. Raises InvalidArgument."""
    device = resolve_device(config.device)
    formats = serving_formats(checkpoint, config, resolve_dtype(config.dtype,
                                                                torch.device(device)))
    _check_tensor_parallel(checkpoint, formats, config.tensor_parallel_size, device)


def _check_tensor_parallel(checkpoint: Checkpoint, formats: ServingFormats, size: int,
                           device: str) -> None:
    stored = checkpoint.quantization
    quantized = [p.weights.label for p in (formats.prefill, formats.decode)
                 if p.weights.name in ("fp8", "int4")]
    if stored is not None or quantized:
        raise InvalidArgument("tensor parallelism serves float weights only for now, not "
                              f"{stored.label if stored is not None else quantized[0]}",
                              field="tensor_parallel_size")
    check_tensor_parallel(checkpoint.config, size, device)


def _lay_out(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its float projections stored as the CPU matmul reads them fastest and its
    quantized ones as its device's kernels read them (`prepare_weights`: INT4 repacked to the
    GPU tiles once, here), after any conversion, which reads the weights as loaded."""
    use_column_major_weights(model)
    prepare_weights(model)
    return model
