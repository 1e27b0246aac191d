"""The batched tree builder must select exactly what the heapq reference selects."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from services.draft.tree import (TreeBatch, ancestor_mask, build_tree_heapq, build_trees, build_trees_from_logits,
                                 tree_paths)

BUDGETS = [0, 1, 2, 7, 16, 32, 64, 128]


def random_logprobs(gen: torch.Generator, num_req: int, depth: int, vocab: int) -> torch.Tensor:
    """Peaked-ish random log-softmax tables; float64 so both builders round identically."""
    scale = 0.5 + 4.0 * torch.rand(num_req, depth, 1, generator=gen, dtype=torch.float64)
    logits = torch.randn(num_req, depth, vocab, generator=gen, dtype=torch.float64) * scale  # [R, D, V]
    return torch.log_softmax(logits, dim=-1)


def check_structure(batch: TreeBatch, logprobs: torch.Tensor, root_tokens: torch.Tensor) -> None:
    """Properties every tree must satisfy, independent of the reference."""
    num_req, n_max = batch.tokens.shape
    tol = 1e-9 if batch.scores.dtype == torch.float64 else 1e-5
    for r in range(num_req):
        size = int(batch.sizes[r])
        assert 1 <= size <= n_max
        assert int(batch.tokens[r, 0]) == int(root_tokens[r])
        assert int(batch.parents[r, 0]) == -1 and int(batch.depths[r, 0]) == 0
        assert float(batch.scores[r, 0]) == 0.0
        parents = batch.parents[r].tolist()
        depths = batch.depths[r].tolist()
        tokens = batch.tokens[r].tolist()
        scores = batch.scores[r].tolist()
        path_score = [0.0] * n_max
        for i in range(1, size):
            p = parents[i]
            assert 0 <= p < i, "parent index must precede the child"
            assert depths[i] == depths[p] + 1
            path_score[i] = path_score[p] + float(logprobs[r, depths[i] - 1, tokens[i]])
            assert scores[i] == pytest.approx(path_score[i], abs=tol)
            assert scores[i] <= scores[p]
        # Output order: depth ascending, score descending within a depth.
        for i in range(2, size):
            assert (depths[i - 1], -scores[i - 1]) <= (depths[i], -scores[i])
        for i in range(size, n_max):
            assert (tokens[i], parents[i], depths[i]) == (0, -1, 0)
            assert scores[i] == float("-inf")
        # Prefix-closed: every prefix of a selected prefix is selected.
        prefixes = tree_paths(batch, r)
        assert len(prefixes) == size - 1
        for prefix in prefixes:
            assert len(prefix) == 1 or prefix[:-1] in prefixes


def test_matches_heapq_on_random_tables() -> None:
    gen = torch.Generator().manual_seed(1234)
    rng = random.Random(1234)
    cases = [(d, v, b) for d in (1, 3, 15) for v in (5, 50, 300) for b in BUDGETS] * 3
    for depth, vocab, budget in cases:
        num_req = rng.randint(1, 4)
        logprobs = random_logprobs(gen, num_req, depth, vocab)  # [R, D, V]
        roots = torch.randint(0, vocab, (num_req,), generator=gen)
        batch = build_trees(logprobs, budget, roots)
        assert batch.tokens.shape == (num_req, budget + 1)
        check_structure(batch, logprobs, roots)
        for r in range(num_req):
            expected = build_tree_heapq(logprobs[r], budget)
            assert len(expected) == len(set(expected))
            got = tree_paths(batch, r)
            assert got == set(expected), (depth, vocab, budget, r)
            depth_counts = Counter(batch.depths[r, 1 : int(batch.sizes[r])].tolist())
            assert depth_counts == Counter(len(p) for p in expected)


def test_heapq_pops_best_first() -> None:
    logprobs = random_logprobs(torch.Generator().manual_seed(7), 1, 4, 20)[0]  # [D, V]
    prefixes = build_tree_heapq(logprobs, 40)
    scores = [sum(float(logprobs[d, t]) for d, t in enumerate(p)) for p in prefixes]
    assert scores == sorted(scores, reverse=True)
    # Brute force over all prefixes of depth <= 2 agrees where the selection stays that shallow.
    shallow = build_tree_heapq(logprobs[:2], 10)
    every = [(a,) for a in range(20)] + [(a, b) for a in range(20) for b in range(20)]
    every.sort(key=lambda p: -sum(float(logprobs[d, t]) for d, t in enumerate(p)))
    assert set(shallow) == set(every[:10])


def test_tiny_vocab_pads() -> None:
    logprobs = torch.log_softmax(torch.tensor([[[0.3, -0.2]] * 3, [[1.0, 2.0]] * 3]), dim=-1)  # [2, 3, 2]
    roots = torch.tensor([5, 6])
    batch = build_trees(logprobs, 64, roots)
    assert batch.tokens.shape == (2, 65)
    assert batch.sizes.tolist() == [15, 15]  # root + 2 + 4 + 8
    check_structure(batch, logprobs, roots)
    for r in range(2):
        assert Counter(batch.depths[r, 1:15].tolist()) == {1: 2, 2: 4, 3: 8}
        assert tree_paths(batch, r) == set(build_tree_heapq(logprobs[r], 64))


def test_budget_zero_is_root_only() -> None:
    logprobs = torch.log_softmax(torch.randn(3, 5, 11), dim=-1)
    roots = torch.tensor([1, 2, 3])
    batch = build_trees(logprobs, 0, roots)
    assert batch.tokens.tolist() == [[1], [2], [3]]
    assert batch.parents.tolist() == [[-1]] * 3
    assert batch.sizes.tolist() == [1, 1, 1]
    assert build_tree_heapq(logprobs[0], 0) == []


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_depth_cap_of_zero_is_root_only_and_a_negative_one_is_refused(backend) -> None:
    """`max_depth=-1` sliced the table from its end (a tree one level short of the block, not a
    root); 0 tripped the Triton kernel's assertion while the torch path built root-only trees."""
    lp = torch.log_softmax(torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(3)), -1)
    roots = torch.tensor([5, 6])
    tb = build_trees(lp, 8, roots, backend=backend, max_depth=0)
    assert tb.sizes.tolist() == [1, 1] and tb.tokens[:, 0].tolist() == [5, 6]
    with pytest.raises(ValueError, match="max_depth must be >= 0"):
        build_trees(lp, 8, roots, backend=backend, max_depth=-1)


