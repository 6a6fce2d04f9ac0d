"""Picks a worker for a request: session affinity by rendezvous hashing with bounded load,
else the worker that last served the prompt's prefix, else the least loaded. Torch-free."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class Routable(Protocol):
    id: str
    inflight: int

    @property
    def available(self) -> bool: ...


def rendezvous_rank(key: str, ids: Sequence[str]) -> list[str]:
    """Highest random weight first: removing one id only moves the keys that ranked it first."""
    def weight(wid: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{wid}".encode(), digest_size=8).digest()

    return sorted(ids, key=weight, reverse=True)


class _Lru(OrderedDict[str, str]):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key: str, value: str) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


class Router:
    def __init__(self, load_factor: float = 1.25, max_entries: int = 100_000) -> None:
        self.load_factor = load_factor
        self.sessions = _Lru(max_entries)  # session -> worker id it is pinned to
        self.prefixes = _Lru(max_entries)  # prefix key -> worker id that last served it

    def load_bound(self, workers: Sequence[Routable]) -> int:
        """Bounded-load hashing: no worker takes more than load_factor x the mean (+1)."""
        total = sum(w.inflight for w in workers) + 1
        return max(1, math.ceil(self.load_factor * total / max(1, len(workers))))

    def pick(self, workers: Sequence[Routable], session: str | None = None,
             prefix_key: str | None = None) -> Routable | None:
        """A worker that can take the request now, or None (all busy or none ready)."""
        ready = [w for w in workers if w.available]
        if not ready:
            return None
        bound = self.load_bound(ready)
        by_id = {w.id: w for w in ready}
        if session is not None:
            return self._pick_session(session, ready, by_id, bound, {w.id for w in workers})
        if prefix_key is not None:
            last = by_id.get(self.prefixes.get(prefix_key, ""))
            if last is not None and last.inflight < bound:
                return last
        chosen = min(ready, key=lambda w: w.inflight)
        if prefix_key is not None:
            self.prefixes.put(prefix_key, chosen.id)
        return chosen

    def _pick_session(self, session: str, ready: list[Routable], by_id: dict[str, Routable],
                      bound: int, live_ids: set[str]) -> Routable:
        pinned = self.sessions.get(session)
        if pinned in by_id and by_id[pinned].inflight < bound:
            self.sessions.move_to_end(session)
            return by_id[pinned]
        ranked = [by_id[i] for i in rendezvous_rank(session, list(by_id))]
        chosen = next((w for w in ranked if w.inflight < bound), ranked[0])
        # NOTE: re-pin only when the pinned worker is gone; a busy one keeps its sessions, so a
        # session moves once when its worker goes away and never back.
        if pinned is None or pinned not in live_ids:
            self.sessions.put(session, chosen.id)
        return chosen
