"""ModelConfig and config.json: what the engine writes (converted checkpoints, the planner's
view) reads back to the same config."""

from __future__ import annotations

import json

import pytest

from runtime.config import ModelConfig


@pytest.mark.parametrize("eos_token_ids", [(), (2,), (2, 7)])
@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0}])
def test_model_config_round_trips_through_config_json(eos_token_ids, rope_scaling):
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=320, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=512,
        tie_word_embeddings=False, rope_scaling=rope_scaling, bos_token_id=1,
        eos_token_ids=eos_token_ids, attention_bias=True)
    text = json.dumps(config.to_hf_config())
    assert ModelConfig.from_hf_config(json.loads(text)) == config
