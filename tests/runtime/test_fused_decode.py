"""The fused step (every layer of a step in one C++ call, `kernels.decode_llama`) against its
twin, the model's Python layers: the same step's logits and KV pages, per KV format and
activation kind, for an all-decode step and for a mixed one (decodes beside a later chunk of a
chunked prompt); it is taken where it applies and not where it does not."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_llama import fused_decode_available
from kernels.qgemv_i8 import int8_kernels_available
from runtime import LLM
from runtime.models.llama import LlamaModel
from runtime.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not fused_decode_available(),
                       reason="the C++ CPU ops are not built here (no toolchain)"),
]

PROMPTS = ["The capital of France is", "Hello, my name is",
           "Once upon a time, in a village at the edge of a great forest, there lived"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Both paths under one thread: the same summation order in every threaded kernel."""


def _decode_step(llm: LLM):
    """Admits PROMPTS, runs their prefills, and returns the next (all-decode) batch,
    scheduled but not yet run."""
    engine = llm.engine
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"fused-{i}", prompt, params)
    for _ in range(8):  # prefills, then two decode steps (pages written by both paths before)
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch.scheduled and all(s.num_tokens == 1 for s in batch.scheduled)
    return batch


def _model(llm: LLM) -> LlamaModel:
    return llm.engine.runner.decode_model.model


def _built(llm: LLM):
    """The cpu attention backend's fused step for the decode model: (k pages, smoothing, the
    step or None where it does not apply), or None before an all-decode step ran."""
    return llm.engine.runner.backend.fused.built.get(_model(llm))


def _pages(llm: LLM) -> list[torch.Tensor]:
    cache = llm.engine.kv_cache
    return [t.clone() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]


def _mixed_step(llm: LLM):
    """PROMPTS decoding, then a long prompt whose prefill the 64-token budget cuts into chunks:
    the batch with its second chunk beside the three decodes, scheduled but not yet run."""
    engine = llm.engine
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"fused-{i}", prompt, params)
    for _ in range(4):
        engine.step()
    engine.add_request("fused-long", " ".join(f"word{i}" for i in range(60)), params)
    engine.step()  # its first chunk, beside the decodes
    batch = engine.scheduler.schedule()
    chunks = [s for s in batch.scheduled if s.num_tokens > 1]
    assert len(chunks) == 1 and chunks[0].seq.num_computed_tokens > 0
    assert sum(s.num_tokens == 1 for s in batch.scheduled) == len(PROMPTS)
    return batch


@pytest.mark.parametrize(("kv_dtype", "activations"), [
    ("float32", "float32"), ("bfloat16", "float32"), ("fp8", "float32"), ("int8", "float32"),
    ("auto", "int8"), ("auto", "int8x2"),
])
@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_fused_step_equals_the_python_layers(kv_dtype: str, activations: str, step: str) -> None:
    if activations.startswith("int8") and not int8_kernels_available():
        pytest.skip("no AVX-512 VNNI on this CPU: the int8-activation kernels are not built")
    llm = LLM(kv_cache_bytes=32 << 20, max_num_seqs=4, enable_prefix_caching=False,
              kv_cache_dtype=kv_dtype, gguf_activations=activations, max_num_batched_tokens=64)
    model = _model(llm)
    batch = _decode_step(llm) if step == "decode" else _mixed_step(llm)
    before = _pages(llm)
    assert _built(llm) is not None and _built(llm)[2] is not None, "the fused step is built"
    _built(llm)[2].set_profiling("cpu")
    _, fused = llm.engine.runner.execute(batch)
    assert _built(llm)[2].phase_ms()["attention"] > 0, "the fused step ran this step"
    _built(llm)[2].set_profiling(None)
    fused_pages = _pages(llm)
    model.fused_decode = False  # the instance only: the twin, the Python layers
    try:
        _, python = llm.engine.runner.execute(batch)
    finally:
        del model.fused_decode
    python_pages = _pages(llm)
    assert torch.isfinite(fused).all() and fused.shape == python.shape
    # The same kernels and aten ops in the same order: bit for bit (measured: equal).
    assert torch.equal(fused, python)
    changed = [not torch.equal(a, b) for a, b in zip(before, fused_pages, strict=True)]
    assert any(changed), "the fused step wrote this step's K/V into the pages"
    for a, b in zip(fused_pages, python_pages, strict=True):
        assert torch.equal(a, b)

def test_greedy_tokens_equal_with_the_fused_step_off() -> None:
    llm = LLM(kv_cache_bytes=32 << 20, max_num_seqs=4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    fused = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    model = _model(llm)
    assert _built(llm) is not None and _built(llm)[2] is not None
    model.fused_decode = False
    try:
        python = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        del model.fused_decode
    assert fused == python


def test_dequantized_weights_take_the_python_layers(llm) -> None:
    """Dense fp32 weights (the transformers-parity model) are not block planes: no fused step."""
    llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0))
    built = _built(llm)
    assert built is not None and built[2] is None


def test_bf16_activations_fuse_only_up_to_their_float32_rows() -> None:
    from runtime.attention.fused_decode import max_fused_rows
    from runtime.quant.blocks import BlockLinear

    llm = LLM(kv_cache_bytes=32 << 20, max_num_seqs=4, gguf_activations="bf16")
    assert max_fused_rows(_model(llm)) == BlockLinear.bf16_min_rows
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))
    assert _built(llm)[2] is not None


def test_the_fused_step_accounts_for_its_phases_when_asked() -> None:
    from kernels.decode_llama import PHASES

    llm = LLM(kv_cache_bytes=32 << 20, max_num_seqs=4, enable_prefix_caching=False)
    llm.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0))
    step = _built(llm)[2]
    assert step is not None
    assert set(step.phase_ms().values()) == {0.0}, "off by default: nothing counted"
    step.set_profiling("cpu")
    batch = _decode_step(llm)
    llm.engine.runner.execute(batch)
    spent = step.phase_ms()
    assert list(spent) == list(PHASES)
    assert all(ms >= 0 for ms in spent.values()) and spent["attention"] > 0
    step.set_profiling(None)
    assert set(step.phase_ms().values()) == {0.0}
    with pytest.raises(ValueError, match="clock"):
        step.set_profiling("sometimes")
