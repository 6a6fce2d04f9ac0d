"""transformers' greedy continuations of token-id prompts, one prompt at a time (no padding) on
one intra-op thread, the correctness oracle of tests/runtime/test_hf_parity.py. Run as
`python -m tests.hf_greedy_reference NEW_TOKENS` with a JSON list of id lists on stdin, it loads
the default model's GGUF itself and prints the continuations as a JSON list: the parity test
gives half of its prompts to such a process, so both cores compute the reference."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """`model`'s greedy continuation of each prompt, `new_tokens` long (EOS does not stop it)."""
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            # NOTE: no eos_token_id rather than min_new_tokens: min_new_tokens masks EOS out of
            # the logits, while ignore_eos only keeps going after an EOS that wins the argmax.
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=new_tokens, eos_token_id=None)
            out.append(y[0, len(ids):].tolist())
    return out


def load_model(path: Path | None = None):
    """A GGUF file (the default model's when None) as transformers reads it, in float32: the
    oracle (tests/conftest.py's `hf_model`)."""
    import transformers

    from runtime.loader import default_model_path

    path = default_model_path() if path is None else path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def main() -> None:
    torch.set_num_threads(1)
    prompts = json.load(sys.stdin)
    json.dump(greedy(load_model(), prompts, int(sys.argv[1])), sys.stdout)


if __name__ == "__main__":
    main()
