"""The paged latent cache's own rules: where a write may land, what it converts, what it hands out.

Why here: the engine only ever writes inside a reservation, so the engine tests cannot see a write
that wraps round or a page list shared with its caller; these are what keep a bug elsewhere from
corrupting another request's cache silently."""

from __future__ import annotations

import pytest
import torch

from services.verifier.kv_cache import PagedKVCache


def _cache() -> tuple[PagedKVCache, torch.Tensor]:
    """Two layers, 4 pages of 4 slots, dim 3, pages in a scrambled order; "a" owns 2 pages (8 tokens)."""
    cache = PagedKVCache(2, 4, 4, 3, torch.float32, "cpu", shuffle_seed=1)
    cache.reserve("a", 8)
    return cache, torch.randn(2, 8, 3)


def test_a_write_fills_a_reservation_through_its_last_slot_and_refuses_a_negative_start() -> None:
    """A start before the first token is refused by `write` and `write_many` alike, not wrapped
    round into the last page's last slot."""
    cache, kv = _cache()
    cache.write("a", 0, kv)   # tokens 0..7: the whole reservation
    assert torch.equal(cache.gather(0, "a", 8), kv[0]) and torch.equal(cache.gather(1, "a", 8), kv[1])
    one = torch.full((2, 1, 3), -1.0)
    with pytest.raises(IndexError):
        cache.write("a", -1, one)
    with pytest.raises(IndexError):
        cache.write_many([("a", -1, 1)], one)
    with pytest.raises(IndexError):
        cache.write("a", 8, one)   # one past the reservation
    assert torch.equal(cache.gather(0, "a", 8), kv[0]) and torch.equal(cache.gather(1, "a", 8), kv[1])


def test_a_write_stores_kv_of_another_dtype_in_the_caches() -> None:
    """A model's latents may come in another dtype than the cache's (float64 on the reference path)."""
    cache, kv = _cache()
    cache.write("a", 0, kv[:, :4].double())
    cache.write_many([("a", 4, 4)], kv[:, 4:].double())
    assert cache.kv.dtype == torch.float32 and torch.equal(cache.gather(1, "a", 8), kv[1])


def test_pages_needed_is_zero_once_covered_and_page_ids_is_a_copy() -> None:
    """A request holding more than asked needs no pages (not fewer than none); the page list handed
    out is the caller's to change."""
    cache, _ = _cache()
    assert cache.pages_needed("a", 3) == 0 and cache.pages_needed("a", 8) == 0
    assert cache.pages_needed("a", 9) == 1 and cache.pages_needed("new", 1) == 1
    ids = cache.page_ids("a")
    ids.clear()
    assert len(cache.page_ids("a")) == 2 and cache.reserved_tokens("a") == 8
    cache.free("a")
    assert cache.pages_free == 4


def test_write_many_puts_each_run_where_write_does_and_nothing_else() -> None:
    """The commit's one scatter (flat slots, `index_copy_`) against one `write` per run, on runs of
    two requests across page boundaries in scrambled pages, from the same fresh cache bytes: the
    same cache, and the cells outside the runs untouched."""
    gen = torch.Generator().manual_seed(3)
    runs = [("a", 2, 5), ("b", 0, 1), ("b", 3, 6), ("a", 7, 0)]
    caches = []
    for _ in range(2):
        cache = PagedKVCache(3, 8, 4, 5, torch.float32, "cpu", shuffle_seed=2)
        cache.reserve("a", 8)
        cache.reserve("b", 12)
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(4)))
        caches.append(cache)
    kv = torch.randn(3, sum(k for *_, k in runs), 5, generator=gen)
    before = caches[0].kv.clone()
    caches[0].write_many(runs, kv)
    at = 0
    for rid, start, k in runs:
        caches[1].write(rid, start, kv[:, at:at + k])
        at += k
    assert torch.equal(caches[0].kv, caches[1].kv)
    assert int((caches[0].kv != before).any(-1).sum()) == 3 * 12   # 12 tokens' cells, every layer
    assert caches[0].slots([("b", 3, 2)]).tolist() == [caches[0].page_ids("b")[0] * 4 + 3, caches[0].page_ids("b")[1] * 4]
