"""Hugging Face safetensors directories: a safetensors copy of the default model serves exactly as
the GGUF does, and a tiny random Llama (llama3 RoPE scaling, untied head, attention biases)
matches transformers in logits and greedy tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from runtime import LLM, SamplingParams
from tests.helpers import capture_logits

pytestmark = pytest.mark.slow

# A tiny random model's logits are O(1) and its matmuls short: fp32 agrees to ~1e-6.
TINY_LOGITS_ATOL = 1e-4
PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "你好，世界 🦀",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker "
    "who had never once been late. Every morning he wound each of the forty clocks in his shop, "
    "and every evening he wrote down which of them had drifted, and by how many seconds. One "
    "winter the largest clock, a walnut longcase from Vienna, began to run fast for no reason "
    "he could find, and the whole village came to watch him take it apart.",
]
TEXTS = [
    "Hello, world!", "  spaced\n\tout", "3.14159", "日本語 🐍",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Both sides of each comparison run under the same single-thread setting."""


def save_as_safetensors_dir(model, tokenizer, path) -> None:
    """save_pretrained of a clean copy: transformers refuses to serialize a GGUF-loaded model."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        clone = type(model)(config)
    clone.load_state_dict(model.state_dict(), assign=True, strict=True)
    clone.tie_weights()
    clone.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def default_copy_dir(tmp_path_factory, hf_model, hf_tokenizer):
    path = tmp_path_factory.mktemp("smollm2-safetensors")
    save_as_safetensors_dir(hf_model, hf_tokenizer, path)
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model.safetensors"]
    assert (path / "tokenizer.json").is_file()
    return path


@pytest.fixture(scope="module")
def default_copy(default_copy_dir):
    return LLM(model=str(default_copy_dir), kv_cache_bytes=64 << 20)


def test_default_model_copy_reads_the_same_config(default_copy, llm):
    assert default_copy.engine.model_config == llm.engine.model_config


def test_default_model_copy_loads_bit_identical_weights(default_copy, llm):
    ours = default_copy.engine.model.state_dict()
    reference = llm.engine.model.state_dict()
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name
    model = default_copy.engine.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the checkpoint


def test_default_model_copy_generates_the_same_greedy_tokens(default_copy, llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ours = default_copy.generate(PROMPTS, params)
    reference = llm.generate(PROMPTS, params)
    for a, b in zip(ours, reference, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text


def test_default_model_copy_has_the_same_tokenizer_and_chat_template(default_copy, llm):
    ours, reference = default_copy.tokenizer, llm.tokenizer
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text)
    conversation = [{"role": "user", "content": "Hi!"}]
    assert (ours.apply_chat_template(conversation)
            == reference.apply_chat_template(conversation))
    assert (ours.bos_token, ours.eos_token) == (reference.bos_token, reference.eos_token)


# -- a tiny random Llama with llama3 RoPE scaling -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, hf_tokenizer):
    """A 2-layer random Llama built by transformers, saved with the SmolLM2 tokenizer."""
    transformers = pytest.importorskip("transformers")
    # head_dim 16, rope_theta 1e4, original context 32: RoPE wavelengths fall below, inside and
    # above llama3's [8, 32] smoothing band, so all three branches of the scaling are used.
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).float().eval()
        with torch.no_grad():  # init leaves norms at 1 and biases at 0: make them matter
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
                elif name.endswith(".bias"):
                    param.copy_(0.1 * torch.randn_like(param))
    path = tmp_path_factory.mktemp("tiny-llama3")
    model.save_pretrained(path)
    hf_tokenizer.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def tiny(tiny_hf):
    # A 32-token step budget: the longer prompts are prefilled in several chunks.
    return LLM(model=str(tiny_hf[1]), kv_cache_bytes=8 << 20, max_num_batched_tokens=32)


def test_tiny_model_config_is_read_from_config_json(tiny):
    cfg = tiny.engine.model_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (64, 2, 4, 2, 16)
    assert not cfg.tie_word_embeddings and cfg.attention_bias
    assert cfg.rope_theta == 10000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    model = tiny.engine.model
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tiny_model_logits_match_transformers_at_prefill_and_decode(tiny, tiny_hf,
                                                                    monkeypatch):
    hf_model, _ = tiny_hf
    engine = tiny.engine
    captured = capture_logits(engine, monkeypatch)
    num_tokens = 12
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"tiny-{i}", prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert max(len(o.prompt_token_ids) for o in outs.values()) > 2 * 32  # chunked prefill

    for i in range(len(PROMPTS)):
        out = outs[f"tiny-{i}"]
        prompt, generated = out.prompt_token_ids, out.outputs[0].token_ids
        ours = torch.stack(captured[f"tiny-{i}"])
        assert ours.shape[0] == num_tokens
        with torch.inference_mode():
            ref = hf_model(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:]
        diff = (ours - ref).abs().max(dim=-1).values
        assert diff.max() < TINY_LOGITS_ATOL, f"prompt {i}: max |diff| per step {diff.tolist()}"
        assert ref.abs().max() > 0.5  # logits far from zero: the tolerance is meaningful


def test_tiny_model_greedy_tokens_match_transformers(tiny, tiny_hf):
    hf_model, _ = tiny_hf
    num_tokens = 32
    outs = tiny.generate(PROMPTS, SamplingParams(max_tokens=num_tokens, temperature=0,
                                                 ignore_eos=True))
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=num_tokens, eos_token_id=None)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()
