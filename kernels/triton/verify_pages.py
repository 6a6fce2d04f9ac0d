"""The page tag check as one batched Triton pass: a valid flag and a cause per sequence.

Per entry the cause is decided exactly as `kernels/verify_pages.py` decides it (remapped over
freed over stale tag over foreign owner); a page id outside the pool counts as freed (it is
no held page). A sequence is valid iff all its entries are OK. Launcher: `launch.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def verify_pages_kernel(
    valid_ptr, cause_ptr, page_table_ptr, exp_ids_ptr, exp_tags_ptr, exp_owners_ptr,
    num_entries_ptr, pool_tags_ptr, pool_owners_ptr, pool_refcounts_ptr, num_pages,
    stride_pt, stride_et, stride_tt, stride_ot,
    BLOCK: tl.constexpr,
):
    # grid: (sequences,). cause: the first bad entry's code (0: all ok); valid: cause == 0.
    seq = tl.program_id(0).to(tl.int64)
    n = tl.load(num_entries_ptr + seq).to(tl.int32)
    first_bad = tl.full([], 2147483647, tl.int32)
    first_cause = tl.zeros([], tl.int32)
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        idx = start + offs
        ok = idx < n
        page = tl.load(page_table_ptr + seq * stride_pt + idx, mask=ok, other=0).to(tl.int64)
        want = tl.load(exp_ids_ptr + seq * stride_et + idx, mask=ok, other=0).to(tl.int64)
        tag = tl.load(exp_tags_ptr + seq * stride_tt + idx, mask=ok, other=0).to(tl.int64)
        owner = tl.load(exp_owners_ptr + seq * stride_ot + idx, mask=ok, other=0).to(tl.int64)
        inside = ok & (page >= 0) & (page < num_pages)
        pool_tag = tl.load(pool_tags_ptr + page, mask=inside, other=0)
        pool_owner = tl.load(pool_owners_ptr + page, mask=inside, other=0)
        live = tl.load(pool_refcounts_ptr + page, mask=inside, other=0) > 0
        cause = tl.zeros([BLOCK], tl.int32)
        cause = tl.where(pool_owner != owner, 2, cause)  # FOREIGN_OWNER
        cause = tl.where(pool_tag != tag, 1, cause)  # STALE_TAG
        cause = tl.where(~live | ~inside, 3, cause)  # FREED_PAGE
        cause = tl.where(page != want, 4, cause)  # REMAPPED
        cause = tl.where(ok, cause, 0)
        bad_idx = tl.min(tl.where(cause != 0, idx, 2147483647), 0)
        bad_cause = tl.sum(tl.where(idx == bad_idx, cause, 0), 0)
        take = bad_idx < first_bad
        first_cause = tl.where(take, bad_cause, first_cause)
        first_bad = tl.minimum(first_bad, bad_idx)
    tl.store(cause_ptr + seq, first_cause)
    tl.store(valid_ptr + seq, (first_cause == 0).to(valid_ptr.dtype.element_ty))
