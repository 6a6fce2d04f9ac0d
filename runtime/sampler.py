"""Batched sampling: min_tokens, penalties, temperature, top-k/p, min-p, per-request seeds.

Rows short of their `min_tokens` cannot draw EOS or a stop token id (their logits are -inf,
as in vLLM). Greedy rows take the argmax of the raw logits. Random rows draw by inverse CDF:
one uniform number from a generator owned by the sequence against the running sum of its
filtered probabilities, so a seeded request draws the same numbers whatever else shares its
batch (and one number a token, not one a vocabulary entry: the exponential race it replaced
drew 49152 numbers a row, ~1 ms of a step's CPU per random row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.grammar import TokenMasks, apply_token_masks
from runtime.sampling_params import SamplingParams

INVALID_TOKEN = -1  # what a row the device tag pass failed samples (no token id is negative)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} for the chosen token plus the top-n, or None.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: tuple[int, ...] | list[int] = ()) -> None:
        self.default_generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 histories: list[tuple[list[int], list[int]]],
                 generators: list[torch.Generator | None],
                 masks: TokenMasks | None = None,
                 valid: torch.Tensor | None = None) -> SamplerOutput:
        # logits: [rows, vocab]; histories: (prompt ids, output ids) per row; masks: the
        # constrained rows' allowed tokens (logprobs stay those of the unconstrained model);
        # valid: [rows] int, the device tag pass's flags: a 0 row samples INVALID_TOKEN (-1),
        # so the token copy below tells the host of it (no copy of its own)
        logits = logits.float()
        raw = logits
        if masks is not None:
            logits = apply_token_masks(logits.clone(), masks)
        if any(p.min_tokens for p in params):
            logits = self._mask_stops(logits, params, histories)
        if any(p.uses_penalties for p in params):
            logits = _apply_penalties(logits.clone(), params, histories)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy_rows) == len(params):
            # NOTE: max's indices, like argmax, are the first maximum's; on CPU it runs in about
            # half argmax's time (1.7 vs 3.0 ms over 32 rows of a 49152-token vocabulary).
            chosen = logits.max(dim=-1).indices
        else:
            chosen = torch.empty(len(params), dtype=torch.long)
        if greedy_rows and len(greedy_rows) < len(params):
            idx = torch.tensor(greedy_rows)
            chosen[idx] = logits[idx].argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            probs = _filtered_probs(logits[random_rows], [params[i] for i in random_rows])
            uniform = torch.cat([torch.rand(1, generator=generators[i] or self.default_generator,
                                            dtype=torch.float64) for i in random_rows])
            chosen[random_rows] = _inverse_cdf(probs, uniform)
        if valid is not None:
            chosen = torch.where(valid.to(chosen.device) != 0, chosen,
                                 torch.full_like(chosen, INVALID_TOKEN))
        token_ids = chosen.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(params)
        want = [i for i, p in enumerate(params)
                if p.logprobs is not None and token_ids[i] != INVALID_TOKEN]
        if want:
            # one log_softmax, gather and top-n for every row that asks (no per-row ops)
            lp = torch.log_softmax(raw if len(want) == raw.shape[0] else raw[want], dim=-1)
            picked = torch.tensor([token_ids[i] for i in want]).unsqueeze(1)
            chosen_lp = lp.gather(1, picked).squeeze(1).tolist()
            most = max(params[i].logprobs or 0 for i in want)
            top_ids: list[list[int]] = [[] for _ in want]
            top_lp: list[list[float]] = [[] for _ in want]
            if most:
                top = lp.topk(most, dim=-1)
                top_ids, top_lp = top.indices.tolist(), top.values.tolist()
            for j, i in enumerate(want):
                n = params[i].logprobs or 0
                entry = {token_ids[i]: chosen_lp[j]}
                entry.update(zip(top_ids[j][:n], top_lp[j][:n], strict=True))
                logprobs[i] = entry
        return SamplerOutput(token_ids, logprobs)


    def _mask_stops(self, logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        """-inf for EOS and stop token ids on rows with fewer than min_tokens outputs."""
        rows: list[int] = []
        cols: list[int] = []
        vocab = logits.shape[-1]
        for i, p in enumerate(params):
            if len(histories[i][1]) < p.min_tokens:
                banned = {t for t in (*self.eos_token_ids, *p.stop_token_ids) if t < vocab}
                rows += [i] * len(banned)
                cols += sorted(banned)
        if not rows:
            return logits
        logits = logits.clone()
        logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
        return logits


def _apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                     histories: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if not p.uses_penalties:
            continue
        prompt, output = histories[i]
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
            if len(seen):
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                        vals * p.repetition_penalty)
        if output and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)
            counts = counts[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[rows] token ids: for each row of probs [rows, vocab] (unnormalised, >= 0) the first
    token whose running sum (float64, in token order) exceeds uniform [rows] in [0, 1) times
    the row's mass: a draw from the row's distribution (a zero-probability token never is);
    token 0 for a row with no mass."""
    cum = probs.double().cumsum(dim=-1)
    total = cum[:, -1]
    picked = torch.searchsorted(cum, (uniform * total).unsqueeze(1), right=True).squeeze(1)
    picked = picked.clamp(max=probs.shape[-1] - 1)
    return torch.where(total > 0, picked, torch.zeros_like(picked))


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temps
    if any(p.top_k > 0 for p in params):
        logits = logits.masked_fill(logits < _kth_largest(logits, params), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        top_p = torch.tensor([params[i].top_p for i in nucleus], dtype=probs.dtype)
        if len(nucleus) == len(params):
            probs = _top_p(probs, top_p)
        else:
            rows = torch.tensor(nucleus)
            probs[rows] = _top_p(probs[rows], top_p)
    return probs


# The most likely tokens top-p ranks before falling back to sorting the whole vocabulary: a
# nucleus is rarely wider (a full sort of 32 rows of a 49152-token vocabulary is ~0.1 s).
TOP_P_CANDIDATES = 1024


def _kth_largest(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[rows, 1]: each row's top_k-th largest logit (-inf where top_k is 0: keep all), from
    one topk over the largest k asked rather than a sort of the vocabulary."""
    vocab = logits.shape[-1]
    ks = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params])
    top = logits.topk(int(ks.max()), dim=-1).values
    kth = top.gather(1, (ks - 1).clamp(min=0).unsqueeze(1))
    return kth.masked_fill((ks == 0).unsqueeze(1), float("-inf"))


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab] with every token outside each row's nucleus zeroed: a token stays
    if the mass of the tokens ranked above it is below top_p times the row's mass (the first
    always stays). Ranked among the TOP_P_CANDIDATES most likely tokens; a row whose nucleus
    reaches past them is ranked over its whole vocabulary."""
    limit = (top_p * probs.sum(dim=-1)).unsqueeze(1)
    k = min(TOP_P_CANDIDATES, probs.shape[-1])
    vals, order = probs.topk(k, dim=-1)
    before = vals.cumsum(dim=-1) - vals
    keep = before < limit
    out = torch.zeros_like(probs).scatter(1, order, vals.masked_fill(~keep, 0.0))
    wide = (~(before[:, -1] >= limit[:, 0])).nonzero().flatten().tolist()
    if wide:  # the nucleus may reach past the candidates: rank the whole row
        rows = torch.tensor(wide)
        sorted_probs, full = probs[rows].sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(1, full, before >= limit[rows])
        out[rows] = probs[rows].masked_fill(drop, 0.0)
    return out
