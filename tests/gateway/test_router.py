"""Routing rules on plain objects: rendezvous affinity, bounded load, sticky moves, least load."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.router import Router, rendezvous_rank


@dataclass
class FakeWorker:
    id: str
    inflight: int = 0
    up: bool = True

    @property
    def available(self) -> bool:
        return self.up


def workers(n: int) -> list[FakeWorker]:
    return [FakeWorker(f"w{i}") for i in range(n)]


def test_removing_a_worker_moves_only_the_keys_it_ranked_first() -> None:
    ids = [f"w{i}" for i in range(5)]
    keys = [f"s{i}" for i in range(500)]
    before = {k: rendezvous_rank(k, ids)[0] for k in keys}
    after = {k: rendezvous_rank(k, ids[1:])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "w0" for k in moved)


def test_session_sticks_while_its_worker_is_up() -> None:
    router, ws = Router(), workers(3)
    first = router.pick(ws, session="abc")
    assert all(router.pick(ws, session="abc") is first for _ in range(10))


def test_session_moves_once_when_its_worker_goes_and_not_back_when_another_arrives() -> None:
    router, ws = Router(), workers(3)
    first = router.pick(ws, session="abc")
    remaining = [w for w in ws if w is not first]
    second = router.pick(remaining, session="abc")
    assert second is not first
    newcomer = FakeWorker("w-new")
    assert all(router.pick([*remaining, newcomer], session="abc") is second for _ in range(5))


def test_overloaded_pinned_worker_spills_without_losing_the_session() -> None:
    router, ws = Router(load_factor=1.0), workers(2)
    home = router.pick(ws, session="abc")
    assert home is not None
    home.inflight = 10
    spill = router.pick(ws, session="abc")
    assert spill is not home
    home.inflight = 0
    assert router.pick(ws, session="abc") is home


def test_without_session_least_loaded_wins_and_prefix_returns_to_its_worker() -> None:
    router, ws = Router(), workers(3)
    ws[0].inflight, ws[1].inflight = 2, 1
    assert router.pick(ws) is ws[2]
    chosen = router.pick(ws, prefix_key="p")
    chosen.inflight += 1
    assert router.pick(ws, prefix_key="p") is chosen


def test_no_available_worker_gives_none() -> None:
    ws = workers(2)
    for w in ws:
        w.up = False
    assert Router().pick(ws, session="x") is None
