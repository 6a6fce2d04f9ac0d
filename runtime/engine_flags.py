"""The one definition of the engine's command-line flags (model, sizes, serving formats).

`tessera generate`, `tessera chat`, `tessera serve` and the worker process all add them with
`add_engine_flags`; `serve` hands the ones a user set to its workers with `engine_argv`, so a
flag accepted by one is accepted, with the same meaning and default, by all.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from runtime.config import EngineConfig
from runtime.formats import INT4_GROUP_SIZES, KV_FORMATS
from runtime.threads import resolve_num_threads

_KV = ["auto", *KV_FORMATS]
_WEIGHTS = ["auto", "fp32", "bf16", "fp16", "fp8", "int4"]


@dataclass(frozen=True)
class Flag:
    name: str  # --name on the command line; its dest is name with "_" for "-"
    help: str
    default: Any = None
    type: Any = str
    choices: tuple[Any, ...] | None = None
    switch: bool = False  # a flag without a value (store_true)

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


_DEFAULTS = EngineConfig()
FLAGS: tuple[Flag, ...] = (
    Flag("model", "GGUF file or Hugging Face directory (default: the embedded SmolLM2)"),
    Flag("dtype", "compute dtype", "auto", choices=("auto", "float32", "bfloat16", "float16")),
    Flag("kv-cache-bytes", "bytes of KV pages, scales included (capacity printed at start; "
         "default: a quarter of the memory available once the weights are loaded, 64 MiB to "
         "8 GiB)", _DEFAULTS.kv_cache_bytes, int),
    Flag("max-model-len", "longest prompt + output, in tokens (default: what the model and "
         "the KV pool allow)", None, int),
    Flag("max-num-seqs", "sequences running at once", _DEFAULTS.max_num_seqs, int),
    Flag("max-num-batched-tokens", "tokens per step (chunked prefill budget)",
         _DEFAULTS.max_num_batched_tokens, int),
    Flag("tenant-page-quota", "share of the KV pool one tenant's running requests may hold",
         _DEFAULTS.tenant_page_quota, float),
    Flag("integrity", "page tag and owner check before every step", _DEFAULTS.integrity,
         choices=("tags", "off")),
    Flag("device", "where the engine computes: cpu, cuda (or cuda:N), auto (CUDA when torch "
         "sees a CUDA device, else CPU)", _DEFAULTS.device),
    Flag("attention-backend", "attention kernels: cpu (the C++ CPU ops and fused decode "
         "step), torch (the torch reference, any device), triton (the Triton kernels: CUDA, "
         "or CPU under TRITON_INTERPRET=1; the cuda extra), auto (cpu on CPU, triton on CUDA)",
         _DEFAULTS.attention_backend, choices=("auto", "cpu", "torch", "triton")),
    Flag("decode-graphs", "all-decode steps on static per-batch-bucket buffers (triton "
         "backend): auto (a CUDA graph per bucket, captured at warm-up, on CUDA), eager (the "
         "buffers, never captured), off", _DEFAULTS.decode_graphs,
         choices=("auto", "eager", "off")),
    Flag("kv-cache-dtype", "KV page format ('auto' = the compute dtype; fp8 e4m3 and int8 "
         "store 1 byte per element plus a bf16 scale per token and KV head: ~1.9x the tokens "
         "of bf16; int8 is the more accurate of the two)", "auto",
         choices=tuple(_KV)),
    Flag("prefill-kv-cache-dtype", "KV format prefill computes in ('auto' = decode's)", "auto",
         choices=tuple(_KV)),
    Flag("prefill-weights", "prefill weight format ('auto' = the compute dtype)", "auto",
         choices=tuple(_WEIGHTS)),
    Flag("decode-weights", "decode weight format ('auto' = the compute dtype)", "auto",
         choices=tuple(_WEIGHTS)),
    Flag("weight-group-size", "int4 group size", _DEFAULTS.weight_group_size, int,
         choices=tuple(INT4_GROUP_SIZES)),
    Flag("weight-asymmetric", "int4 with a zero point per group", False, switch=True),
    Flag("gguf-weights", "GGUF files: serve Q4_0/Q4_1/Q8_0 blocks as stored, or dequantize "
         "them at load ('auto' = stored where the C++ CPU kernels run)", _DEFAULTS.gguf_weights,
         choices=("auto", "stored", "dequantize")),
    Flag("gguf-activations", "GGUF blocks served as stored multiply float32 activations "
         "(exact up to summation order), int8x2 ones (two int8 limbs per block of 32 for VNNI "
         "dot products: KL 5e-8 against the dense model, faster), int8 ones (one limb, as "
         "llama.cpp does: faster still, KL ~3e-3), or, past 16 rows (prefill, large batches), "
         "bf16 ones over a bf16 copy of the weights kept while busy (vLLM-CPU's precision, the "
         "CPU's bf16 GEMM); 'auto' = int8x2 where the CPU has AVX-512 VNNI, else float32",
         _DEFAULTS.gguf_activations, choices=("auto", "int8", "int8x2", "float32", "bf16")),
    Flag("no-mapped-weights", "GGUF blocks served as stored: copy them into the process "
         "instead of reading them in place from the shared, read-only mapped file "
         "($TESSERA_MAPPED_DIR, made once per model)", False, switch=True),
    Flag("worker-threads", "CPU threads one engine computes on (default: every core this "
         "process may run on; `serve` splits them evenly among --max-workers)", None, int),
    Flag("serving-config", 'JSON file: {"prefill": {"weights": "fp8", "kv_cache_dtype": '
         '"bf16"}, "decode": {"weights": "int4", "kv_cache_dtype": "fp8"}} (overrides the '
         "format flags)"),
)
BY_NAME = {f.name: f for f in FLAGS}


def add_engine_flags(parser: argparse.ArgumentParser,
                     exclude: tuple[str, ...] = ()) -> None:
    """Add every engine flag but those in `exclude` (names without dashes)."""
    group = parser.add_argument_group("engine and serving formats")
    for f in FLAGS:
        if f.name in exclude:
            continue
        if f.switch:
            group.add_argument(f"--{f.name}", action="store_true", help=f.help)
        else:
            group.add_argument(f"--{f.name}", default=f.default, type=f.type,
                               choices=f.choices, help=f.help,
                               metavar=None if f.choices else f.dest.upper())


def engine_argv(args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> list[str]:
    """The engine flags set to something other than their default, as command-line words."""
    out: list[str] = []
    for f in FLAGS:
        value = getattr(args, f.dest, f.default)
        if f.name in exclude or value == f.default:
            continue
        out += [f"--{f.name}"] if f.switch else [f"--{f.name}", str(value)]
    return out


def format_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The serving-format keyword arguments (of `LLM` and `EngineConfig`) the flags name."""
    if args.serving_config:
        from runtime.serving_formats import read_serving_config

        kw = read_serving_config(args.serving_config)
        kw["weight_group_size"] = kw.pop("group_size", args.weight_group_size)
        kw["weight_symmetric"] = kw.pop("symmetric", not args.weight_asymmetric)
        return kw
    return {"kv_cache_dtype": args.kv_cache_dtype,
            "prefill_kv_cache_dtype": args.prefill_kv_cache_dtype,
            "prefill_weights": args.prefill_weights, "decode_weights": args.decode_weights,
            "weight_group_size": args.weight_group_size,
            "weight_symmetric": not args.weight_asymmetric}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(kv_cache_bytes=args.kv_cache_bytes, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
                        tenant_page_quota=args.tenant_page_quota, integrity=args.integrity,
                        device=getattr(args, "device", _DEFAULTS.device),
                        attention_backend=getattr(args, "attention_backend", "auto"),
                        decode_graphs=getattr(args, "decode_graphs", "auto"),
                        gguf_weights=getattr(args, "gguf_weights", "auto"),
                        gguf_activations=getattr(args, "gguf_activations", "auto"),
                        mapped_weights=not getattr(args, "no_mapped_weights", False),
                        num_threads=resolve_num_threads(args.worker_threads),
                        **format_kwargs(args))
