"""The GPU check's MoE engine section (issue 30, run by ops/bench/gpu_check.sh): the engine on
`--device cuda` with the `triton` backend over a random GLM-4.5-Air-shaped checkpoint made on
the device (nothing downloaded), served twice side by side: INT4 weights (g32 symmetric: W4A16
linears over the GPU tiles, INT4 experts) and block-FP8 weights (W8A8 linears and experts, as
DeepSeek-V3's checkpoints are served). Decode tok/s at concurrency 1, 8 and 32 and prefill
tok/s for both, measured interleaved (one engine, then the other, per row), against the
reference deployment's figures (GLM: INT4 decode 1.55x FP8 at concurrency 1, +21% at 8, +27%
at 32; FP8 prefill 1.17x INT4).

Scaled to fit the device budget: GLM-4.5-Air's widths (hidden 4096, 96/8 heads of 128, dense
intermediate 10944, 128-dim RoPE half of each head, experts of 1408, top-8 routing, one shared
expert, the first layer dense) with 6 layers instead of 46, 64 routed experts instead of 128
(a token still reads 8 routed + 1 shared expert per layer, as in the model; at concurrency 32
nearly every expert is read, as in the model) and a vocabulary of 20480 (cut in proportion
to the layers, so the LM head's share of a token's weight bytes stays the model's ~5%).

A decode step is timed as in `gpu_check_engine.decode_run` (median of the timed steps, every
sequence decoding, CUDA graphs where the engine captured them); a prefill as the wall time of
the steps that compute the prompts and sample their first token, after one untimed prefill of
the same shape. Without CUDA it exits 2 at once; `--tiny` runs the same code on a 2-layer
model, on CPU in Triton's interpreter (the weight kernels through
`cuda_ops.interpreted_weight_kernels`) when there is no GPU: numbers meaningless, paths run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ops.bench.gpu_check_engine import Sizes, decode_run, placeholder_tokenizer
from runtime.config import ModelConfig
from runtime.loader.checkpoint import Checkpoint


def glm_moe_config(hidden: int, heads: int, kv_heads: int, head_dim: int, dense_inter: int,
                   expert_inter: int, experts: int, top_k: int, layers: int,
                   vocab: int) -> ModelConfig:
    """A GLM-4-MoE (Glm4MoeForCausalLM) config.json's fields -> the engine's config."""
    return ModelConfig.from_hf_config({
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": dense_inter,
        "moe_intermediate_size": expert_inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "n_routed_experts": experts, "num_experts_per_tok": top_k, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "attention_bias": True, "use_qk_norm": False,
        "partial_rotary_factor": 0.5, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "eos_token_id": 2,
        "bos_token_id": 1})


@dataclass(frozen=True)
class MoeSizes:
    decode: Sizes  # the model, concurrencies, prompt and decode steps, KV budget
    prefill_requests: int  # prompts computed in the timed prefill
    prefill_prompt: int  # tokens each
    group_size: int  # INT4 group


FULL = MoeSizes(Sizes(glm_moe_config(4096, 96, 8, 128, 10944, 1408, 64, 8, 6, 20480),
                      (1, 8, 32), 256, 16, 4 << 30), 4, 2048, 32)
TINY = MoeSizes(Sizes(glm_moe_config(64, 4, 2, 16, 96, 32, 8, 2, 2, 512), (1, 2), 12, 2,
                      1 << 20), 2, 24, 32)
FORMATS = ("int4", "fp8-block")  # both phases in each engine


class GlmMoeRandomCheckpoint(Checkpoint):
    """Random bf16 weights of a GLM-4-MoE config under Hugging Face's names, made on `device`
    tensor by tensor, with a placeholder tokenizer. Router weights small and the correction
    bias zero: routing is near uniform."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self.tokenizer = placeholder_tokenizer()
        self.path = Path("device-random-glm-moe")
        self.revision = f"device-random-glm-moe-{config.num_hidden_layers}x{config.hidden_size}"

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        c, dev, hf = self.config, self.device, self.config.hf_config or {}
        g = torch.Generator(device=dev).manual_seed(0)

        def rand(*shape: int, mean: float = 0.0) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16) * 0.02 \
                + mean

        def mlp(prefix: str, inter: int) -> Iterator[tuple[str, torch.Tensor]]:
            yield prefix + "gate_proj.weight", rand(inter, c.hidden_size)
            yield prefix + "up_proj.weight", rand(inter, c.hidden_size)
            yield prefix + "down_proj.weight", rand(c.hidden_size, inter)

        yield "model.embed_tokens.weight", rand(c.vocab_size, c.hidden_size)
        yield "lm_head.weight", rand(c.vocab_size, c.hidden_size)
        yield "model.norm.weight", rand(c.hidden_size, mean=1.0)
        experts, inter = int(hf["n_routed_experts"]), int(hf["moe_intermediate_size"])
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", rand(c.hidden_size, mean=1.0)
            yield p + "post_attention_layernorm.weight", rand(c.hidden_size, mean=1.0)
            for name, rows in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
                yield p + f"self_attn.{name}_proj.weight", rand(rows, c.hidden_size)
                yield p + f"self_attn.{name}_proj.bias", rand(rows)
            yield p + "self_attn.o_proj.weight", rand(c.hidden_size, c.q_size)
            if i < int(hf["first_k_dense_replace"]):
                yield from mlp(p + "mlp.", c.intermediate_size)
                continue
            yield p + "mlp.gate.weight", rand(experts, c.hidden_size)
            yield p + "mlp.gate.e_score_correction_bias", torch.zeros(experts, device=dev)
            for e in range(experts):
                yield from mlp(p + f"mlp.experts.{e}.", inter)
            yield from mlp(p + "mlp.shared_experts.", inter)


