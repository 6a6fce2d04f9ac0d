"""A reproducible workload of real text prompts with output lengths that vary like traffic."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    output_len: int


def pydoc_paragraphs(min_chars: int = 80) -> list[str]:
    """Real English/code text that ships with Python: the pydoc topic help texts."""
    from pydoc_data.topics import topics

    paras: list[str] = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            para = " ".join(para.split())
            if len(para) >= min_chars:
                paras.append(para)
    return paras


def make_workload(num_requests: int, min_output: int = 16, max_output: int = 256,
                  min_prompt_chars: int = 80, max_prompt_chars: int = 600,
                  seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    paras = [p for p in pydoc_paragraphs(min_prompt_chars)]
    out = []
    for _ in range(num_requests):
        text = rng.choice(paras)[: rng.randint(min_prompt_chars, max_prompt_chars)]
        out.append(BenchRequest(text, rng.randint(min_output, max_output)))
    return out