def test_deep_block_and_impossible_tokens() -> None:
    """D = 31 (block 32), and -inf log-probs are never selected, on both builders."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 31, 6, generator=gen, dtype=torch.float64)
    logits[:, :, 3:] = float("-inf")  # only 3 possible tokens per depth
    logits[1, 1, 1:] = float("-inf")  # request 1: a single possible token at depth 2
    logprobs = torch.log_softmax(logits, dim=-1)
    roots = torch.tensor([0, 0])
    for budget in (5, 128):
        batch = build_trees(logprobs, budget, roots)
        check_structure(batch, logprobs, roots)
        for r in range(2):
            got = tree_paths(batch, r)
            assert got == set(build_tree_heapq(logprobs[r], budget))
            assert all(t < 3 for p in got for t in p)
    assert int(batch.sizes[1]) == 129


def test_float32_and_budget_checks() -> None:
    logprobs = torch.log_softmax(torch.randn(2, 4, 40), dim=-1)  # float32
    batch = build_trees(logprobs, 16, torch.zeros(2, dtype=torch.int64))
    assert batch.scores.dtype == torch.float32
    check_structure(batch, logprobs.double(), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="budget"):
        build_trees(logprobs, 129, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="budget"):
        build_tree_heapq(logprobs[0], -1)


def test_ancestor_mask() -> None:
    #      0
    #     / \
    #    1   2
    #   / \   \
    #  3   4   5    (6 is padding)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, -1])
    mask = ancestor_mask(parents)
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {6}}
    for i, visible in expected.items():
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == visible
    # A chain (prefill) gives the causal lower triangle; batched input broadcasts.
    chain = torch.arange(-1, 9)
    assert torch.equal(ancestor_mask(chain), torch.ones(10, 10, dtype=torch.bool).tril())
    both = ancestor_mask(torch.stack([parents, parents]))
    assert torch.equal(both[1], mask)


def test_ancestor_mask_matches_built_tree() -> None:
    logprobs = torch.log_softmax(torch.randn(1, 6, 9), dim=-1)
    batch = build_trees(logprobs, 32, torch.zeros(1, dtype=torch.int64))
    parents = batch.parents[0].tolist()
    mask = ancestor_mask(batch.parents[0])
    for i in range(int(batch.sizes[0])):
        chain, j = {i}, parents[i]
        while j >= 0:
            chain.add(j)
            j = parents[j]
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == chain


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
def test_cuda_no_sync_and_graph_capture() -> None:
    """On the GPU the builder must not sync the host and must replay inside a CUDA graph."""
    gen = torch.Generator().manual_seed(11)
    logprobs = random_logprobs(gen, 8, 15, 300).float().cuda()  # [R, D, V]
    roots = torch.randint(0, 300, (8,), generator=gen).cuda()
    build_trees(logprobs, 64, roots)  # warm up kernels / allocator outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = build_trees(logprobs, 64, roots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for r in range(8):
        assert tree_paths(eager, r) == set(build_tree_heapq(logprobs[r].double().cpu(), 64))

    static_in = logprobs.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        build_trees(static_in, 64, roots)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = build_trees(static_in, 64, roots)
    fresh = torch.log_softmax(torch.randn(8, 15, 300, device="cuda"), dim=-1)
    static_in.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    expected = build_trees(fresh, 64, roots)
    for name in ("tokens", "parents", "depths", "sizes"):
        assert torch.equal(getattr(static_out, name), getattr(expected, name)), name


FIELDS = ("tokens", "parents", "depths", "scores", "sizes")


def test_cpu_trees_from_half_precision_logits_normalise_in_float32() -> None:
    """build_trees_from_logits (torch path) must take the log-softmax of bf16/fp16 logits in
    float32: the same trees and scores as build_trees of log_softmax(logits.float()). A log-softmax
    in the logits' own dtype would round every log-prob to 8 (bf16) mantissa bits, so scores shift
    by up to ~1e-2 and near-tied candidates swap."""
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.bfloat16, torch.float16):
        logits = (torch.randn(3, 4, 97, generator=gen) * 3 + 7).to(dtype)  # [R, D, V]
        roots = torch.randint(0, 97, (3,), generator=gen)
        got = build_trees_from_logits(logits, 24, roots, backend="torch")
        want = build_trees(torch.log_softmax(logits.float(), dim=-1), 24, roots, backend="torch")
        assert got.scores.dtype == torch.float32
        for f in FIELDS:
            assert torch.equal(getattr(got, f), getattr(want, f)), (dtype, f)


def test_torch_builder_accumulates_half_precision_scores_in_float32() -> None:
    """build_trees on bf16/fp16 log-probs (torch backend) returns float32 scores that are the
    float32 sums of the bf16 entries along each path (exact here: few terms, float64 check). Adding
    in the input dtype would round every partial sum to bf16, giving a bf16 score tensor whose
    deeper scores are off by up to a few 1e-2 and a tree that can differ from the float32 one."""
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16):
        lp = torch.log_softmax(torch.randn(2, 5, 40, generator=gen) * 2, dim=-1).to(dtype)  # [R, D, V]
        roots = torch.zeros(2, dtype=torch.int64)
        got = build_trees(lp, 32, roots, backend="torch")
        want = build_trees(lp.float(), 32, roots, backend="torch")
        assert got.scores.dtype == torch.float32
        for f in FIELDS:
            assert torch.equal(getattr(got, f), getattr(want, f)), (dtype, f)
