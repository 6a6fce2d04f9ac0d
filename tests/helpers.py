"""Helpers shared by test modules."""

from __future__ import annotations

import itertools

import torch

from runtime.scheduler import Scheduler, SchedulerOutput
from runtime.sequence import Sequence

_fake_tokens = itertools.count(1000)


def capture_logits(engine, monkeypatch) -> dict[str, list[torch.Tensor]]:
    """Record, per request id, the logits row the engine samples from at every step."""
    captured: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def capturing(batch):
        samplers, logits = execute(batch)
        for item, row in zip(samplers, logits, strict=True):
            captured.setdefault(item.seq.request_id, []).append(row.clone())
        return samplers, logits

    monkeypatch.setattr(engine.runner, "execute", capturing)
    return captured


def engine_step(sched: Scheduler, stop: set[Sequence] | None = None) -> SchedulerOutput:
    """One engine step without a model; sequences in `stop` finish when they next sample."""
    out = sched.schedule()
    # NOTE: `samples` reads num_computed_tokens, so it is taken before the advance (as the
    # model runner does).
    samplers = [item.seq for item in out.scheduled if item.samples]
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_tokens
    for seq in samplers:
        seq.output_token_ids.append(next(_fake_tokens))
        if len(seq.output_token_ids) >= seq.max_tokens or (stop and seq in stop):
            sched.finish(seq)
    return out
