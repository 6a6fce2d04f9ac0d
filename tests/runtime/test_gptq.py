"""GPTQ int4: it lowers the layer-output error that round-to-nearest leaves, on synthetic and on
the real model's calibration activations; its codes keep the packed layout; bad calibration
input is refused by name; a `tessera convert --method gptq` checkpoint loads and serves."""

from __future__ import annotations

import json

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.cli_convert import convert_checkpoint
from runtime.errors import InvalidArgument
from runtime.formats import WeightFormat
from runtime.quant.calibration import calibration_text, calibration_windows, collect_hessians
from runtime.quant.gptq import gptq_int4
from runtime.quant.int4 import dequantize_int4_groupwise
from runtime.quant.linear import Int4Linear, quantize_int4_packed


def _correlated_inputs(tokens: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(tokens, 32, generator=gen) @ torch.randn(32, dim, generator=gen)
    x += 0.3 * torch.randn(tokens, dim, generator=gen)
    x[:, :4] *= 20  # outlier channels, as real activations have
    return x


def _output_error(w: torch.Tensor, w_q: torch.Tensor, hessian: torch.Tensor) -> float:
    """Sum over calibration inputs of ||x (w - w_q)^T||^2 = trace(D H D^T)."""
    d = (w - w_q).double()
    return float(torch.einsum("oi,ij,oj->", d, hessian.double(), d))


def _dequantize(parts: dict[str, torch.Tensor], in_features: int, group_size: int) -> torch.Tensor:
    return Int4Linear(parts["weight_packed"], parts["weight_scale"],
                      parts.get("weight_zero_point"), in_features, group_size).dequantize()


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_is_well_below_round_to_nearest(group_size, symmetric, act_order):
    gen = torch.Generator().manual_seed(group_size)
    x = _correlated_inputs(2048, 256, gen)
    w = torch.randn(96, 256, generator=gen) * 0.05
    hessian = x.T.double() @ x.double()
    rtn = _dequantize(quantize_int4_packed(w, group_size, symmetric), 256, group_size)
    codes, scale, zeros = gptq_int4(w, hessian, group_size, symmetric, act_order=act_order)
    gptq = dequantize_int4_groupwise(codes, scale, zeros)
    assert _output_error(w, gptq, hessian) < 0.5 * _output_error(w, rtn, hessian)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_codes_keep_the_packed_layout_with_a_short_last_group(act_order):
    gen = torch.Generator().manual_seed(1)
    x = _correlated_inputs(512, 576, gen)  # 576 = 4.5 groups of 128
    w = torch.randn(64, 576, generator=gen)
    codes, scale, zeros = gptq_int4(w, x.T @ x, 128, symmetric=False, act_order=act_order)
    assert codes.dtype == torch.uint8 and codes.shape == (64, 576) and int(codes.max()) <= 15
    assert scale.shape == zeros.shape == (64, 5)
    assert zeros.dtype == torch.uint8 and int(zeros.max()) <= 15
    per_column = {"scale": scale.float().repeat_interleave(128, dim=1)[:, :576],
                  "zero": zeros.float().repeat_interleave(128, dim=1)[:, :576]}
    want = (codes.float() - per_column["zero"]) * per_column["scale"]
    parts = quantize_int4_packed(w, 128, False, hessian=x.T @ x, act_order=act_order)
    assert torch.equal(_dequantize(parts, 576, 128), want)


def test_inputs_that_were_always_zero_leave_a_finite_result():
    gen = torch.Generator().manual_seed(2)
    x = _correlated_inputs(256, 128, gen)
    x[:, 7] = 0.0
    x[:, 100:] = 0.0
    codes, scale, _ = gptq_int4(torch.randn(16, 128, generator=gen), x.T @ x, 32)
    assert torch.isfinite(dequantize_int4_groupwise(codes, scale, None)).all()


@pytest.mark.parametrize("hessian, match", [
    (torch.eye(100), r"Hessian \(100, 100\) does not match .* tensor layers\.3\.down"),
    (torch.full((128, 128), float("nan")), r"not finite"),
])
def test_bad_calibration_input_is_refused_naming_the_tensor(hessian, match):
    with pytest.raises(InvalidArgument, match=match) as err:
        gptq_int4(torch.randn(8, 128), hessian, 128, name="layers.3.down")
    assert err.value.reason == "INVALID_ARGUMENT"


def test_calibration_text_is_not_the_text_quality_is_scored_on():
    from pydoc_data.topics import topics

    text = calibration_text()
    assert len(text) > 100_000
    scored = "\n".join(topics.values())
    paragraphs = [p for p in text.split("\n\n") if len(p) > 200]
    assert paragraphs and not any(p in scored for p in paragraphs)


@pytest.mark.slow
def test_gptq_beats_round_to_nearest_on_the_real_models_activations(llm):
    engine = llm.engine
    windows = calibration_windows(engine.tokenizer.encode(calibration_text()), 256, 2)
    hessians = collect_hessians(engine, windows)
    modules = dict(engine.prefill_model.named_modules())
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.15.mlp.down_proj"):
        w = modules[name].weight.detach()
        rtn = _dequantize(quantize_int4_packed(w, 128, True), w.shape[1], 128)
        gptq = _dequantize(quantize_int4_packed(w, 128, True, hessian=hessians[name]),
                           w.shape[1], 128)
        assert _output_error(w, gptq, hessians[name]) < 0.8 * _output_error(
            w, rtn, hessians[name]), name


@pytest.mark.slow
def test_a_gptq_checkpoint_says_so_loads_and_serves(tmp_path):
    with pytest.raises(InvalidArgument, match="fp8 gptq always rounds in act order"):
        convert_checkpoint(None, tmp_path / "fp8", WeightFormat("fp8"), method="gptq",
                           act_order=False)
    with pytest.raises(InvalidArgument, match="act order is a gptq option"):
        convert_checkpoint(None, tmp_path / "rtn", WeightFormat("int4", 128), act_order=True)
    dst = tmp_path / "gptq"
    convert_checkpoint(None, dst, WeightFormat("int4", 128), method="gptq",
                       calibration_windows=2)
    block = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert block["method"] == "gptq" and "2 windows" in block["calibration"]
    assert block["act_order"] is True and block["static_groups"] is True
    served = LLM(model=str(dst), kv_cache_bytes=8 << 20)
    out = served.generate("The capital of France is",
                          SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
