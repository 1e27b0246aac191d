"""Best-first draft trees: the ``heapq`` reference and the batched GPU builder.

A draft tree is the set of the ``budget`` most probable token prefixes under the drafter's
per-position distributions. DFlash predicts one distribution per block position that does not
depend on the tokens before it, so a prefix ``(t1, ..., td)`` scores
``logprobs[0, t1] + ... + logprobs[d-1, td]``. Because every log-prob is <= 0 a child never
outscores its parent, so the top-``budget`` set is prefix-closed, i.e. a tree.

Both builders require **log-softmax normalised** input (every entry <= 0, ``-inf`` allowed for
impossible tokens). Unnormalised logits break the "child <= parent" property the batched
selection relies on, and the two builders would then disagree. Tokens with log-prob ``-inf`` are
never selected.

``build_tree_heapq`` is the baseline (classic lazy best-first search); ``build_trees`` is the
batched, sync-free, graph-capturable version. Tests check they agree. The draft service calls
``build_trees_from_logits`` with its drafter's logits: ``build_trees`` of their log-softmax, whose
GPU path takes each depth's top-k log-probs straight from the logits (``kernels.vocab_topk``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["TreeBatch", "build_tree_heapq", "build_trees", "build_trees_from_logits", "tree_paths", "ancestor_mask",
           "warm_up_tree_builds"]

MAX_BUDGET = 128


@dataclass
class TreeBatch:
    """A batch of draft trees, one per request, padded to ``n_max = budget + 1`` nodes.

    Node 0 is the root (the pending token). Valid nodes follow ordered by depth ascending, then
    score descending; ``parents[r, i] < i`` for every valid non-root node. Nodes at index
    ``>= sizes[r]`` are padding: token 0, parent -1, depth 0, score ``-inf``.

    tokens:  [R, n_max] int64  token id of each node
    parents: [R, n_max] int64  index of the parent node within the same tree (root and padding -1)
    depths:  [R, n_max] int64  root 0; a node sits at position ``L + depth``
    scores:  [R, n_max] float  cumulative draft log-prob of the node's prefix (root 0)
    sizes:   [R] int64         valid nodes per tree, root included
    """

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    scores: Tensor
    sizes: Tensor

    @property
    def n_max(self) -> int:
        return self.tokens.shape[1]


@dataclass(order=True)
class _HeapEntry:
    """One frontier node of the lazy best-first search (min-heap, hence the negated score)."""

    neg_score: float
    ranks: tuple[int, ...]  # per-depth rank into that depth's sorted top-k; ties break on it
    parent_score: float = field(compare=False)


def _check_budget(budget: int) -> None:
    if not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be in 0..{MAX_BUDGET}, got {budget}")


def build_tree_heapq(logprobs: Tensor, budget: int) -> list[tuple[int, ...]]:
    """Select the ``budget`` best prefixes with a lazy heap; the readable reference.

    Args:
        logprobs: [D, V] log-softmax normalised draft log-probs, row d for depth d+1.
        budget: number of non-root nodes wanted (0..128).

    Returns:
        The selected prefixes as tuples of token ids (root excluded), in best-first pop order.
        Fewer than ``budget`` when the vocabulary/depth cannot supply more finite-score prefixes.

    A node is a path of ranks into each depth's sorted children. Popping a node pushes its first
    child and its next sibling, which are the only two nodes that can become the best remaining
    one, so the heap stays O(budget) in size. Scores add in float64 (Python floats); for float64
    input that rounds exactly like :func:`build_trees`, so tests compare the two bit for bit.
    """
    _check_budget(budget)
    depth_limit, vocab = logprobs.shape
    if budget == 0 or depth_limit == 0:
        return []
    k = min(budget, vocab)
    values, indices = logprobs.double().topk(k, dim=-1)  # [D, k] sorted descending
    lp: list[list[float]] = values.tolist()
    tok: list[list[int]] = indices.tolist()

    heap = [_HeapEntry(-(0.0 + lp[0][0]), (0,), 0.0)]
    selected: list[tuple[int, ...]] = []
    while heap and len(selected) < budget:
        entry = heapq.heappop(heap)
        score = -entry.neg_score
        if score == float("-inf"):
            break  # everything left is impossible
        ranks = entry.ranks
        depth = len(ranks)  # 1-based
        selected.append(tuple(tok[d][r] for d, r in enumerate(ranks)))
        if depth < depth_limit:
            heapq.heappush(heap, _HeapEntry(-(score + lp[depth][0]), ranks + (0,), score))
        nxt = ranks[-1] + 1
        if nxt < k:
            sibling_score = entry.parent_score + lp[depth - 1][nxt]
            heapq.heappush(heap, _HeapEntry(-sibling_score, ranks[:-1] + (nxt,), entry.parent_score))
    return selected


def build_trees(logprobs: Tensor, budget: int, root_tokens: Tensor, *, backend: str | None = None,
                max_depth: int | None = None) -> TreeBatch:
    """Build the best-first tree of every request at once, with no host sync.

    Args:
        logprobs: [R, D, V] log-softmax normalised draft log-probs (float); row d is depth d+1.
        budget: non-root nodes per tree (0..128); sets the static width ``n_max = budget + 1``.
        root_tokens: [R] int64 pending token of each request (the tree roots).
        max_depth: the deepest level a tree may have (default D): the trees of
            ``logprobs[:, :max_depth]``. The Triton kernel takes it at run time, so a request near
            its context end (a shallower tree) runs the kernel compiled for the full depth.

    Returns:
        A :class:`TreeBatch` with the prefixes :func:`build_tree_heapq` selects: the same ones
        wherever scores are distinct; among candidates of exactly equal score the two may keep
        different ones (each tie broken its own way), with the same selected scores.

    Per depth d the candidates are (the <= budget nodes kept at depth d-1) x (the top-k tokens of
    depth d, k = min(budget, V)); the top-``budget`` are kept. Any node of the global top-budget
    is within the top-budget of its own depth, and its parent is too, so nothing is lost. The
    global top-budget over the depth-ascending concatenation (stable sort, so a parent wins a tie
    with its child) is prefix-closed, and that concatenation is already in the output order
    (depth asc, score desc), so compaction is a cumsum + scatter. All loop bounds are static
    (from shapes and ``budget``): no host sync, capturable in a CUDA graph.

    ``backend``: ``"triton"`` runs it as one kernel (``kernels.tree_build``; float32/bf16/fp16
    input; above 128 tokens a torch.topk of the vocabulary first), ``"torch"`` the tensor ops here
    (~130 small kernels at budget 64, depth 15). Default: triton on CUDA for non-float64 input, else torch.
    The two select the same trees (tests/test_tree_build.py). Budgets share 10 compiled
    kernels (``kernels.tree_build.pads_budget``; seconds each to compile): the draft compiles them
    all at start-up (``warm_up_kernels``), before graph capture.
    """
    if max_depth is not None and max_depth < 0:   # a slice would count it from the end
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    if _backend(logprobs, backend) == "triton":
        _check_budget(budget)
        if budget > 0 and logprobs.shape[1] > 0 and logprobs.shape[2] > 0 and max_depth != 0:
            from kernels.tree_build import tree_build_triton  # kernels import TreeBatch's module lazily

            out = tree_build_triton(logprobs, budget, root_tokens, max_depth=max_depth)
            return TreeBatch(out.tokens, out.parents, out.depths, out.scores, out.sizes)
    return _build_trees_torch(logprobs[:, :max_depth], budget, root_tokens)


def build_trees_from_logits(logits: Tensor, budget: int, root_tokens: Tensor, *, backend: str | None = None,
                            max_depth: int | None = None) -> TreeBatch:
    """``build_trees`` of ``log_softmax(logits)`` (any float dtype; ``[R, D, V]``).

    Why not normalise first: over a large vocabulary the float32 log-softmax of every row, then
    ``torch.topk`` of it, cost as much as the drafter's LM head (Kimi-K2's 163840 tokens, batch
    128: 5.6 ms on an H200, 2.5 ms this way; ``bench/results/vocab_topk.json``). The
    Triton path takes only each depth's top ``min(budget, V)`` log-probs (``kernels.vocab_topk``:
    the top-k of the logits in their own dtype, less each row's log-sum-exp) and builds from
    them; the torch path (CPU) and vocabularies of at most ``SORT_VOCAB_MAX`` tokens normalise
    and call ``build_trees``. The log-probs are ``logit - logsumexp`` in float32,
    so a tree may differ from one built on ``torch.log_softmax``'s only where two candidates' scores
    are within float32 rounding, or where tied logits are ranked in another order.
    """
    backend = _backend(logits, backend)
    num_req, depth_limit, vocab = logits.shape
    depth = min(depth_limit, budget, depth_limit if max_depth is None else max_depth)
    if depth < 1:
        backend = "torch"   # a root-only tree: nothing to rank
    if backend == "triton" and num_req > 0:
        from kernels.tree_build import SORT_VOCAB_MAX, tree_build_triton   # kernels import this module lazily
        from kernels.vocab_topk import vocab_topk

        if vocab > SORT_VOCAB_MAX:
            _check_budget(budget)
            top = vocab_topk(logits[:, :depth], min(budget, vocab))
            out = tree_build_triton(logits, budget, root_tokens, max_depth=depth, top=top)
            return TreeBatch(out.tokens, out.parents, out.depths, out.scores, out.sizes)
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return build_trees(logprobs, budget, root_tokens, backend=backend, max_depth=max_depth)


def warm_up_tree_builds(depth: int, vocab: int, dtype: torch.dtype, device: torch.device | str, max_budget: int,
                        budgets: Sequence[int], batch_sizes: Sequence[int]) -> None:
    """Compiles every kernel that building trees from the drafter's ``[R, depth, vocab]`` logits
    launches, for budgets 1..``max_budget`` (seconds each, on the first request otherwise), and
    runs ``budgets`` at ``batch_sizes`` once (budget 1 at batch 1 where none are given: the
    log-sum-exp kernel compiles on that first call)."""
    from kernels.tree_build import warm_up_kernels   # kernels import this module lazily

    warm_up_kernels(depth, vocab, device, max_budget)
    for budget in budgets or (1,):
        for r in batch_sizes or (1,):
            logits = torch.randn(r, depth, vocab, device=device).to(dtype)  # [r, D, V]
            build_trees_from_logits(logits, budget, torch.zeros(r, dtype=torch.int64, device=device))


def _backend(scores: Tensor, backend: str | None) -> str:
    """The builder ``backend`` names, checked; by default Triton on CUDA for non-float64 input."""
    if backend is None:
        return "triton" if scores.is_cuda and scores.dtype != torch.float64 and _triton_available() else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
    return backend


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _build_trees_torch(logprobs: Tensor, budget: int, root_tokens: Tensor) -> TreeBatch:
    """The tensor-op version of :func:`build_trees` (CPU, float64, and the reference on GPU)."""
    _check_budget(budget)
    num_req, depth_limit, vocab = logprobs.shape
    device = logprobs.device
    work_dtype = torch.promote_types(logprobs.dtype, torch.float32)
    n_max = budget + 1
    neg_inf = float("-inf")

    tokens = torch.zeros(num_req, n_max + 1, dtype=torch.int64, device=device)  # +1: dump column
    parents = torch.full((num_req, n_max + 1), -1, dtype=torch.int64, device=device)
    depths = torch.zeros(num_req, n_max + 1, dtype=torch.int64, device=device)
    scores = torch.full((num_req, n_max + 1), neg_inf, dtype=work_dtype, device=device)
    tokens[:, 0] = root_tokens.to(device=device, dtype=torch.int64)
    scores[:, 0] = 0.0
    # No node deeper than `budget` can be selected: it needs all its ancestors selected too.
    depth_eff = min(depth_limit, budget)
    if depth_eff == 0:
        sizes = torch.ones(num_req, dtype=torch.int64, device=device)
        return TreeBatch(tokens[:, :n_max], parents[:, :n_max], depths[:, :n_max], scores[:, :n_max], sizes)

    k = min(budget, vocab)
    top_lp, top_tok = logprobs[:, :depth_eff].to(work_dtype).topk(k, dim=-1)  # [R, De, k] desc

    # Per depth: the kept nodes' scores, tokens, and parent as a 1-based index into the
    # depth-ascending concatenation of all levels (0 = root), so one gather remaps them all later.
    level_scores = [top_lp[:, 0]]  # [R, k]
    level_tokens = [top_tok[:, 0]]  # [R, k]
    level_parents = [torch.zeros(num_req, k, dtype=torch.int64, device=device)]  # [R, k]
    prev_offset = 0  # where the previous level starts in the concatenation
    for d in range(1, depth_eff):
        width = level_scores[-1].shape[1]
        cand = level_scores[-1][:, :, None] + top_lp[:, d, None, :]  # [R, width, k]
        keep = min(budget, width * k)
        kept_scores, kept_idx = cand.reshape(num_req, width * k).topk(keep, dim=-1)  # [R, keep]
        level_scores.append(kept_scores)
        level_tokens.append(top_tok[:, d].gather(1, kept_idx % k))  # [R, keep]
        level_parents.append(kept_idx // k + 1 + prev_offset)  # [R, keep]
        prev_offset += width

    # Concatenate depth-ascending; each level is already score-descending.
    widths = [s.shape[1] for s in level_scores]
    cat_scores = torch.cat(level_scores, dim=1)  # [R, M]
    cat_tokens = torch.cat(level_tokens, dim=1)  # [R, M]
    cat_parents = torch.cat(level_parents, dim=1)  # [R, M]
    # Built from fills (not repeat_interleave with tensor repeats, which syncs to size its output).
    cat_depths = torch.cat(
        [torch.full((w,), d + 1, dtype=torch.int64, device=device) for d, w in enumerate(widths)]
    ).expand(num_req, -1)  # [R, M]
    total = cat_scores.shape[1]

    # Global top-budget: stable descending sort keeps the depth-ascending order among ties.
    order = torch.sort(cat_scores, dim=1, descending=True, stable=True).indices  # [R, M]
    in_top = (torch.arange(total, device=device) < budget).expand(num_req, -1)  # [R, M] sorted order
    selected = torch.zeros(num_req, total, dtype=torch.bool, device=device).scatter(1, order, in_top)
    selected &= cat_scores > neg_inf  # [R, M]

    # Output slot of each concatenated node: 1 + rank among selected; unselected -> dump column.
    slot = torch.where(selected, torch.cumsum(selected, dim=1), n_max)  # [R, M]
    slot_with_root = torch.cat([torch.zeros(num_req, 1, dtype=torch.int64, device=device), slot], dim=1)
    new_parents = slot_with_root.gather(1, cat_parents)  # [R, M]

    tokens.scatter_(1, slot, cat_tokens)
    parents.scatter_(1, slot, new_parents)
    depths.scatter_(1, slot, cat_depths)
    scores.scatter_(1, slot, cat_scores)
    sizes = 1 + selected.sum(dim=1)  # [R]
    # Drop the dump column; contiguous so the batch can go to a transport buffer as is.
    return TreeBatch(
        tokens[:, :n_max].contiguous(),
        parents[:, :n_max].contiguous(),
        depths[:, :n_max].contiguous(),
        scores[:, :n_max].contiguous(),
        sizes,
    )


def tree_paths(batch: TreeBatch, r: int) -> set[tuple[int, ...]]:
    """Token prefixes (root excluded) of request ``r``'s valid nodes; for tests and debugging."""
    size = int(batch.sizes[r])
    tokens = batch.tokens[r, :size].tolist()
    parents = batch.parents[r, :size].tolist()
    prefixes: list[tuple[int, ...]] = [()]
    for i in range(1, size):
        prefixes.append(prefixes[parents[i]] + (tokens[i],))
    return set(prefixes[1:])


def ancestor_mask(parents: Tensor) -> Tensor:
    """Tree-attention visibility: ``mask[..., i, j]`` is True iff j is i or an ancestor of i.

    Args:
        parents: [..., n] int64 parent index per node, -1 for the root and for padding.

    Returns:
        [..., n, n] bool. Padding nodes see only themselves.

    Built as a transitive closure by repeated squaring (ceil(log2 n) boolean matmuls), a fixed
    number of ops with no host sync.
    """
    n = parents.shape[-1]
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)  # [n, n]
    has_parent = parents >= 0  # [..., n]
    direct = torch.nn.functional.one_hot(parents.clamp(min=0), n).bool() & has_parent[..., None]  # [..., n, n]
    mask = eye | direct
    reach = 1
    while reach < n:
        m = mask.float()
        mask = mask | (m @ m > 0)
        reach *= 2
    return mask
