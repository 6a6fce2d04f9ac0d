"""Helpers shared by test modules."""

from __future__ import annotations

import torch


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
