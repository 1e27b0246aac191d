"""The drafter's context pool without a model behind it: its rows, its bucket choices and what it
reports (the pooled drafter's outputs are checked against the eager one in test_dflash.py)."""

from __future__ import annotations

import pytest
import torch

from services.draft.propose_graphs import COMMIT_BUCKETS, ProposeGraphs


def _pool(rows: int, context: int) -> ProposeGraphs:
    """A pool whose forward and commit must not run: enough for its rows and bucket choices."""
    def forward(bonus, lengths, context_kv, l_pad):
        raise AssertionError("no forward expected")

    def context_kv(features, positions):
        raise AssertionError("no commit expected")

    return ProposeGraphs(forward, context_kv, num_features=4, num_layers=1, kv_heads=1, head_dim=2, rows=rows,
                         context=context, out_shape=(2, 3), dtype=torch.float32, device=torch.device("cpu"),
                         capture=False)


def test_a_propose_and_a_commit_take_the_smallest_bucket_that_holds_them() -> None:
    """A call exactly on a bucket uses that bucket: a batch of every pool row or a context filling
    its row still replays (rather than falling to the eager forward, 5-9 ms of host time a step),
    and no step pads to a bucket twice its size."""
    g = _pool(rows=4, context=200)
    assert g.batch_buckets == (1, 2, 4)   # each size once, the pool's own size last
    assert g.context_buckets == (64, 128, 192, 200)
    assert g.bucket_for(1, 1) == (1, 64)
    assert g.bucket_for(2, 64) == (2, 64)        # exactly on both buckets
    assert g.bucket_for(3, 65) == (4, 128)       # just past them: the next ones
    assert g.bucket_for(4, 200) == (4, 200)      # a full pool of full rows still replays
    assert g.bucket_for(5, 10) is None and g.bucket_for(4, 201) is None
    # A commit likewise: the smallest token bucket, the largest included, and None past it (eager).
    assert [g.extend_bucket(t) for t in (1, 16, 17, 2048)] == [16, 16, 32, 2048]
    assert COMMIT_BUCKETS[0] == 16 and COMMIT_BUCKETS[-1] == 2048
    assert g.extend_bucket(COMMIT_BUCKETS[-1] + 1) is None


def test_a_pool_reports_its_bytes_and_captures_and_holds_its_scratch_row_out() -> None:
    """`pool_bytes` is what start-up logs as `pool_mb` (keys and values both); the commits'
    scratch row (index `rows`) is never a request's; an empty pool is refused where it is made;
    without capture (the CPU path) `captured`, the GPU checks' list, is empty."""
    g = _pool(rows=3, context=64)
    assert g.pool_bytes == g.keys.nbytes + g.values.nbytes == 2 * (1 * 4 * 64 * 1 * 2) * 4
    with pytest.raises(AssertionError):
        g.release(g.rows)
    assert g.free_rows == 3
    for rows, context in ((0, 64), (2, 0)):
        with pytest.raises(ValueError, match="rows >= 1 and context >= 1"):
            _pool(rows, context)
    assert g.warm_up(g.batch_buckets, g.context_buckets) == 0 and g.captured == []
