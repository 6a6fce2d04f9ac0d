"""The engine end to end on the Triton weight kernels, in Triton's interpreter on CPU: tiny
random Qwen3-MoE, GLM-4-MoE and DeepSeek-V3 checkpoints (tests/runtime/moe_models.py) served
with block-FP8 prefill weights and INT4-g32 decode weights give the greedy tokens of the same
engine on the ops' torch twins. Each phase runs its own kernels: prefill the W8A8 block-FP8
matmul (`fp8_block_linear`) and W8A8 block-FP8 experts (x and the SwiGLU activation quantized
per (row, 128 columns) before each grouped launch), decode the W4A16 matmul over INT4 tiles
(repacked once at load) and INT4 experts, both through the grouped fused-MoE launches.

The switch (`interpreted_weight_kernels`) makes the Triton launchers the ops' CPU kernels while
the engine is built and runs; the reference (`twin_weight_kernels`) registers the twins the
same way, so both runs choose the same layouts and call the same ops. The interpreter is slow:
two prompts, three tokens each (one prefill step, two decode steps).
"""

from __future__ import annotations

from collections import Counter

import pytest

import tests.kernels.triton_pools  # noqa: F401  sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kernels.triton import cuda_ops, launch_gemm, launch_moe
from runtime import LLM, SamplingParams
from runtime.quant.experts import QuantizedExperts
from runtime.quant.linear import Fp8Linear, Int4Linear
from tests.runtime.moe_models import build_tiny_moe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def _serve(path, switch) -> tuple[LLM, list[list[int]]]:
    with switch():
        llm = LLM(model=str(path), kv_cache_bytes=4 << 20, prefill_weights="fp8-block",
                  decode_weights="int4", weight_group_size=32)
        outs = llm.generate(PROMPTS, PARAMS)
    return llm, [o.outputs[0].token_ids for o in outs]


def _counted(launches: Counter, name: str, fn):
    def counted(*args, **kwargs):
        launches[name] += 1
        launches[name + " w8a8"] += bool(kwargs.get("fp8_activations"))
        return fn(*args, **kwargs)
    return counted


def _count_launches(monkeypatch) -> Counter:
    launches: Counter = Counter()
    for module, name in ((launch_gemm, "w4a16_linear"), (launch_gemm, "fp8_block_linear"),
                         (launch_moe, "fused_moe")):
        monkeypatch.setattr(module, name, _counted(launches, name, getattr(module, name)))
    return launches


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "Glm4MoeForCausalLM",
                                          "DeepseekV3ForCausalLM"])
def test_triton_weight_kernels_give_the_twins_tokens_with_fp8_prefill_and_int4_decode(
        architecture, tmp_path, hf_tokenizer, monkeypatch):
    build_tiny_moe(architecture, tmp_path, hf_tokenizer)
    _, want = _serve(tmp_path, cuda_ops.twin_weight_kernels)
    launches = _count_launches(monkeypatch)
    llm, got = _serve(tmp_path, cuda_ops.interpreted_weight_kernels)
    assert got == want
    # each phase ran its kernels: fp8 in the prefill step, int4 in the two decode steps
    assert launches["fp8_block_linear"] > 0 and launches["w4a16_linear"] > 0
    assert launches["fused_moe"] >= 3 * 2  # >= 2 sparse layers a model, one prefill + 2 decodes
    # the prefill step's experts ran W8A8, each sparse layer once; the decode steps' INT4 never
    assert 2 <= launches["fused_moe w8a8"] == launches["fused_moe"] // 3
    engine = llm.engine
    pre, dec = engine.prefill_model, engine.decode_model
    int4 = [m for m in dec.modules() if isinstance(m, Int4Linear)]
    fp8 = [m for m in pre.modules() if isinstance(m, Fp8Linear)]
    assert int4 and all(m.layout == "int4_tiles" for m in int4)
    assert fp8 and all(m.block_kernel for m in fp8)
    kinds = {(m.kind, m.fp8_activations) for m in pre.modules() if isinstance(m, QuantizedExperts)}
    assert kinds == {("fp8-block", True)}
    kinds = {(m.kind, m.fp8_activations) for m in dec.modules() if isinstance(m, QuantizedExperts)}
    assert kinds == {("int4", False)}
