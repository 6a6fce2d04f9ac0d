"""Tenant-salted prefix cache: full KV pages indexed by a hash chain, shared by refcount.

Page i of a sequence is keyed by hash(key of page i-1, the page's tokens); the first page's
key mixes in the salt, which is the authenticated tenant (or a namespace the operator declared
shared), so one tenant can never hit, or time, another tenant's pages. The cache holds one
reference on every page it indexes; least recently used pages that only the cache holds are
evicted when the pool runs short. Torch-free.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from runtime.kv.pages import PagePool, PageRef


class PrefixCache:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._index: OrderedDict[bytes, PageRef] = OrderedDict()
        self.hits = 0
        self.lookups = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._index)

    def page_keys(self, salt: str, token_ids: list[int], num_pages: int,
                  known: list[bytes] | None = None,
                  shared: tuple[str, int] | None = None) -> list[bytes]:
        """Keys of the first num_pages full pages; `known` are already-computed leading keys.

        With `shared=(namespace, n)`, the first n pages are keyed under the namespace (every
        tenant in it hits them) and the chain is salted with the tenant again from page n on,
        so what follows the shared prefix stays private.
        """
        ps = self.pool.page_size
        keys = list(known or [])
        ns, num_shared = shared if shared else ("", 0)
        root = ns if num_shared else salt
        parent = keys[-1] if keys else hashlib.blake2b(root.encode(), digest_size=16).digest()
        for i in range(len(keys), num_pages):
            if num_shared and i == num_shared:
                parent = hashlib.blake2b(parent + b"|tenant|" + salt.encode(),
                                         digest_size=16).digest()
            tokens = array("q", token_ids[i * ps : (i + 1) * ps]).tobytes()
            parent = hashlib.blake2b(parent + tokens, digest_size=16).digest()
            keys.append(parent)
        return keys

    def lookup(self, keys: list[bytes]) -> list[PageRef]:
        """The cached refs of the longest run of leading keys found (not yet shared)."""
        self.lookups += 1
        out = []
        for key in keys:
            ref = self._index.get(key)
            if ref is None:
                break
            self._index.move_to_end(key)
            out.append(ref)
        if out:
            self.hits += 1
        return out

    def insert(self, key: bytes, ref: PageRef) -> None:
        if key in self._index or not self.pool.is_live(ref):
            return
        self.pool.share(ref)
        self._index[key] = ref

    def discard_page(self, page_id: int) -> None:
        """Forget every entry for a page (its owner was aborted: never serve it again)."""
        for key in [k for k, r in self._index.items() if r.page_id == page_id]:
            ref = self._index.pop(key)
            if self.pool.is_live(ref):
                self.pool.release(ref)

    @property
    def num_evictable(self) -> int:
        return sum(1 for r in self._index.values()
                   if self.pool.is_live(r) and self.pool.refcounts[r.page_id] == 1)

    def evict(self, num_pages: int, keep: set[int] | None = None) -> int:
        """Free up to num_pages pages that only the cache holds, least recently used first,
        sparing the pages in `keep` (hits about to be shared)."""
        freed = 0
        for key in list(self._index):
            if freed >= num_pages:
                break
            ref = self._index[key]
            if keep and ref.page_id in keep:
                continue
            if not self.pool.is_live(ref):
                del self._index[key]  # stale entry: drop it, it holds nothing
                continue
            if self.pool.refcounts[ref.page_id] == 1:
                del self._index[key]
                self.pool.release(ref)
                self.evictions += 1
                freed += 1
        return freed

    def clear(self) -> None:
        for ref in self._index.values():
            if self.pool.is_live(ref):
                self.pool.release(ref)
        self._index.clear()

    def check_quiescent(self) -> None:
        """With no request in flight, the only holds left are the cache's own, one per page."""
        from runtime.kv.pages import PageAccountingError

        cached = {r.page_id for r in self._index.values() if self.pool.is_live(r)}
        for p in range(self.pool.num_pages):
            want = 1 if p in cached else 0
            if self.pool.refcounts[p] != want:
                raise PageAccountingError(f"page {p} has {self.pool.refcounts[p]} holders at "
                                          f"quiescence; the prefix cache accounts for {want}")
