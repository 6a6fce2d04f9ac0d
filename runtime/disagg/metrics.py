"""Counters of KV transfers, one set per engine side (exports or imports). Torch-free."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class TransferCounters:
    transfers: int = 0  # completed (committed on import, fully sent on export)
    frames: int = 0
    shm_frames: int = 0  # of those, moved through a shared-memory ring (one host)
    pages: int = 0  # (logical page, layer range) payloads counted once per page per transfer
    bytes: int = 0  # frame bytes on the wire
    duration_s: float = 0.0  # first frame to commit (import) or last frame (export)
    failures: Counter[str] = field(default_factory=Counter)  # by cause

    @property
    def num_failures(self) -> int:
        return sum(self.failures.values())
