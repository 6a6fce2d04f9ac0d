"""Model and engine configuration: frozen dataclasses, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.errors import InvalidArgument, ModelLoadError
from runtime.formats import KVFormat, WeightFormat
from runtime.platform import DEVICES


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False
    # MLA (DeepSeek-V3): what one token caches per layer, kv_lora_rank + qk_rope_head_dim
    # elements, instead of K and V per KV head.
    kv_latent_dim: int | None = None
    kv_rope_dim: int | None = None  # MLA: the latent's last qk_rope_head_dim elements (k_pe)
    # The config.json as read: model families parse their own fields (experts, routing) from it.
    hf_config: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelLoadError(
                    f"config field {name} must be a positive integer, got {value!r}", field=name)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})", field="num_key_value_heads")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (Llama family)."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            params = cfg.get("rope_parameters")  # transformers >= 5 nests rope settings here
            if isinstance(params, dict):
                rope_theta = params.get("rope_theta", rope_theta)
                if params.get("rope_type", "default") != "default":
                    rope_scaling = params
            return cls(
                architecture=str(archs[0]),
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                rope_scaling=rope_scaling,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                attention_bias=bool(cfg.get("attention_bias", False)),
                kv_latent_dim=(int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
                               if cfg.get("kv_lora_rank") else None),
                kv_rope_dim=(int(cfg["qk_rope_head_dim"]) if cfg.get("kv_lora_rank") else None),
                hf_config=dict(cfg),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}",
                                 field=e.args[0]) from e
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json has a malformed field: {e}") from e

    def to_hf_config(self) -> dict[str, Any]:
        """This config as a Hugging Face config.json dict, which `from_hf_config` reads back to
        an equal ModelConfig: the config.json as read for families beyond Llama."""
        eos = list(self.eos_token_ids)
        if self.hf_config is not None and self.architecture != "LlamaForCausalLM":
            return dict(self.hf_config)
        return {"architectures": [self.architecture], "model_type": "llama",
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling,
                "max_position_embeddings": self.max_position_embeddings,
                "tie_word_embeddings": self.tie_word_embeddings,
                "attention_bias": self.attention_bias, "bos_token_id": self.bos_token_id,
                "eos_token_id": eos[0] if len(eos) == 1 else eos, "hidden_act": "silu"}


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs beyond the model: pool and batching sizes, dtypes."""

    page_size: int = 16
    kv_cache_bytes: int | None = None  # None: sized from free memory (runtime.memory)
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    dtype: str = "auto"
    device: str = "auto"  # runtime.platform.DEVICES: auto is CUDA when torch sees it, else CPU
    seed: int = 0
    integrity: str = "tags"
    enable_prefix_caching: bool = True
    tenant_page_quota: float = 1.0
    # Serving formats per phase ("auto" = the compute dtype, or a quantized checkpoint's own);
    # resolved and checked against each other by runtime.serving_formats.ServingFormats.
    kv_cache_dtype: str = "auto"
    prefill_kv_cache_dtype: str = "auto"
    prefill_weights: str = "auto"
    decode_weights: str = "auto"
    weight_group_size: int = 128
    weight_symmetric: bool = True
    # GGUF files: serve Q4_0/Q4_1/Q8_0 tensors as stored ("stored"), dequantize them to the
    # compute dtype at load ("dequantize"), or "auto": stored where the C++ kernels run (CPU).
    gguf_weights: str = "auto"
    # What blocks served as stored multiply on CPU: "float32" (exact up to summation order),
    # "int8x2" (x as two int8 limbs per block of 32 for the VNNI kernels: KL 5e-8 nats against
    # the dense model, faster), "int8" (one limb, as llama.cpp does: faster still, KL ~3e-3;
    # ops/bench/RESULTS.md#gguf-activation-quality), "auto" (the default: int8x2 where
    # the CPU has AVX-512 VNNI, else float32), "bf16" (past 16 rows x rounded to bf16 and a
    # bf16 copy of the weights, kept while busy, for the CPU's bf16 GEMM).
    gguf_activations: str = "auto"
    # GGUF blocks served as stored: read in place from a loading-optimised file mapped shared
    # and read-only (runtime/loader/mapped.py), made once per model; False copies them in.
    mapped_weights: bool = True
    num_threads: int | None = None  # CPU compute threads; None: as the process has them
    # Ranks of the torch.distributed group one engine spans (runtime/distributed.py).
    tensor_parallel_size: int = 1
    # runtime.attention.BACKENDS: "cpu", "torch", "triton", or "auto" (cpu on CPU, triton on
    # CUDA where triton is installed, else torch)
    attention_backend: str = "auto"
    # All-decode steps on static per-bucket buffers (runtime/decode_graphs.py), where the
    # attention backend builds metadata from them (triton): "auto" captures a CUDA graph per
    # bucket at warm-up on CUDA (eager over the buffers on CPU), "eager" never captures,
    # "off" builds every step's metadata afresh.
    decode_graphs: str = "auto"

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidArgument(f"num_threads must be at least 1, got {self.num_threads}",
                                  field="num_threads")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise InvalidArgument(f"tensor_parallel_size must be a positive integer, got "
                                  f"{self.tensor_parallel_size!r}", field="tensor_parallel_size")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise InvalidArgument(f"page_size must be a power of two, got {self.page_size}",
                                  field="page_size")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise InvalidArgument(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}",
                                  field="kv_cache_bytes")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise InvalidArgument(f"max_model_len must be positive, got {self.max_model_len}",
                                  field="max_model_len")
        if not 0.0 < self.tenant_page_quota <= 1.0:
            raise InvalidArgument(f"tenant_page_quota must be in (0, 1], got "
                                  f"{self.tenant_page_quota}", field="tenant_page_quota")
        if self.gguf_weights not in ("auto", "stored", "dequantize"):
            raise InvalidArgument(f"gguf_weights must be auto, stored or dequantize, got "
                                  f"{self.gguf_weights!r}", field="gguf_weights")
        if self.gguf_activations not in ("auto", "int8", "int8x2", "float32", "bf16"):
            raise InvalidArgument(f"gguf_activations must be auto, int8, int8x2, float32 or bf16, "
                                  f"got {self.gguf_activations!r}", field="gguf_activations")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise InvalidArgument(f"attention_backend must be auto, cpu, torch or triton, got "
                                  f"{self.attention_backend!r}", field="attention_backend")
        if self.decode_graphs not in ("auto", "eager", "off"):
            raise InvalidArgument(f"decode_graphs must be auto, eager or off, got "
                                  f"{self.decode_graphs!r}", field="decode_graphs")
        if self.device.split(":", 1)[0] not in DEVICES:
            raise InvalidArgument(f"device must be one of {', '.join(DEVICES)}, got "
                                  f"{self.device!r}", field="device")
        if self.integrity not in ("tags", "off"):
            raise InvalidArgument(f"integrity must be 'tags' or 'off', got {self.integrity!r}",
                                  field="integrity")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise InvalidArgument(f"dtype must be auto, float32, bfloat16 or float16: {self.dtype}",
                                  field="dtype")
        for name in ("kv_cache_dtype", "prefill_kv_cache_dtype"):
            if getattr(self, name) != "auto":
                KVFormat.parse(getattr(self, name))
        for name in ("prefill_weights", "decode_weights"):
            if getattr(self, name) != "auto":
                WeightFormat.parse(getattr(self, name), self.weight_group_size,
                                   self.weight_symmetric)
