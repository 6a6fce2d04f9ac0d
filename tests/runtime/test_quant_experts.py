"""Routed experts in a serving format (runtime/quant/experts.py) and MoE models converted per
phase (runtime/quant/convert.py): block-FP8 / per-channel FP8 / INT4 experts dequantize to
within their format's rounding of the float experts, their forward is the per-expert loop over
those dequantized weights, shapes a format cannot hold are refused by name, and a converted
MoE model shares everything with its source but the projections and experts."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import ref_fused_moe
from runtime.errors import InvalidArgument
from runtime.formats import WeightFormat
from runtime.models.moe import FusedExperts
from runtime.quant.convert import convert_model
from runtime.quant.experts import QuantizedExperts

E, HIDDEN, INTER = 4, 64, 32
FORMATS = {"fp8-block": WeightFormat.parse("fp8-block"), "fp8": WeightFormat("fp8"),
           "int4-g32": WeightFormat("int4", 32), "int4-g32-asym": WeightFormat("int4", 32, False)}


def _float_experts(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(E, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5,
            torch.randn(E, HIDDEN, INTER, generator=gen) * INTER**-0.5)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantized_experts_dequantize_within_the_format_and_forward_is_the_loop(name):
    gen = torch.Generator().manual_seed(0)
    w13, w2 = _float_experts(gen)
    experts = QuantizedExperts.from_float(w13, w2, FORMATS[name])
    step = 2**-3 if name.startswith("fp8") else 1 / 7  # e4m3 / int4 relative step, roughly
    for e in range(E):
        for got, want in zip(experts.dequantize(e), (w13[e], w2[e]), strict=True):
            assert (got - want).abs().max() <= step * want.abs().max()
    x = torch.randn(5, HIDDEN, generator=gen)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [1, 0]])  # expert 3 receives nothing
    weights = torch.rand(5, 2, generator=gen)
    dense = [torch.stack([experts.dequantize(e)[i] for e in range(E)]) for i in (0, 1)]
    torch.testing.assert_close(experts(x, weights, ids),
                               ref_fused_moe(x, *dense, weights, ids), atol=1e-5, rtol=1e-5)


def test_int4_experts_whose_group_does_not_divide_the_input_are_refused_by_name():
    w13, w2 = _float_experts(torch.Generator().manual_seed(1))
    with pytest.raises(InvalidArgument, match=r"layers\.1\.mlp\.experts\.w2"):
        QuantizedExperts.from_float(w13, w2, WeightFormat("int4", 64), "layers.1.mlp.experts")


def test_fp8_experts_need_128_column_scale_blocks():
    w13, w2 = _float_experts(torch.Generator().manual_seed(2))
    with pytest.raises(InvalidArgument, match="128-column"):
        QuantizedExperts.from_float(w13, w2, WeightFormat("fp8", block=(128, 64)))


def test_a_converted_moe_model_shares_all_but_its_projections_and_experts(tmp_path,
                                                                          hf_tokenizer):
    pytest.importorskip("transformers")
    from runtime.loader import open_checkpoint
    from runtime.models import model_class
    from runtime.models.meta_init import meta_without_init
    from tests.runtime.moe_models import build_tiny_moe

    build_tiny_moe("Qwen3MoeForCausalLM", tmp_path, hf_tokenizer)
    ckpt = open_checkpoint(tmp_path)
    with meta_without_init():
        model = model_class(ckpt.config)(ckpt.config)
    model.load_weights(ckpt.tensors(), torch.float32)
    got = convert_model(model, FORMATS["int4-g32"])
    sources = {n: m for n, m in model.named_modules() if isinstance(m, FusedExperts)}
    assert sources and all(isinstance(got.get_submodule(n), QuantizedExperts) for n in sources)
    assert all(isinstance(m, FusedExperts) for m in sources.values())  # the source is intact
    layer = next(iter(sources)).rsplit(".", 1)[0]
    assert got.get_submodule(layer).gate.weight is model.get_submodule(layer).gate.weight
    assert got.model.embed_tokens.weight is model.model.embed_tokens.weight
