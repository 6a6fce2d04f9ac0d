"""Engine logprobs -> wire messages: each generated token's logprob and the top-k alternatives,
with the token's own text and bytes (what OpenAI's `token` and `bytes` carry), as vLLM does."""

from __future__ import annotations

from functools import lru_cache

from gateway._proto.tessera.v1 import gateway_pb2 as pb
from runtime.outputs import RequestOutput
from runtime.tokenizer import Tokenizer

TOKEN_CACHE_SIZE = 1 << 16


class TokenLogprobs:
    """Builds TokenLogprob messages; a token's text is decoded once and cached (bounded)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._text = lru_cache(maxsize=TOKEN_CACHE_SIZE)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))

    def entry(self, token_id: int, logprob: float) -> pb.TopLogprob:
        # NOTE: a token holding part of a UTF-8 character decodes to U+FFFD, whose bytes these
        # are (vLLM's `bytes` too): the byte-level piece itself is not text.
        text = self._text(token_id)
        return pb.TopLogprob(token_id=token_id, logprob=logprob, token=text,
                             bytes=text.encode("utf-8", errors="replace"))

    def delta(self, out: RequestOutput, top_n: int) -> list[pb.TokenLogprob]:
        """One message per token in `out.delta_token_ids` (the newest generated tokens)."""
        completion = out.outputs[0]
        if completion.logprobs is None or not out.delta_token_ids:
            return []
        end = len(completion.token_ids)
        start = end - len(out.delta_token_ids)
        msgs = []
        for token_id, entries in zip(completion.token_ids[start:end],
                                     completion.logprobs[start:end], strict=True):
            ranked = sorted(entries.items(), key=lambda kv: -kv[1])[:top_n]
            msgs.append(pb.TokenLogprob(chosen=self.entry(token_id, entries[token_id]),
                                        top=[self.entry(t, lp) for t, lp in ranked]))
        return msgs
