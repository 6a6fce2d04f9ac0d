"""The tiny DeepSeek-V3 (MLA over latent pages) end to end on the `triton` attention backend, in
Triton's interpreter on CPU: greedy tokens equal the `torch` backend's, with bf16 latent pages
and with int8 ones (c_kv codes + scale, the RoPE part bf16 in the row), through a prefix-cache
hit, with the device tag pass as the integrity tracker. The latent store and the MLA decode
kernel (one row per query token) run for prefill, extend and decode alike."""

from __future__ import annotations

import pytest

import tests.kernels.triton_pools  # noqa: F401  sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from runtime import LLM, SamplingParams
from runtime.attention.triton_tags import DeviceTagIntegrityTracker

# the tiny DeepSeek-V3 checkpoint and one torch thread, as the latent-page tests build them
from tests.runtime.test_mla_kv import _one_thread, checkpoint  # noqa: F401

pytestmark = pytest.mark.slow

A = "The history of the Roman empire begins with a small city on the Tiber river in Italy"
B = "Photosynthesis is the process"
C = A + ", and then"  # a's first page, then its own tokens: a prefix hit
PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def _run(path, kv: str, backend: str) -> tuple[dict[str, list[int]], int, LLM]:
    """a and b together (a decode beside a prefill), then c (hits a's cached page)."""
    llm = LLM(model=str(path), kv_cache_bytes=4 << 20, max_num_seqs=4, kv_cache_dtype=kv,
              attention_backend=backend)
    first = llm.generate([A, B], PARAMS)
    c = llm.generate([C], PARAMS)[0]
    tokens = {"a": first[0].outputs[0].token_ids, "b": first[1].outputs[0].token_ids,
              "c": c.outputs[0].token_ids}
    return tokens, c.num_cached_tokens, llm


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_triton_backend_gives_the_torch_tokens_over_latent_pages_with_a_prefix_hit(
        checkpoint, kv):  # noqa: F811
    want, _, _ = _run(checkpoint, kv, "torch")
    got, cached, llm = _run(checkpoint, kv, "triton")
    assert isinstance(llm.engine.tracker, DeviceTagIntegrityTracker)
    assert llm.engine.kv_cache.spec.latent
    assert cached >= 16, "c never hit a's cached page"
    assert got == want
