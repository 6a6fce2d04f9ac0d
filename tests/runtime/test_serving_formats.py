"""Per-phase serving formats: "auto" resolution, and refusal of combinations that buy nothing."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.config import EngineConfig
from runtime.errors import InvalidArgument
from runtime.formats import KVFormat, WeightFormat
from runtime.kv.cache import KVCacheSpec
from runtime.serving_formats import ServingFormats


def test_auto_resolves_to_the_compute_dtype_for_both_phases():
    f = ServingFormats.resolve("float32")
    assert f.prefill.weights.name == f.decode.weights.name == "fp32"
    assert f.kv.name == "fp32" and f.shares_weights


def test_the_reference_split_resolves_and_stores_kv_in_the_decode_format():
    f = ServingFormats.resolve("bfloat16", prefill_weights="fp8", decode_weights="int4",
                               kv_cache_dtype="fp8", prefill_kv_cache_dtype="bf16",
                               group_size=64)
    assert f.prefill.weights == WeightFormat("fp8")
    assert f.decode.weights == WeightFormat("int4", 64, True)
    assert f.prefill.kv.name == "bf16" and f.kv.name == "fp8"
    assert not f.shares_weights
    assert f.describe()["decode"] == {"weights": "int4-g64", "kv_cache_dtype": "fp8"}


def test_group_size_does_not_split_identical_dense_formats():
    f = ServingFormats.resolve("float32", prefill_weights="fp32", decode_weights="float32",
                               group_size=32)
    assert f.shares_weights


@pytest.mark.parametrize("kwargs,field", [
    ({"prefill_weights": "int4", "decode_weights": "bf16"}, "prefill_weights"),
    ({"prefill_weights": "fp8", "decode_weights": "bf16"}, "prefill_weights"),
    ({"prefill_kv_cache_dtype": "fp8", "kv_cache_dtype": "bf16"}, "prefill_kv_cache_dtype"),
    ({"prefill_kv_cache_dtype": "int8", "kv_cache_dtype": "bf16"}, "prefill_kv_cache_dtype"),
    ({"prefill_kv_cache_dtype": "fp8", "kv_cache_dtype": "int8"}, "prefill_kv_cache_dtype"),
    ({"prefill_kv_cache_dtype": "int8", "kv_cache_dtype": "fp8"}, "prefill_kv_cache_dtype"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ({"decode_weights": "int3"}, "weights"),
    ({"decode_weights": "int4", "group_size": 48}, "int4_group_size"),
])
def test_senseless_combinations_are_refused_with_the_reason(kwargs, field):
    with pytest.raises(InvalidArgument) as e:
        ServingFormats.resolve("bfloat16", **kwargs)
    assert e.value.metadata["field"] == field
    assert len(e.value.message) > 30


@pytest.mark.parametrize("prefill_kv", ["auto", "int8", "bf16", "fp32"])
def test_int8_kv_is_a_decode_format_that_any_wider_prefill_kv_feeds(prefill_kv):
    f = ServingFormats.resolve("float32", kv_cache_dtype="int8",
                               prefill_kv_cache_dtype=prefill_kv)
    assert f.kv == KVFormat("int8") and f.kv.quantized
    assert f.prefill.kv.name == ("int8" if prefill_kv == "auto" else prefill_kv)
    assert f.describe()["decode"]["kv_cache_dtype"] == "int8"


def test_dense_weights_other_than_the_compute_dtype_are_refused():
    with pytest.raises(InvalidArgument, match="compute dtype") as e:
        ServingFormats.resolve("float32", decode_weights="bf16")
    assert e.value.metadata["field"] == "decode_weights"


def test_a_quantized_checkpoint_is_served_as_stored():
    stored = WeightFormat("int4", 128, True)
    f = ServingFormats.resolve("float32", checkpoint_format=stored)
    assert f.prefill.weights == f.decode.weights == stored
    with pytest.raises(InvalidArgument, match="served as stored"):
        ServingFormats.resolve("float32", prefill_weights="fp8", checkpoint_format=stored)


def test_serving_config_file(tmp_path):
    path = tmp_path / "serving.json"
    path.write_text(json.dumps({"prefill": {"weights": "fp8", "kv_cache_dtype": "bf16"},
                                "decode": {"weights": "int4", "kv_cache_dtype": "fp8"},
                                "group_size": 128}))
    f = ServingFormats.from_file(path, "bfloat16")
    assert f.decode.weights.label == "int4-g128" and f.kv.name == "fp8"
    path.write_text(json.dumps({"decode": {"weight": "int4"}}))
    with pytest.raises(InvalidArgument, match="takes only"):
        ServingFormats.from_file(path, "bfloat16")
    with pytest.raises(InvalidArgument, match="cannot read"):
        ServingFormats.from_file(tmp_path / "missing.json", "bfloat16")


def test_engine_config_rejects_unknown_format_names_before_loading_anything():
    with pytest.raises(InvalidArgument):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(InvalidArgument):
        EngineConfig(decode_weights="int4", weight_group_size=100)


def test_quantized_pages_hold_at_least_1_9x_the_tokens_of_bf16_in_the_same_bytes(
        default_model_path):
    from runtime.loader import open_checkpoint

    config = open_checkpoint(default_model_path).config
    budget = 256 << 20
    tokens = {fmt: KVCacheSpec.for_model(config, 16, KVFormat(fmt)).pages_in(budget) * 16
              for fmt in ("bf16", "fp8", "int8")}
    assert tokens["fp8"] / tokens["bf16"] >= 1.9, tokens
    assert tokens["int8"] == tokens["fp8"], tokens  # the same bytes per token


def test_int8_pages_are_int8_with_a_bf16_scale_per_token_and_head_rotated_like_fp8():
    from runtime.kv.cache import KVCache

    fp8, int8 = (KVCacheSpec(2, 3, 64, 16, KVFormat(f)) for f in ("fp8", "int8"))
    assert int8.storage_dtype == int8.dtype == torch.int8 and fp8.storage_dtype == torch.uint8
    assert int8.quantized and not int8.is_fp8 and int8.hadamard == fp8.hadamard is True
    assert int8.bytes_per_token == fp8.bytes_per_token == 2 * 2 * 3 * (64 + 2)
    assert not KVCacheSpec(2, 3, 48, 16, KVFormat("int8")).hadamard  # not a power of two
    cache = KVCache(int8, 4, "cpu")
    assert cache.k.dtype == torch.int8 and cache.k_scale.dtype == torch.bfloat16
    assert cache.k_scale.shape == cache.k.shape[:-1] and cache.num_bytes == 4 * int8.bytes_per_page
    assert cache.layer(1).hadamard
