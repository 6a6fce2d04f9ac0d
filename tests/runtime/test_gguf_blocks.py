"""GGUF Q4_0 / Q4_1 / Q8_0 blocks imported as stored: bit for bit what `gguf`'s own dequantizer
gives, for each block type (quantized by `gguf`, random bytes, and the default model's file,
q/k rows put back in Hugging Face order), and the block modules equal their dequantized twins."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants

from runtime.errors import ModelLoadError
from runtime.quant.blocks import (
    GGUF_BLOCK_TYPES,
    BlockEmbedding,
    BlockLinear,
    cat_planes,
    import_gguf_blocks,
)

TYPES = sorted(GGUF_BLOCK_TYPES)


def gguf_dequantized(raw: np.ndarray, type_name: str) -> torch.Tensor:
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    return torch.from_numpy(np.asarray(quants.dequantize(raw, qtype), dtype=np.float32).copy())


def random_blocks(rows: int, blocks: int, type_name: str, seed: int) -> np.ndarray:
    """Random block bytes with finite fp16 scales (any sign and size, subnormals included)."""
    size = GGUF_BLOCK_TYPES[type_name][0]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    scales = 4 if type_name == "Q4_1" else 2
    halves = rng.standard_normal((rows, blocks, scales // 2)).astype(np.float16)
    halves[0, 0, 0] = np.float16(6e-8)  # a subnormal scale
    raw[:, :, :scales] = halves.view(np.uint8).reshape(rows, blocks, scales)
    return raw.reshape(rows, blocks * size)


@pytest.mark.parametrize("type_name", TYPES)
def test_import_is_bit_exact_against_gguf_on_its_own_quantization(type_name):
    w = np.random.default_rng(0).standard_normal((33, 576)).astype(np.float32) * 0.05
    raw = quants.quantize(w, getattr(gguf.GGMLQuantizationType, type_name))
    planes = import_gguf_blocks(raw, type_name)
    assert (planes.out_features, planes.in_features) == (33, 576)
    assert torch.equal(planes.dequantize(), gguf_dequantized(raw, type_name))


@pytest.mark.parametrize("type_name", TYPES)
def test_import_is_bit_exact_against_gguf_on_random_block_bytes(type_name):
    raw = random_blocks(17, 7, type_name, seed=1)
    ours, ref = import_gguf_blocks(raw, type_name).dequantize(), gguf_dequantized(raw, type_name)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("type_name", TYPES)
def test_block_linear_equals_linear_over_the_gguf_dequantized_weight(type_name, one_torch_thread):
    raw = random_blocks(70, 18, type_name, seed=2)
    weight = gguf_dequantized(raw, type_name)
    layer = BlockLinear(import_gguf_blocks(raw, type_name))
    assert torch.equal(layer.dequantize(), weight)
    for rows in (1, 7, BlockLinear.kernel_max_rows, BlockLinear.kernel_max_rows + 1):
        x = torch.randn(rows, 576)
        ref = F.linear(x, weight)
        assert ((layer(x) - ref).abs() <= (x.abs() @ weight.abs().t()) * 2e-5 + 1e-6).all()


def test_block_embedding_rows_are_the_dequantized_table_rows():
    raw = random_blocks(50, 3, "Q8_0", seed=3)
    table = gguf_dequantized(raw, "Q8_0")
    ids = torch.tensor([[0, 49, 7], [7, 3, 3]])
    assert torch.equal(BlockEmbedding(import_gguf_blocks(raw, "Q8_0"))(ids), table[ids])


def test_fusing_shards_stacks_their_rows():
    a, b = (import_gguf_blocks(random_blocks(n, 2, "Q4_1", seed=n), "Q4_1") for n in (3, 5))
    fused = cat_planes([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError):
        cat_planes([a, import_gguf_blocks(random_blocks(3, 2, "Q8_0", seed=9), "Q8_0")])


def test_bytes_that_are_not_whole_blocks_or_other_types_are_refused_by_name():
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q"):
        import_gguf_blocks(np.zeros((2, 19), np.uint8), "Q4_0", "blk.0.attn_q")
    with pytest.raises(ModelLoadError, match="Q5_K"):
        import_gguf_blocks(np.zeros((2, 176), np.uint8), "Q5_K", "blk.0.attn_q")


@pytest.mark.slow
def test_every_block_tensor_of_the_default_model_imports_bit_exactly(default_model_path):
    from runtime.loader import open_checkpoint
    from runtime.loader.gguf_loader import _hf_name

    ckpt = open_checkpoint(default_model_path)
    wanted = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"}
    every = {_hf_name(t.name) for t in ckpt.reader.tensors}  # type: ignore[attr-defined]
    dense = dict(ckpt.tensors(skip=frozenset(every - wanted)))  # type: ignore[call-arg]
    kinds = set()
    for name, planes in ckpt.block_tensors():
        kinds.add(planes.kind)
        if name in wanted:  # the dequantizing loader's own output, q/k unpermuted
            assert torch.equal(planes.dequantize(), dense[name]), name
    assert kinds == {"q4", "q8"} and wanted <= set(dense)


@pytest.mark.parametrize("type_name", TYPES)
def test_bf16_activations_round_only_past_their_row_threshold(type_name, one_torch_thread):
    raw = random_blocks(70, 18, type_name, seed=4)
    weight = gguf_dequantized(raw, type_name)
    exact = BlockLinear(import_gguf_blocks(raw, type_name))
    layer = BlockLinear(import_gguf_blocks(raw, type_name), activations="bf16")
    few = torch.randn(BlockLinear.bf16_min_rows, 576)
    assert torch.equal(layer(few), exact(few))  # decode-sized: the float32 kernel, unchanged
    many = torch.randn(BlockLinear.bf16_min_rows + 1, 576)
    bf16 = F.linear(many.bfloat16().float(), weight.bfloat16().float())
    bound = (many.abs() @ weight.abs().t()) * 1e-5 + 1e-6
    assert ((layer(many) - bf16).abs() <= bound).all()
    assert not torch.equal(layer(many), exact(many))


def test_bf16_weight_copy_is_made_by_a_many_row_call_and_dropped_by_release(one_torch_thread):
    raw = random_blocks(70, 18, "Q4_1", seed=5)
    layer = BlockLinear(import_gguf_blocks(raw, "Q4_1"), activations="bf16")
    layer(torch.randn(BlockLinear.bf16_min_rows, 576))
    assert layer.bf16_weight is None  # decode-sized calls never make it
    x = torch.randn(40, 576)
    first = layer(x)
    assert layer.bf16_weight is not None and layer.bf16_weight.dtype == torch.bfloat16
    layer.release_cache()
    assert layer.bf16_weight is None
    assert torch.equal(layer(x), first)  # rebuilt the same


@pytest.mark.parametrize("type_name", TYPES)
def test_int8x2_block_linear_gives_a_row_the_same_bits_at_any_row_count(type_name,
                                                                         one_torch_thread):
    # batch invariance (docs/DESIGN.md): no kernel switch by row count on the default path
    from kernels.qgemv_i8 import int8_kernels_available

    if not int8_kernels_available():
        pytest.skip("no AVX-512 VNNI on this CPU: float32 activations are the default here")
    layer = BlockLinear(import_gguf_blocks(random_blocks(70, 18, type_name, seed=5), type_name),
                        activations="int8x2")
    x = torch.randn(300, 576)
    everything = layer(x)
    for rows in (1, 16, 17, 64, 300):
        assert torch.equal(layer(x[:rows]), everything[:rows]), rows
