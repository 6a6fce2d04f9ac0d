"""Block-scaled FP8 checkpoints as DeepSeek-V3 and Kimi-K2 ship them (`quant_method: fp8`,
`weight_block_size: [128, 128]`, e4m3 `weight` + float32 `weight_scale_inv` per block): a tiny
Llama written in that layout by this test loads as stored and gives its dequantized twin's
logits; `tessera convert --weights fp8-block` writes the same bytes; bad blocks are refused."""

from __future__ import annotations

import json

import pytest
import torch

from runtime import LLM
from runtime.cli_convert import convert_checkpoint
from runtime.errors import ModelLoadError
from runtime.formats import WeightFormat
from runtime.quant.linear import Fp8Linear

pytestmark = pytest.mark.slow
BLOCK = 128
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Both sides multiply the same float32 weights (e4m3 x scale is exact in float32); only the
# order of float32 sums may differ.
LOGITS_ATOL = 1e-4
PROMPT = [1, 504, 3458, 282, 4649, 314, 3576, 30, 378, 1321, 10425, 253, 1932, 28, 4690, 17]


def deepseek_block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's own recipe, written out here (not tessera's code): pad to 128x128 blocks,
    scale_inv = block amax / 448, e4m3 = w / scale_inv; edge blocks are partial."""
    rows, cols = w.shape
    padded = torch.zeros(-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK)
    padded[:rows, :cols] = w
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    scale_inv = blocks.abs().amax(dim=(1, 3)) / 448.0
    full = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale_inv


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    full = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q.float() * full


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, hf_tokenizer):
    """(block-FP8 dir, dequantized float32 twin dir, original float32 dir)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    # hidden 192 and intermediate 320: partial edge blocks; k/v hold 64 rows, half a block.
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=192, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.05, bos_token_id=1, eos_token_id=2,
        torch_dtype="float32")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).float().eval()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("block", "twin", "source")}
    block, twin = {}, {}
    for name, tensor in state.items():
        if name.rsplit(".", 2)[-2] in PROJ:
            q, scale_inv = deepseek_block_fp8(tensor)
            block[name], block[name + "_scale_inv"] = q, scale_inv
            twin[name] = dequantize(q, scale_inv)
        else:
            block[name] = twin[name] = tensor
    model.save_pretrained(dirs["source"])
    for name, tensors in (("block", block), ("twin", twin)):
        model.config.save_pretrained(dirs[name])
        save_file(tensors, str(dirs[name] / "model.safetensors"))
    cfg = json.loads((dirs["block"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    (dirs["block"] / "config.json").write_text(json.dumps(cfg))
    for path in dirs.values():
        hf_tokenizer.save_pretrained(path)
    return dirs, block


def _llm(path) -> LLM:
    return LLM(model=str(path), kv_cache_bytes=4 << 20, enable_prefix_caching=False)


def test_block_fp8_checkpoint_loads_as_stored_and_matches_its_dequantized_twin(checkpoints):
    dirs, block = checkpoints
    served = _llm(dirs["block"])
    twin = _llm(dirs["twin"])
    assert served.engine.formats.decode.weights == WeightFormat("fp8", block=(BLOCK, BLOCK))
    qkv = served.engine.model.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.block_cols == BLOCK
    stored = torch.cat([block[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.weight.view(torch.uint8), stored.view(torch.uint8))  # not requantized
    got, want = served.prompt_logits(PROMPT), twin.prompt_logits(PROMPT)
    torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0)


def test_convert_writes_the_deepseek_layout_bit_for_bit(checkpoints, tmp_path):
    from safetensors.torch import load_file

    dirs, block = checkpoints
    out = tmp_path / "converted"
    convert_checkpoint(dirs["source"], out, WeightFormat.parse("fp8-block"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3",
                                          "activation_scheme": "dynamic",
                                          "weight_block_size": [BLOCK, BLOCK]}
    written = load_file(str(out / "model.safetensors"))
    names = [n for n in block if n.endswith(("proj.weight", "proj.weight_scale_inv"))]
    assert names and all(n in written for n in names)
    for name in names:
        a, b = written[name], block[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.dtype == torch.float8_e4m3fn:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        else:
            torch.testing.assert_close(a, b, atol=0, rtol=2**-23, msg=name)


@pytest.mark.parametrize("bad", ["scale_shape", "static_activations", "block_size"])
def test_a_bad_block_fp8_checkpoint_is_refused_with_the_tensor_or_field_named(checkpoints,
                                                                            tmp_path, bad):
    from safetensors.torch import save_file

    dirs, block = checkpoints
    tensors = dict(block)
    cfg = json.loads((dirs["block"] / "config.json").read_text())
    if bad == "scale_shape":
        name = "model.layers.0.mlp.down_proj.weight_scale_inv"
        tensors[name] = torch.ones(2, 2)
        match = "down_proj.weight_scale_inv has shape"
    elif bad == "static_activations":
        cfg["quantization_config"]["activation_scheme"] = "static"
        match = "activation_scheme"
    else:
        cfg["quantization_config"]["weight_block_size"] = [128]
        match = "weight_block_size"
    for f in dirs["block"].iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=match):
        _llm(tmp_path)