def build_engine(sizes: MoeSizes, weights: str, device: torch.device):
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine

    d = sizes.decode
    max_len = max(d.prompt + d.steps, sizes.prefill_prompt) + 16
    config = EngineConfig(device=device.type, dtype="bfloat16", attention_backend="triton",
                          kv_cache_bytes=d.kv_cache_bytes, max_num_seqs=max(d.batches),
                          max_num_batched_tokens=max(8192, sizes.prefill_prompt),
                          max_model_len=max_len, enable_prefix_caching=False,
                          decode_graphs="auto", prefill_weights=weights, decode_weights=weights,
                          weight_group_size=sizes.group_size)
    return LLMEngine(GlmMoeRandomCheckpoint(d.model, device), config)


def warm_up(engine, sizes: MoeSizes) -> str:
    """One request served eagerly (every kernel built), then the decode graphs captured
    (issue 31's order); what happened, in words. A capture that fails leaves the engine
    eager (said so in the table's heading)."""
    from runtime.sampling_params import SamplingParams

    engine.add_request("first", list(range(3, 3 + sizes.decode.prompt)),
                       SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    graphs = engine.runner.graphs
    if graphs is None:
        return "no decode graphs"
    try:
        return f"{graphs.capture()} decode graphs captured"
    except Exception as e:  # reported, and the run goes on eagerly
        engine.runner.graphs = None
        return f"graph capture failed ({type(e).__name__}: {str(e)[:120]}), eager"


def prefill_tok_s(engine, sizes: MoeSizes, tag: str) -> float:
    """Prompt tokens per second of `prefill_requests` random prompts computed together (their
    first token sampled), the steps' wall time; the prompts differ per `tag`."""
    from runtime.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(len(tag))
    vocab = min(sizes.decode.model.vocab_size, 32000)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i in range(sizes.prefill_requests):
        prompt = torch.randint(3, vocab, (sizes.prefill_prompt,), generator=g).tolist()
        engine.add_request(f"prefill-{tag}-{i}", prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return sizes.prefill_requests * sizes.prefill_prompt / (time.perf_counter() - start)


def _weights_on_cpu(cuda: bool) -> contextlib.AbstractContextManager[None]:
    """Off a GPU, the Triton weight kernels as the CPU kernels (the interpreter)."""
    if cuda:
        return contextlib.nullcontext()
    from kernels.triton import cuda_ops

    return cuda_ops.interpreted_weight_kernels()


def main(argv: list[str] | None = None) -> int:
    from ops.bench.gpu_check import check_device

    checked = check_device("gpu_check_moe_engine", __doc__, argv)
    if checked is None:
        return 2
    args, device = checked
    cuda = device.type == "cuda"
    sizes = TINY if args.tiny else FULL
    d, hf = sizes.decode, sizes.decode.model.hf_config or {}
    name = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    print(f"## GPU check, MoE engine: {name}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f"; random GLM-4-MoE ({d.model.num_hidden_layers} layers, hidden {d.model.hidden_size}"
          f", {hf['n_routed_experts']} experts of {hf['moe_intermediate_size']}, top-"
          f"{hf['num_experts_per_tok']} + 1 shared, vocab {d.model.vocab_size}), triton "
          f"backend, bf16 KV, INT4 g{sizes.group_size} vs block-FP8 weights")
    with _weights_on_cpu(cuda):
        engines, notes = {}, []
        for fmt in FORMATS:
            start = time.perf_counter()
            engines[fmt] = build_engine(sizes, fmt, device)
            built = time.perf_counter() - start
            start = time.perf_counter()
            what = warm_up(engines[fmt], sizes)
            notes.append(f"{fmt}: weights {' / '.join(engines[fmt].weight_labels)}, built in "
                         f"{built:.1f} s, first request {time.perf_counter() - start:.1f} s, "
                         f"{what}")
            print(notes[-1])
        a, b = (engines[f] for f in FORMATS)
        print("\n| measure | INT4 | FP8 | INT4 / FP8 | reference INT4 / FP8 |")
        print("|---|---|---|---|---|")
        reference = {1: "1.55x", 8: "1.21x", 32: "1.27x"}
        for batch in d.batches:  # interleaved: one engine, then the other
            ra = decode_run(a, d, batch, graphs=True, tags=True)
            rb = decode_run(b, d, batch, graphs=True, tags=True)
            print(f"| decode tok/s, concurrency {batch} | {ra.tok_s(batch):.0f} | "
                  f"{rb.tok_s(batch):.0f} | {ra.tok_s(batch) / rb.tok_s(batch):.2f}x | "
                  f"{reference.get(batch, '-')} |")
        for engine in (a, b):
            prefill_tok_s(engine, sizes, "warm")  # the prefill-sized kernels built
        pa, pb = prefill_tok_s(a, sizes, "int4"), prefill_tok_s(b, sizes, "fp8")
        print(f"| prefill tok/s, {sizes.prefill_requests} x {sizes.prefill_prompt} tokens | "
              f"{pa:.0f} | {pb:.0f} | {pa / pb:.2f}x | 0.85x (FP8 1.17x INT4) |")
    print("\ntargets (H200): INT4 decode >= 1.5x FP8 at concurrency 1; FP8 prefill >= INT4")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
