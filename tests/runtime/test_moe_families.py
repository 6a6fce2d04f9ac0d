"""Mixture-of-experts families served from safetensors: for Mixtral, Qwen3-MoE, GLM-4-MoE and
DeepSeek-V3 (MLA), a tiny random checkpoint made by transformers gives the same greedy tokens as
transformers and logits within TINY_LOGITS_ATOL, through the paged engine, in a continuous batch
with chunked prefill and a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch

from runtime import LLM, SamplingParams
from tests.helpers import capture_logits
from tests.runtime.moe_models import CONFIGS, build_tiny_moe

pytestmark = pytest.mark.slow

# fp32 on both sides, O(1) logits, short matmuls: agreement to ~1e-6 is expected; routing is
# discrete, so a wrong expert choice would show as an O(1) difference, far past this.
TINY_LOGITS_ATOL = 1e-4
STEP_TOKENS = 32  # the engine's token budget per step: longer prompts prefill in chunks
NEW_TOKENS = 10
STORY = ("Once upon a time, in a village at the edge of a great forest, there lived an old "
         "clockmaker who had never once been late. Every morning he wound each of the forty "
         "clocks in his shop, and every evening he wrote down which of them had drifted.")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Both sides of each comparison run under the same single-thread setting."""


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory, hf_tokenizer):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp(request.param)
    hf_model = build_tiny_moe(request.param, path, hf_tokenizer)
    llm = LLM(model=str(path), kv_cache_bytes=4 << 20, max_num_batched_tokens=STEP_TOKENS)
    return request.param, hf_model, llm


def test_family_is_served_by_its_own_model_class(family):
    architecture, _, llm = family
    assert type(llm.engine.model).__name__ == architecture
    assert llm.engine.model_config.architecture == architecture


def test_continuous_batch_matches_transformers(family, monkeypatch):
    _, hf_model, llm = family
    engine = llm.engine
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    # A first request leaves the story's pages in the prefix cache ...
    engine.add_request("warm", STORY, params)
    while engine.has_unfinished_requests():
        engine.step()
    # ... then three run together: one reuses them, one prefills in several chunks while the
    # others decode, one is short.
    prompts = {"hit": STORY + " One winter the largest clock began to run fast.",
               "long": "def add(a, b):\n    return a + b\n\n" * 6,
               "short": "The capital of France is"}
    captured = capture_logits(engine, monkeypatch)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["hit"].num_cached_tokens >= 2 * engine.pool.page_size
    assert len(outs["long"].prompt_token_ids) > STEP_TOKENS
    engine.check_quiescent()

    for rid, out in outs.items():
        prompt, generated = out.prompt_token_ids, out.outputs[0].token_ids
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref_tokens = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                           do_sample=False, max_new_tokens=NEW_TOKENS,
                                           eos_token_id=None)[0, len(prompt):].tolist()
            ref = hf_model(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:]
        assert generated == ref_tokens, rid
        ours = torch.stack(captured[rid])
        diff = (ours - ref).abs().max(dim=-1).values
        assert diff.max() < TINY_LOGITS_ATOL, f"{rid}: max |diff| per step {diff.tolist()}"
        assert ref.abs().max() > 0.5  # logits far from zero: the tolerance is meaningful
