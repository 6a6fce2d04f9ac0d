"""Batched page-integrity check: recorded (page, tag, owner) triples against the pool's state.

One gather + compare over every page of every sequence in the step. Returns a cause code per
entry: 0 ok, 1 stale tag (page reallocated since recorded), 2 foreign owner, 3 page is free,
4 remapped (the table the model reads names another page than the one recorded there).
"""

from __future__ import annotations

import torch

from kernels.cpu_ops import native_ops

OK, STALE_TAG, FOREIGN_OWNER, FREED_PAGE, REMAPPED = 0, 1, 2, 3, 4
CAUSES = {STALE_TAG: "stale_tag", FOREIGN_OWNER: "foreign_owner", FREED_PAGE: "freed_page",
          REMAPPED: "remapped"}


def ref_verify_pages(page_ids: torch.Tensor, expected_page_ids: torch.Tensor,
                     expected_tags: torch.Tensor, expected_owners: torch.Tensor,
                     pool_tags: torch.Tensor, pool_owners: torch.Tensor,
                     pool_refcounts: torch.Tensor) -> torch.Tensor:
    # all 1-D int64; entries: [N]; pool_*: [num_pages]  ->  [N] int64 cause codes
    assert page_ids.shape == expected_page_ids.shape == expected_tags.shape
    assert expected_tags.shape == expected_owners.shape
    tags = pool_tags.index_select(0, page_ids)
    owners = pool_owners.index_select(0, page_ids)
    live = pool_refcounts.index_select(0, page_ids) > 0
    cause = torch.zeros_like(page_ids)
    cause = torch.where(owners != expected_owners, FOREIGN_OWNER, cause)
    cause = torch.where(tags != expected_tags, STALE_TAG, cause)
    cause = torch.where(~live, FREED_PAGE, cause)
    return torch.where(page_ids != expected_page_ids, REMAPPED, cause)


def verify_pages(page_ids: torch.Tensor, expected_page_ids: torch.Tensor,
                 expected_tags: torch.Tensor, expected_owners: torch.Tensor,
                 pool_tags: torch.Tensor, pool_owners: torch.Tensor,
                 pool_refcounts: torch.Tensor) -> torch.Tensor:
    """As `ref_verify_pages`, through the `verify_pages` op."""
    return native_ops().verify_pages(page_ids, expected_page_ids, expected_tags,
                                     expected_owners, pool_tags, pool_owners, pool_refcounts)
