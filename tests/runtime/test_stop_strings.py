"""Stop strings: the output is cut at the stop string that completes first when the text is read
a character at a time (at one end, the longest), whatever the list order and however the text
is split into tokens; what is streamed adds up to exactly the final text."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.detokenizer import IncrementalDetokenizer

REAL_TEXTS = [
    "The capital of France is Paris. Paris is a city of art, and its river is the Seine.",
    "def square(x):\n    return x ** 2  # 12 squared is 144\n",
    "I love 🦀 and 🐍! 你好，世界！ café naïve résumé, 3.14159 and 2,718.",
]


def earliest_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The reference: read `text` one character at a time; at the first position where some
    stop strings end, the longest of them is the one found."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return (text[:end] if include else text[: end - len(s)]), s
    return text, None


class PieceTokenizer:
    """Token i decodes to pieces[i], whatever surrounds it: tokens are arbitrary substrings."""

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def add(self, piece: str) -> int:
        self.pieces.append(piece)
        return len(self.pieces) - 1

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def run(detok: IncrementalDetokenizer, token_ids: list[int]) -> str:
    """Feed tokens as the engine does (stopping at a stop string); the streamed text."""
    streamed = []
    for token in token_ids:
        detok.add_token(token)
        streamed.append(detok.flush(False))
        if detok.stopped_on is not None:
            break
    streamed.append(detok.flush(True))
    return "".join(streamed)


def check(detok: IncrementalDetokenizer, streamed: str, full_text: str, stops: list[str],
          include: bool) -> None:
    expected, stopped_on = earliest_stop(full_text, stops, include)
    assert (detok.text, detok.stopped_on) == (expected, stopped_on)
    assert streamed == detok.text
    if stopped_on is not None and include:
        assert detok.text.endswith(stopped_on)
        assert not any(s in detok.text[: -len(stopped_on)] for s in stops)
    else:
        assert not any(s in detok.text for s in stops)


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="abc", max_size=40),
       cuts=st.lists(st.integers(1, 39), max_size=20),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=5),
       include=st.booleans())
def test_cut_is_the_earliest_completed_stop_string_whatever_the_token_split(
        text: str, cuts: list[int], stops: list[str], include: bool) -> None:
    tokenizer = PieceTokenizer()
    prompt = [tokenizer.add("prompt: ")]
    bounds = [0, *sorted({c for c in cuts if c < len(text)}), len(text)]
    ids = [tokenizer.add(text[a:b]) for a, b in itertools.pairwise(bounds) if b > a]
    detok = IncrementalDetokenizer(tokenizer, prompt, tuple(stops), include)  # type: ignore[arg-type]
    check(detok, run(detok, ids), text, stops, include)


@pytest.fixture(scope="module")
def tokenizer():
    from runtime.loader import open_checkpoint

    return open_checkpoint(None).tokenizer


@settings(max_examples=150, deadline=None)
@given(data=st.data(), include=st.booleans())
def test_the_real_tokenizer_on_real_text_cuts_at_the_earliest_completed_stop_string(
        tokenizer, data: st.DataObject, include: bool) -> None:
    ids = tokenizer.encode(data.draw(st.sampled_from(REAL_TEXTS)), add_special_tokens=False)
    full = tokenizer.decode(ids)
    spans = st.tuples(st.integers(0, len(full) - 1), st.integers(1, 6))
    stops = [full[a : a + n] for a, n in data.draw(st.lists(spans, min_size=1, max_size=4))]
    prompt = tokenizer.encode("Some text: ")
    detok = IncrementalDetokenizer(tokenizer, prompt, tuple(stops), include)
    check(detok, run(detok, ids), full, stops, include)


@pytest.mark.parametrize("stops, cut", [
    (["ari", "Pa"], " "), (["Pa", "ari"], " "), (["is", "Par"], " "), (["Par", "is"], " "),
    (["aris", "ris"], " P"), (["Paris", "is"], " "),
])
def test_list_order_never_decides_the_cut(stops: list[str], cut: str) -> None:
    tokenizer = PieceTokenizer()
    detok = IncrementalDetokenizer(tokenizer, [tokenizer.add("France is")],  # type: ignore[arg-type]
                                   tuple(stops))
    assert run(detok, [tokenizer.add(" Paris")]) == cut
