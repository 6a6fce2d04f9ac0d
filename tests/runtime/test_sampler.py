"""The sampler on synthetic logits (greedy, temperature, filters, penalties, logprobs, seeds),
plus one end-to-end check that a seeded request samples the same tokens alone and in a batch."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.sampler import Sampler, SamplerOutput, _apply_penalties
from runtime.sampling_params import SamplingParams

NO_HISTORY: tuple[list[int], list[int]] = ([], [])
# Upper 0.1% quantiles of chi-square with 1..9 degrees of freedom: a fixed-seed test with a
# bound this loose fails only when the sampled distribution is really wrong.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
            9: 27.88}


def sample(logits: torch.Tensor, params: list[SamplingParams],
           histories: list[tuple[list[int], list[int]]] | None = None,
           generators: list[torch.Generator | None] | None = None,
           sampler: Sampler | None = None) -> SamplerOutput:
    rows = len(params)
    return (sampler or Sampler(seed=0))(logits, params, histories or [NO_HISTORY] * rows,
                                        generators or [None] * rows)


def draw_counts(logits_row: list[float], params: SamplingParams, n: int,
                seed: int = 0) -> torch.Tensor:
    """How often each token is drawn in n independent rows of the same logits."""
    logits = torch.tensor([logits_row]).repeat(n, 1)
    out = sample(logits, [params] * n, sampler=Sampler(seed=seed))
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(logits_row))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def drawn_set(logits_row: list[float], params: SamplingParams, n: int = 3000) -> set[int]:
    counts = draw_counts(logits_row, params, n)
    return set(torch.nonzero(counts).flatten().tolist())


def log_probs(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


# -- greedy and temperature ----------------------------------------------------------------


def test_greedy_rows_take_the_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000) * 3
    out = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_rows_stay_argmax_next_to_random_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, 500)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)]
    out = sample(logits, params)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_a_tiny_positive_temperature_behaves_like_greedy():
    # A temperature that underflows float32 must not turn the logits into inf/nan.
    logits = torch.tensor([[1.0, 5.0, 2.0, 0.5], [3.0, -1.0, 7.0, 6.9]])
    for temperature in (1e-6, 1e-30, 1e-300):
        out = sample(logits, [SamplingParams(temperature=temperature)] * 2)
        assert out.token_ids == [1, 2], temperature


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draws_follow_the_softmax_of_scaled_logits(temperature):
    logits = [0.0, 1.0, 2.0, 0.5, -1.0]
    counts = draw_counts(logits, SamplingParams(temperature=temperature), 20_000)
    probs = torch.softmax(torch.tensor(logits) / temperature, dim=-1)
    assert chi_square(counts, probs) < CHI2_999[len(logits) - 1]
    # The same draws are far from the distribution at another temperature.
    other = torch.softmax(torch.tensor(logits) / (temperature * 2), dim=-1)
    assert chi_square(counts, other) > 10 * CHI2_999[len(logits) - 1]


# -- filters --------------------------------------------------------------------------------


def test_top_k_keeps_only_the_k_most_likely_tokens():
    logits = [0.3, 1.0, 0.1, 0.9, 0.8, 0.0, 0.2, 0.5]
    assert drawn_set(logits, SamplingParams(top_k=3)) == {1, 3, 4}
    assert drawn_set(logits, SamplingParams(top_k=1)) == {1}
    assert drawn_set(logits, SamplingParams(top_k=-1)) == set(range(len(logits)))


def test_top_k_renormalises_over_the_kept_tokens():
    logits = [0.3, 1.0, 0.1, 0.9, 0.8]
    counts = draw_counts(logits, SamplingParams(top_k=3), 20_000)
    kept = torch.tensor([1, 3, 4])
    probs = torch.softmax(torch.tensor(logits)[kept], dim=-1)
    assert counts.sum() == counts[kept].sum()
    assert chi_square(counts[kept], probs) < CHI2_999[2]


@pytest.mark.parametrize(("top_p", "kept"), [
    (0.4, {0}),            # 0.5 alone reaches 0.4
    (0.75, {0, 1}),        # 0.5 + 0.3 = 0.8 is the smallest prefix reaching 0.75
    (0.85, {0, 1, 2}),     # 0.95 reaches 0.85
    (0.99, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    logits = log_probs([0.5, 0.3, 0.15, 0.05])
    assert drawn_set(logits, SamplingParams(top_p=top_p)) == kept


def test_top_p_ranks_tokens_by_probability_not_by_id():
    logits = log_probs([0.05, 0.15, 0.3, 0.5])
    assert drawn_set(logits, SamplingParams(top_p=0.75)) == {2, 3}


@pytest.mark.parametrize(("min_p", "kept"), [
    (0.0, {0, 1, 2, 3}),
    (0.2, {0, 1, 2}),      # threshold 0.1 drops only the 0.05 token
    (0.5, {0, 1}),         # threshold 0.25
    (1.0, {0}),
])
def test_min_p_drops_tokens_below_min_p_times_the_max(min_p, kept):
    logits = log_probs([0.5, 0.3, 0.15, 0.05])
    assert drawn_set(logits, SamplingParams(min_p=min_p)) == kept


def test_filters_combine_in_one_batch_without_leaking_between_rows():
    kinds = [SamplingParams(top_k=1), SamplingParams(top_p=0.75), SamplingParams(min_p=0.5),
             SamplingParams()]
    params = kinds * 1000  # interleaved rows, one batch
    logits = torch.tensor([log_probs([0.5, 0.3, 0.15, 0.05])]).repeat(len(params), 1)
    tokens = sample(logits, params, sampler=Sampler(seed=3)).token_ids
    seen = [set(tokens[k::len(kinds)]) for k in range(len(kinds))]
    assert seen == [{0}, {0, 1}, {0, 1}, {0, 1, 2, 3}]


# -- penalties ------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[3.0, -1.0, 2.0, -2.0, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0)]
    out = _apply_penalties(logits.clone(), params, [([0], [1])])
    # Seen tokens (prompt 0, output 1) move down; unseen ones do not move.
    assert out.tolist() == [[1.5, -2.0, 2.0, -2.0, 0.5]]


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, -1.0]])
    plain = SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, [plain], [([0], [])]).token_ids == [0]
    assert sample(logits, [penalised], [([0], [])]).token_ids == [1]
    # A penalty below 1 rewards repetition instead.
    rewarding = SamplingParams(temperature=0.0, repetition_penalty=0.5)
    assert sample(logits, [rewarding], [([1], [])]).token_ids == [1]


def test_presence_and_frequency_penalties_use_output_counts_only():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)]
    # Token 3 is in the prompt only: untouched. Token 0 was output 3 times, token 1 once.
    out = _apply_penalties(logits.clone(), params, [([3], [0, 1, 0, 0])])
    assert out[0].tolist() == pytest.approx([2.0 - 0.5 - 0.75, 1.0 - 0.5 - 0.25, 0.0, -1.0])


def test_frequency_penalty_grows_with_repetition_and_flips_greedy():
    logits = torch.tensor([[2.0, 1.5]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.3)]
    assert sample(logits, params, [([], [0])]).token_ids == [0]        # 2.0 - 0.3 > 1.5
    assert sample(logits, params, [([], [0, 0, 0])]).token_ids == [1]  # 2.0 - 0.9 < 1.5
    assert sample(logits, params, [([0, 0, 0], [])]).token_ids == [0]  # prompt does not count


def test_negative_presence_penalty_encourages_used_tokens():
    logits = torch.tensor([[1.5, 2.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=-1.0)]
    assert sample(logits, params, [([], [])]).token_ids == [1]
    assert sample(logits, params, [([], [0])]).token_ids == [0]


def test_penalties_apply_only_to_their_own_row():
    logits = torch.tensor([[3.0, 2.0], [3.0, 2.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0),
              SamplingParams(temperature=0.0)]
    out = sample(logits, params, [([], [0]), ([], [0])])
    assert out.token_ids == [1, 0]
    assert logits.tolist() == [[3.0, 2.0], [3.0, 2.0]]  # the caller's logits are not modified


# -- logprobs -------------------------------------------------------------------------------


def test_logprobs_hold_the_chosen_token_and_the_top_n():
    torch.manual_seed(2)
    logits = torch.randn(3, 64)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=0)]
    out = sample(logits, params)
    expected = torch.log_softmax(logits, dim=-1)
    top5 = expected[0].topk(5)
    assert out.logprobs[1] is None
    assert set(out.logprobs[0]) == set(top5.indices.tolist())
    assert out.token_ids[0] in out.logprobs[0]
    for token, lp in out.logprobs[0].items():
        assert lp == pytest.approx(float(expected[0, token]), abs=1e-5)
    assert out.logprobs[2] == {out.token_ids[2]:
                               pytest.approx(float(expected[2, out.token_ids[2]]), abs=1e-5)}


def test_logprobs_include_a_chosen_token_outside_the_top_n():
    logits = torch.tensor([[3.0, 2.9, 1.5, 0.0]])
    # Penalties push greedy down to token 2; logprobs report the model's own distribution.
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=1)]
    out = sample(logits, params, [([], [0, 1])])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert out.token_ids == [2]
    assert out.logprobs[0] == {2: pytest.approx(float(expected[2]), abs=1e-6),
                               0: pytest.approx(float(expected[0]), abs=1e-6)}


def test_logprobs_of_sampled_tokens_match_the_draws():
    logits = torch.tensor([log_probs([0.4, 0.3, 0.2, 0.1])]).repeat(200, 1)
    out = sample(logits, [SamplingParams(temperature=1.0, logprobs=2)] * 200)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry
        assert {0, 1} <= set(entry)
        assert math.exp(entry[token]) == pytest.approx([0.4, 0.3, 0.2, 0.1][token], rel=1e-5)


# -- seeds ----------------------------------------------------------------------------------


def seeded_draws(target_row: int, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None], steps: int = 30) -> list[int]:
    sampler = Sampler(seed=99)
    return [sample(logits, params, generators=generators, sampler=sampler).token_ids[target_row]
            for _ in range(steps)]


def test_same_seed_gives_same_draws_whatever_the_batch_mates():
    torch.manual_seed(3)
    target = torch.randn(1, 200)
    target_params = SamplingParams(temperature=0.9, seed=7)

    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    alone = seeded_draws(0, target, [target_params], [gen(7)])
    # Mates: an unseeded random row, a seeded one, a greedy one, rows with every filter.
    mates = torch.randn(4, 200)
    batch_a = torch.cat([mates[:2], target, mates[2:]])
    params_a = [SamplingParams(temperature=1.3), SamplingParams(temperature=0.7, seed=1),
                target_params, SamplingParams(temperature=0.0),
                SamplingParams(top_k=5, top_p=0.5, min_p=0.3, presence_penalty=1.0)]
    in_batch_a = seeded_draws(2, batch_a, params_a, [None, gen(1), gen(7), None, None])
    batch_b = torch.cat([target, mates[3:], mates[:1]])
    params_b = [target_params, SamplingParams(temperature=0.5, top_k=2),
                SamplingParams(temperature=1.0, seed=7)]
    in_batch_b = seeded_draws(0, batch_b, params_b, [gen(7), None, gen(7)])
    assert len(set(alone)) > 5  # really random, so equality below means something
    assert in_batch_a == alone
    assert in_batch_b == alone


def test_different_seeds_give_different_draws():
    torch.manual_seed(4)
    logits = torch.randn(1, 200)
    params = [SamplingParams(temperature=1.0)]
    first = seeded_draws(0, logits, params, [torch.Generator().manual_seed(1)])
    again = seeded_draws(0, logits, params, [torch.Generator().manual_seed(1)])
    other = seeded_draws(0, logits, params, [torch.Generator().manual_seed(2)])
    assert first == again
    assert first != other


# -- end to end, real model -----------------------------------------------------------------


@pytest.mark.slow
def test_seeded_request_samples_the_same_alone_and_in_a_batch(llm, engine):
    prompt = "Write a short poem about the sea."
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompt, seeded)[0].outputs[0].token_ids
    others = ["The history of Rome", "def quicksort(xs):", "My favourite food is",
              "In 1905, Einstein"]
    mates = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=n, ignore_eos=True)
             for n in (3, 14, 6, 9)]
    outs = llm.generate([others[0], others[1], prompt, others[2], others[3]],
                        [mates[0], mates[1], seeded, mates[2], mates[3]])
    assert outs[2].outputs[0].token_ids == alone
    assert len(set(alone)) > 4  # sampled text, not a degenerate repeat
    reseeded = SamplingParams(temperature=0.8, seed=4321, max_tokens=12, ignore_eos=True)
    assert llm.generate(prompt, reseeded)[0].outputs[0].token_ids != alone
