"""Our tokenizer and chat template against transformers' reading of the same GGUF, and the
incremental detokenizer: whole characters only, stop strings cut and never partly streamed."""

from __future__ import annotations

import pytest

from runtime.detokenizer import IncrementalDetokenizer
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "hello world",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "\n\nleading newlines and trailing\n",
    "tabs\tand\r\nwindows line ends",
    "1234567890",
    "pi is 3.14159, e is 2.71828 and 1,000,000 is a million",
    "Call 555-0123 before 23:59 on 2024-02-29.",
    "def square(x):\n    return x ** 2  # the square\n",
    "for (int i = 0; i < n; ++i) { a[i] = i * i; }",
    "SELECT * FROM users WHERE id IN (1, 2, 3);",
    '{"key": [1, 2.5, "three"], "nested": {"ok": true}}',
    "https://example.com/path?query=a&b=c#frag",
    "I love 🦀 and 🐍! 👍🏽",
    "family: 👨‍👩‍👧‍👦, flag: 🇫🇷",
    "你好，世界！长城很长。",
    "日本語のテキストとカタカナ",
    "한국어 문장입니다",
    "café naïve résumé Ünïcödé",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "math: ∑ x² ≤ ∞, α β γ",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|endoftext|>to special tokens",
    " <|im_start|> spaced special <|im_end|> ",
    "<filename>main.py<file_sep>print('hi')",
    "<|im_start",  # not a special token: a prefix of one
]
PARTIAL_CHAR_TEXTS = [
    "I love 🦀 and 🐍! 👍🏽",
    "你好，世界！长城很长。",
    "日本語 café 👨‍👩‍👧‍👦 done",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 🐍 and 中文."}],
    [{"role": "system", "content": "  Leading spaces\nand newlines\n"},
     {"role": "user", "content": ""}],
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Both sides of each comparison run under the same single-thread setting."""


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]
    assert (tokenizer.encode(text, add_special_tokens=False)
            == hf_tokenizer(text, add_special_tokens=False)["input_ids"])


def test_special_tokens_encode_to_single_ids(tokenizer, hf_tokenizer):
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        (tid,) = tokenizer.encode(token)
        assert tid == hf_tokenizer.convert_tokens_to_ids(token)
        assert tid in tokenizer.special_ids
    assert len(tokenizer.encode("<|im_start")) > 1


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips_and_matches_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    for skip in (False, True):
        assert (tokenizer.decode(ids, skip_special_tokens=skip)
                == hf_tokenizer.decode(ids, skip_special_tokens=skip))


def test_skipping_special_tokens_drops_only_them(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi"


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_chat_template_renders_like_transformers(tokenizer, hf_tokenizer, conversation,
                                                 generation_prompt):
    ours = tokenizer.apply_chat_template(conversation, add_generation_prompt=generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(conversation, tokenize=False,
                                              add_generation_prompt=generation_prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == generation_prompt
    assert tokenizer.encode(ours) == hf_tokenizer(theirs)["input_ids"]


def test_chat_template_adds_the_default_system_prompt_only_without_one(tokenizer):
    default = "You are a helpful AI assistant named SmolLM"
    assert default in tokenizer.apply_chat_template(CONVERSATIONS[0])
    assert default not in tokenizer.apply_chat_template(CONVERSATIONS[1])


# -- incremental detokenizer ------------------------------------------------------------------


def stream(tokenizer, ids: list[int], prompt_ids: list[int] | None = None,
           stop: tuple[str, ...] = (), include_stop: bool = False, skip_special: bool = True,
           ) -> tuple[IncrementalDetokenizer, list[str], list[str]]:
    """Feed ids one at a time as the engine does; returns the detokenizer, the piece released
    after each token (then the final flush), and the concatenated stream after each token."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids or [], stop, include_stop, skip_special)
    pieces, so_far = [], []
    for i, tid in enumerate(ids):
        detok.add_token(tid)
        done = detok.stopped_on is not None or i == len(ids) - 1
        pieces.append(detok.flush(done))
        so_far.append("".join(pieces))
        if detok.stopped_on is not None:
            break
    return detok, pieces, so_far


@pytest.mark.parametrize("text", PARTIAL_CHAR_TEXTS)
def test_detokenizer_never_releases_half_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    # The text really does split characters across tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    _, pieces, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == tokenizer.decode(ids) == text
    # Some token released nothing: it ended mid-character and waited for the next one.
    assert "" in pieces


def test_detokenizer_continues_a_prompt_without_merging_across_the_boundary(tokenizer):
    prompt = tokenizer.encode("The answer is")
    ids = tokenizer.encode(" 42, as in 🦀 crab-math.", add_special_tokens=False)
    _, pieces, _ = stream(tokenizer, ids, prompt_ids=prompt)
    assert "".join(pieces) == " 42, as in 🦀 crab-math."


def test_detokenizer_skips_special_tokens_in_the_stream(tokenizer):
    ids = tokenizer.encode("Sure.<|im_end|>")
    detok, pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == detok.text == "Sure."


def test_special_tokens_are_text_and_can_stop_when_not_skipped(tokenizer):
    ids = tokenizer.encode("Sure.<|im_end|>\n<|im_start|>user")
    detok, pieces, _ = stream(tokenizer, ids, skip_special=False)
    assert "".join(pieces) == "Sure.<|im_end|>\n<|im_start|>user"
    detok, pieces, _ = stream(tokenizer, ids, stop=("<|im_end|>",), skip_special=False)
    assert detok.stopped_on == "<|im_end|>"
    assert "".join(pieces) == "Sure."


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_string_is_cut_and_never_partly_streamed(tokenizer, include_stop):
    text = "Say x STO y and a few more words, then STOP z and more text after it"
    ids = tokenizer.encode(text)
    detok, pieces, so_far = stream(tokenizer, ids, stop=("ZZ", "STOP"),
                                   include_stop=include_stop)
    at = text.index("STOP")
    assert detok.stopped_on == "STOP"
    assert detok.text == "".join(pieces) == text[: at + (4 if include_stop else 0)]
    # Every stream before the last is a prefix of the text before the stop string, so no
    # character of it went out before the stop was recognised.
    assert all(text[:at].startswith(s) for s in so_far[:-1])
    # The false start "STO" was held back, then released once it could no longer match.
    assert any("x STO" in s for s in so_far[:-1])


def test_stop_string_inside_one_token_is_found(tokenizer):
    text = "an unbelievable story"
    ids = tokenizer.encode(text)
    detok, pieces, _ = stream(tokenizer, ids, stop=("elie",))
    assert detok.stopped_on == "elie"
    assert "".join(pieces) == "an unb"


# -- through the engine -------------------------------------------------------------------------


def run_streaming(engine, request_id: str, prompt: str, params: SamplingParams):
    engine.add_request(request_id, prompt, params)
    deltas, final = [], None
    while final is None:
        for out in engine.step():
            if out.request_id == request_id:
                deltas.append(out.delta_text)
                if out.finished:
                    final = out
    return deltas, final


def token_boundaries(tokenizer, ids: list[int]) -> set[int]:
    return {len(tokenizer.decode(ids[:j])) for j in range(len(ids) + 1)}


@pytest.mark.parametrize("include_stop", [False, True])
def test_engine_streams_stop_strings_cut_and_never_partly(engine, tokenizer, include_stop):
    prompt = "Once upon a time, in a village at the edge of a great forest,"
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    _, natural = run_streaming(engine, "stop-natural", prompt, greedy)
    text, ids = natural.outputs[0].text, natural.outputs[0].token_ids
    # A stop string that starts inside one token and ends inside a later one.
    bounds = token_boundaries(tokenizer, ids)
    start = next(a for a in range(len(text) // 3, len(text) - 8)
                 if a not in bounds and text[a] != " " and any(a < b < a + 6 for b in bounds)
                 and a + 6 not in bounds)
    stop = text[start : start + 6]
    at = text.index(stop)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=include_stop)
    deltas, out = run_streaming(engine, "stop-cut", prompt, params)
    expected = text[: at + (len(stop) if include_stop else 0)]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == "".join(deltas) == expected
    for i in range(len(deltas) - 1):
        assert text[:at].startswith("".join(deltas[: i + 1]))
    # Generation stopped at the token that completed the stop string.
    n = len(out.outputs[0].token_ids)
    assert out.outputs[0].token_ids == ids[:n]
    assert stop in tokenizer.decode(ids[:n]) and stop not in tokenizer.decode(ids[: n - 1])


@pytest.mark.parametrize("prompt", ["请用一句话介绍一下长城。", "Emoji story: 🐶 met 🐱 and then"])
def test_engine_stream_of_multibyte_text_has_only_whole_characters(engine, tokenizer, prompt):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    deltas, out = run_streaming(engine, "multibyte", prompt, params)
    ids = out.outputs[0].token_ids
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "no character was split"
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == out.outputs[0].text
    full = tokenizer.decode(ids)
    assert out.outputs[0].text == full.rstrip("\ufffd")
