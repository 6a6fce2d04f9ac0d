"""`n` candidates, logprobs and min_tokens through the offline engine (the real default model):
seeds per candidate, the prompt's pages shared through the prefix cache, pages back after."""

from __future__ import annotations

import pytest
import torch

from runtime.candidates import child_params
from runtime.errors import InvalidArgument
from runtime.sampler import Sampler
from runtime.sampling_params import MAX_CANDIDATES, SamplingParams

PROMPT = ("Write one sentence about a lighthouse keeper who finds a letter in a bottle, and "
          "say what the letter asks of the keeper.")


def test_candidate_i_is_seeded_with_seed_plus_i_wrapping_at_64_bits():
    params = SamplingParams(n=3, seed=(1 << 64) - 2, temperature=0.8)
    assert [child_params(params, i).seed for i in range(3)] == [(1 << 64) - 2, (1 << 64) - 1, 0]
    assert {child_params(params, i).n for i in range(3)} == {1}
    assert child_params(SamplingParams(n=2), 1).seed is None


@pytest.mark.parametrize("field,value,words", [
    ("n", 0, "[1, 16]"), ("n", MAX_CANDIDATES + 1, "[1, 16]"), ("n", True, "[1, 16]"),
    ("min_tokens", -1, "non-negative"), ("min_tokens", 17, "at most max_tokens"),
    ("logprobs", 21, "[0, 20]")])
def test_bad_candidate_fields_are_typed_errors_naming_the_field(field, value, words):
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(max_tokens=16, **{field: value})
    assert info.value.metadata["field"] == field and words in str(info.value)


def test_min_tokens_masks_eos_and_stop_ids_only_until_reached():
    logits = torch.tensor([[0.0, 9.0, 5.0, 1.0]] * 2)  # token 1 (EOS here) is the argmax
    sampler = Sampler(seed=0, eos_token_ids=(1,))
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])] * 2
    out = sampler(logits, params, [([], [7]), ([], [7, 7])], [None, None])
    assert out.token_ids == [3, 1]  # row 0 is short: EOS and stop id 2 masked; row 1 is not


@pytest.mark.slow
def test_min_tokens_holds_off_stop_ids_and_stop_strings(llm, one_torch_thread):
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = llm.generate(PROMPT, SamplingParams(**greedy))[0].outputs[0]
    stop_id = base.token_ids[1]
    cut = llm.generate(PROMPT, SamplingParams(**greedy, stop_token_ids=[stop_id]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.token_ids == base.token_ids[:2]
    held = llm.generate(PROMPT, SamplingParams(**greedy, stop_token_ids=[stop_id],
                                               min_tokens=4))[0].outputs[0]
    assert stop_id not in held.token_ids[:4] and len(held.token_ids) >= 4
    word = llm.tokenizer.decode(base.token_ids[1:2])
    early = llm.generate(PROMPT, SamplingParams(**greedy, stop=[word]))[0].outputs[0]
    assert early.finish_reason == "stop" and word not in early.text
    late = llm.generate(PROMPT, SamplingParams(**greedy, stop=[word], min_tokens=5))[0]
    assert word in late.outputs[0].text and len(late.outputs[0].token_ids) >= 5


@pytest.mark.slow
def test_n_seeded_candidates_differ_repeat_and_share_the_prompt_pages(llm, engine,
                                                                    one_torch_thread):
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True,
                            logprobs=2)
    chat = llm.tokenizer.encode_chat([{"role": "user", "content": "Invent a name for a cat."}])
    hits_before = engine.stats().num_cached_pages
    [out] = llm.generate(chat, params, tenant="cand-test")
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3, [c.text for c in out.outputs]
    assert all(len(c.token_ids) == 6 and len(c.logprobs or []) == 6 for c in out.outputs)
    # Candidate i is the request seeded with seed + i, alone: the same tokens.
    alone = llm.generate(chat, child_params(params, 2), tenant="cand-alone")[0].outputs[0]
    assert alone.token_ids == out.outputs[2].token_ids
    assert engine.stats().num_cached_pages > hits_before


@pytest.mark.slow
def test_later_candidates_hit_the_prompt_pages_of_the_first(llm, engine, one_torch_thread):
    from runtime.candidates import child_id

    ids = llm.tokenizer.encode(PROMPT + " (cache check)")
    full = len(ids) // engine.pool.page_size * engine.pool.page_size
    seen: dict[str, int] = {}
    original = engine.add_request

    def spy(rid, *args, **kwargs):
        seq = original(rid, *args, **kwargs)
        seen[rid] = seq
        return seq

    engine.add_request = spy  # type: ignore[method-assign]
    try:
        [out] = llm.generate(ids, SamplingParams(n=3, seed=1, max_tokens=3), tenant="cand-hit")
    finally:
        del engine.add_request
    first = next(iter(seen))
    assert first == out.request_id and seen[first].num_cached_tokens == 0
    for i in (1, 2):
        assert seen[child_id(first, i)].num_cached_tokens == full > 0
