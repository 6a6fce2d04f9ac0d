"""The quality harness (`ops/eval`): statistics with known answers, text, specs, the verdict,
the whole pipeline on small fake models, and end-to-end runs on the real default model."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from ops.eval.cli import main
from ops.eval.metrics import (
    KL_SUM,
    NLL_A,
    TOKENS,
    kl_per_position,
    matched_prefix_length,
    window_stats,
)
from ops.eval.spec import SpecError, check_kwargs, parse_config, parse_thresholds
from ops.eval.stats import Estimate, bootstrap, exp_ratio, ratio
from ops.eval.text import DEFAULT_SOURCE, load_text, make_windows
from ops.eval.verdict import METRICS, judge

# -- statistics ------------------------------------------------------------------------------


def test_kl_of_identical_distributions_is_zero_with_a_zero_width_ci():
    logits = torch.randn(4, 63, 100, generator=torch.Generator().manual_seed(0))
    units = np.array([window_stats(w, w.clone(), list(range(63))).row() for w in logits])
    assert (units[:, KL_SUM] == 0).all()
    assert bootstrap(units, ratio(KL_SUM, TOKENS)) == Estimate(0.0, 0.0, 0.0)


def test_kl_of_a_known_pair_matches_the_hand_computation():
    p = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.9, 0.1]], dtype=torch.float64)
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    # Logits are log-probabilities up to a constant per row; the shift must not matter.
    got = kl_per_position(p.log() + 3.0, q.log() - 1.0)
    assert got.item() == pytest.approx(expected, rel=1e-12)


def test_kl_ignores_tokens_that_a_gives_zero_probability():
    a = torch.tensor([[0.0, -math.inf]])
    b = torch.tensor([[0.0, 0.0]])
    assert kl_per_position(a, b).item() == pytest.approx(math.log(2.0))


def test_top1_agreement_counts_positions_with_the_same_argmax():
    a = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    b = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    stats = window_stats(a, b, [0, 1, 2, 0])
    assert (stats.tokens, stats.top1_agree) == (3, 2)  # the last row has no target


def test_perplexity_of_a_uniform_distribution_is_the_vocabulary_size():
    vocab = 50
    flat = torch.zeros(17, vocab)
    units = np.array([window_stats(flat, flat, list(range(17))).row() for _ in range(3)])
    est = bootstrap(units, exp_ratio(NLL_A, TOKENS))
    assert est.value == pytest.approx(vocab) and est.lo == pytest.approx(vocab)


def test_bootstrap_ci_covers_the_true_mean_of_a_synthetic_sample():
    rng = np.random.default_rng(1)
    units = np.stack([rng.normal(3.0, 1.0, 200), np.ones(200)], axis=1)
    est = bootstrap(units, ratio(0, 1), resamples=2000, seed=0)
    assert est.lo < 3.0 < est.hi
    assert 0.2 < est.hi - est.lo < 0.4  # ~ 2 x 1.96 / sqrt(200) = 0.28
    assert bootstrap(units, ratio(0, 1), resamples=2000, seed=0) == est


def test_bootstrap_resamples_whole_windows_not_tokens():
    # Two windows: one all-agreeing, one all-disagreeing. Resampling windows gives a wide CI;
    # resampling their 200 tokens would give a narrow one around 0.5.
    units = np.array([[100.0, 100.0], [100.0, 0.0]])
    est = bootstrap(units, ratio(1, 0), resamples=500, seed=0)
    assert est.value == 0.5 and est.lo == 0.0 and est.hi == 1.0


def test_greedy_match_counts_the_agreeing_prefix_only():
    assert matched_prefix_length([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert matched_prefix_length([1, 2, 3], [1, 2, 3]) == 3
    assert matched_prefix_length([5, 2], [1, 2]) == 0


# -- verdict -----------------------------------------------------------------------------------


def test_lower_is_better_metric_passes_only_when_its_ci_upper_bound_is_under_threshold():
    kl = {"kl": Estimate(0.01, 0.005, 0.02)}
    assert judge(kl, {"kl": 0.03})[0].passed
    failed = judge(kl, {"kl": 0.015})[0]  # the point estimate is under, the bound is not
    assert not failed.passed and failed.bound == "upper" and failed.observed == 0.02


def test_higher_is_better_metric_is_judged_by_its_ci_lower_bound():
    top1 = {"top1": Estimate(0.95, 0.90, 0.98)}
    assert judge(top1, {"top1": 0.9})[0].passed
    failed = judge(top1, {"top1": 0.93})[0]
    assert not failed.passed and failed.bound == "lower" and failed.observed == 0.90


def test_an_unmeasured_metric_fails_its_check():
    (check,) = judge({}, {"match": 0.5})
    assert not check.passed and check.as_dict()["observed"] is None


# -- text and specs ------------------------------------------------------------------------------


def test_default_text_is_the_pydoc_topics_in_a_fixed_order():
    from pydoc_data.topics import topics

    text, source = load_text(None)
    assert source == DEFAULT_SOURCE and load_text(None)[0] == text
    first = sorted(topics)[0]
    assert text.startswith(topics[first].strip()) and len(text) > 100_000


def test_a_text_file_is_read_and_a_missing_one_is_refused(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello world\n", encoding="utf-8")
    assert load_text(str(path)) == ("hello world\n", str(path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text(str(tmp_path / "missing.txt"))


def test_windows_do_not_overlap_and_spread_over_the_text_when_capped():
    ids = list(range(100))
    assert make_windows(ids, 30, 10) == [ids[0:30], ids[30:60], ids[60:90]]
    assert make_windows(ids, 10, 3) == [ids[0:10], ids[30:40], ids[60:70]]
    with pytest.raises(ValueError, match="fewer than one window"):
        make_windows(ids[:5], 10, 3)


def test_config_values_are_read_as_bool_none_int_float_or_string():
    assert parse_config("kv_cache_dtype=fp8, kv_cache_bytes=1024,enable_prefix_caching=false,"
                        "tenant_page_quota=0.5,max_model_len=none,model=/m/a=b.gguf") == {
        "kv_cache_dtype": "fp8", "kv_cache_bytes": 1024, "enable_prefix_caching": False,
        "tenant_page_quota": 0.5, "max_model_len": None, "model": "/m/a=b.gguf"}
    assert parse_config("") == {}


@pytest.mark.parametrize("spec", ["kv_cache_dtype", "=fp8", "dtype=", "a=1,a=2"])
def test_a_malformed_config_is_a_clear_error(spec):
    with pytest.raises(SpecError, match="config: .*" + spec.split(",")[0].split("=")[0]):
        parse_config(spec)


def test_a_key_llm_does_not_take_is_refused_before_loading():
    from runtime.llm import LLM

    with pytest.raises(SpecError, match=r"unknown key.*kv_cahce_dtype.*LLM accepts.*dtype"):
        check_kwargs({"kv_cahce_dtype": "fp8"}, LLM.__init__)
    with pytest.raises(SystemExit) as exc:
        main(["--a", "dtype=float32", "--b", "no_such_key=1"])
    assert exc.value.code == 2


def test_thresholds_name_known_metrics_with_numeric_values():
    assert parse_thresholds("kl=0.05,top1=0.9", METRICS) == {"kl": 0.05, "top1": 0.9}
    with pytest.raises(SpecError, match="unknown metric 'kll'"):
        parse_thresholds("kll=0.05", METRICS)
    with pytest.raises(SpecError, match="not a number"):
        parse_thresholds("kl=low", METRICS)


# -- the pipeline on fake models -------------------------------------------------------------------

VOCAB = 40


class FakeLLM:
    """A bigram model: logits depend on the current token only. `noise` perturbs the table."""

    def __init__(self, noise: float = 0.0) -> None:
        self.table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))
        if noise:
            g = torch.Generator().manual_seed(1)
            self.table = self.table + noise * torch.randn(VOCAB, VOCAB, generator=g)
        self.tokenizer = SimpleNamespace(
            encode=lambda text, add_special_tokens=True: [ord(c) % VOCAB for c in text])

    def prompt_logits(self, token_ids: list[int], *, tenant: str = "default") -> torch.Tensor:
        return self.table[torch.tensor(token_ids)]

    def generate(self, prompts: list[list[int]], params: Any, *,
                 tenant: str = "default") -> list[Any]:
        outs = []
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(params.max_tokens):
                ids.append(int(self.table[ids[-1]].argmax()))
            outs.append(SimpleNamespace(error=None,
                                        outputs=[SimpleNamespace(token_ids=ids[len(prompt):])]))
        return outs


def run_json(argv: list[str], capsys, loader: Callable[[dict[str, Any]], Any]):
    code = main([*argv, "--json"], loader=loader)
    return code, json.loads(capsys.readouterr().out)


def test_identical_fake_models_agree_exactly_and_pass_the_strictest_thresholds(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    code, report = run_json(["--a", "", "--b", "", "--text", str(text), "--window", "64",
                             "--prompt-tokens", "8", "--max-tokens", "6",
                             "--thresholds", "kl=0,top1=1,match=1,ppl_ratio=1"],
                            capsys, lambda kw: FakeLLM(**kw))
    m = report["metrics"]
    assert code == 0 and report["passed"] and len(report["checks"]) == 4
    assert m["kl"] == {"value": 0.0, "lo": 0.0, "hi": 0.0}
    assert m["top1"]["lo"] == m["match"]["lo"] == m["ppl_ratio"]["hi"] == 1.0
    assert report["windows"] == 1800 // 64 and report["tokens"] == report["windows"] * 63
    assert report["continuation_tokens"] == report["prompts"] * 6
    assert report["match_prefixes"] == [6] * report["prompts"]


def test_no_greedy_prompts_leaves_match_unmeasured_and_its_threshold_failed(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("abcdefghij" * 50)
    code, report = run_json(["--a", "", "--b", "", "--text", str(text), "--window", "32",
                             "--prompt-tokens", "8", "--prompts", "0",
                             "--thresholds", "kl=0,match=0.5"], capsys, lambda kw: FakeLLM(**kw))
    assert code == 1 and "match" not in report["metrics"] and report["match_prefixes"] == []
    assert [c["passed"] for c in report["checks"]] == [True, False]


def test_a_perturbed_fake_model_differs_and_fails_a_zero_kl_threshold(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    code, report = run_json(["--a", "noise=0", "--b", "noise=0.5", "--text", str(text),
                             "--window", "64", "--thresholds", "kl=0,top1=0.1"],
                            capsys, lambda kw: FakeLLM(**kw))
    kl, checks = report["metrics"]["kl"], {c["metric"]: c for c in report["checks"]}
    assert code == 1 and not report["passed"]
    assert 0 < kl["lo"] <= kl["value"] <= kl["hi"]
    assert not checks["kl"]["passed"] and checks["top1"]["passed"]


def test_the_table_names_every_metric_and_the_verdict(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("abcdefghij" * 50)
    code = main(["--a", "", "--b", "noise=0.5", "--text", str(text), "--window", "32",
                 "--prompt-tokens", "8", "--thresholds", "kl=0"],
                loader=lambda kw: FakeLLM(**kw))
    out = capsys.readouterr().out
    assert code == 1
    for label in ("mean KL", "top-1 agreement", "perplexity A", "perplexity B",
                  "perplexity ratio B/A", "greedy match", "| upper <= 0 | FAIL |"):
        assert label in out
    assert "verdict: FAIL (1 of 1 checks): kl upper bound" in out


# -- end to end on the real default model ------------------------------------------------------

SMALL = ["--window", "64", "--max-windows", "2", "--prompt-tokens", "16", "--max-tokens", "4",
         "--resamples", "200"]
# NOTE: instances are reused (see llm_pool); without the prefix cache every run computes every
# window afresh.
POOL = "kv_cache_bytes=16777216,max_num_seqs=4,enable_prefix_caching=false"


@pytest.fixture(scope="module")
def llm_pool():
    """Real LLMs, loaded once per config: a config compared with itself is one instance on both
    sides (the prefix cache is off, so B recomputes every window as A did)."""
    from runtime import LLM

    loaded: dict[tuple, Any] = {}

    def load(kwargs: dict[str, Any]) -> Any:
        key = tuple(sorted(kwargs.items()))
        if key not in loaded:
            loaded[key] = LLM(**kwargs)
        return loaded[key]

    return load


@pytest.mark.slow
def test_the_real_model_against_itself_is_identical_and_passes(llm_pool, capsys):
    code, report = run_json(["--a", f"dtype=float32,{POOL}", "--b", f"dtype=float32,{POOL}",
                             *SMALL, "--thresholds", "kl=0,top1=1,match=1"], capsys, llm_pool)
    m = report["metrics"]
    assert code == 0 and report["passed"]
    assert report["text"]["source"] == DEFAULT_SOURCE and report["tokens"] == 2 * 63
    assert m["kl"]["hi"] == 0.0 and m["top1"]["value"] == 1.0 and m["match"]["value"] == 1.0
    assert 1.0 < m["ppl_a"]["value"] == m["ppl_b"]["value"] < 1000.0


@pytest.mark.slow
def test_float32_against_bfloat16_differs_and_fails_a_zero_kl_threshold(llm_pool, capsys):
    code, report = run_json(["--a", f"dtype=float32,{POOL}", "--b", f"dtype=bfloat16,{POOL}",
                             *SMALL, "--thresholds", "kl=0"], capsys, llm_pool)
    kl = report["metrics"]["kl"]
    assert code == 1 and not report["passed"]
    assert 0 < kl["value"] < 1.0 and report["metrics"]["top1"]["value"] > 0.5
