"""TreeGraphs: the draft's tree build over the propose graphs' output buffer, one copy to the host.

The CPU runs its eager path (``capture=False``): the same packed build the GPU captures, so these
tests check the bucket padding, the packing and which calls it takes. The GPU check of the
captured path is ``bench/draft_probe.py --graphs`` (trees equal to the eager build's)."""

from __future__ import annotations

import pytest
import torch

from services.draft.propose_graphs import batch_buckets
from services.draft.tree import build_trees, build_trees_from_logits
from services.draft.tree_graphs import TreeGraphs, pack_trees, unpack_trees


def _buffer(rows: int, depth: int = 5, vocab: int = 40, seed: int = 0) -> torch.Tensor:
    """Logits, as the propose graphs write them (not normalised: the build normalises)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, depth, vocab, generator=gen) * 3 + 2   # [rows, D, V] float32


def test_pack_roundtrip() -> None:
    buf = _buffer(3)
    roots = torch.tensor([7, 8, 9])
    batch = build_trees(torch.log_softmax(buf, dim=-1), 6, roots)
    packed = pack_trees(batch)
    assert packed.shape == (3, 1 + 3 * 7) and packed.dtype == torch.int64
    sizes, tokens, parents, depths = unpack_trees(packed, 2)
    assert torch.equal(sizes, batch.sizes[:2]) and torch.equal(tokens, batch.tokens[:2])
    assert torch.equal(parents, batch.parents[:2]) and torch.equal(depths, batch.depths[:2])
    packed.fill_(-5)  # the host block is reused by the next call: what was returned must not change
    assert torch.equal(tokens, batch.tokens[:2])


@pytest.mark.parametrize("rows,budget", [(1, 4), (3, 16), (5, 7), (8, 1)])
def test_equals_the_eager_build(rows: int, budget: int) -> None:
    """Leading rows of the buffer (what a replayed propose returns), any batch inside a bucket:
    the same trees as ``build_trees_from_logits`` on those rows, though the bucket's padding rows
    are built too."""
    buf = _buffer(8)
    graphs = TreeGraphs(buf, capture=False)
    assert graphs.batch_buckets == batch_buckets(8)
    roots = torch.arange(rows) + 3
    got = graphs.build(buf[:rows], budget, 5, roots)
    want = build_trees_from_logits(buf[:rows], budget, roots)
    assert got is not None
    for g, w in zip(got, (want.sizes, want.tokens, want.parents, want.depths)):
        assert torch.equal(g, w)
    again = graphs.build(buf[:rows], budget, 5, roots + 1)  # the same graph, new roots
    assert again is not None and torch.equal(again[1][:, 0], roots + 1)


def test_only_the_buffer_replays() -> None:
    """A propose that ran eagerly returns its own tensor, and a shallower tree than the buffer's
    is built eagerly too (no graph per depth)."""
    buf = _buffer(4)
    graphs = TreeGraphs(buf, capture=False)
    roots = torch.zeros(2, dtype=torch.int64)
    assert graphs.build(buf[:2].clone(), 4, 5, roots) is None   # another tensor
    assert graphs.build(buf[1:3], 4, 5, roots) is None          # not the leading rows
    assert graphs.build(buf[:2], 4, 6, roots) is None           # deeper than the buffer
    assert graphs.build(buf[:2], 4, 3, roots) is None           # shallower: near a context limit, eager
    assert graphs.build(buf[:2], 4, 5, roots) is not None
    assert graphs.captured == []                                 # nothing is captured on the CPU path


def test_a_view_at_the_buffers_address_with_other_strides_or_shape_is_built_eagerly() -> None:
    """`holds` asks for the buffer's leading rows exactly: a view that starts at its address but
    reads other elements (rows repeated, a narrower vocabulary) is not what the graph builds from."""
    buf = _buffer(4)
    graphs = TreeGraphs(buf, capture=False)
    roots = torch.tensor([3, 4])
    repeated = buf[:1].expand(2, *buf.shape[1:])      # row 0 twice: same address, stride 0
    narrow = buf[:2, :, :30]                          # same address and strides, 30 of 40 logits
    for view in (repeated, narrow):
        assert view.data_ptr() == buf.data_ptr()
        assert graphs.build(view, 4, 5, roots) is None
    assert graphs.build(buf[:2], 4, 5, roots) is not None    # the leading rows themselves replay
