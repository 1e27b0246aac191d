"""Best-first draft trees in one Triton program per request (the GPU path of ``build_trees``).

Same selection as ``services.draft.tree.build_trees`` (see its docstring for why it is exact): per
depth keep the top-``budget`` of (kept nodes of the previous depth) x (top-k tokens of this depth),
then take the global top-``budget`` over all depths, which is prefix-closed. The torch version
issues ~130 small kernels at budget 64 x depth 15; here everything after the vocabulary top-k is
one launch.

Two things make a depth cheap enough for one program:

* Candidate pruning. Both lists are sorted descending, so the pair (i, j) (i-th kept parent, j-th
  child token) has at least ``(i+1)(j+1) - 1`` pairs at least as good; it can be in the top
  ``budget`` only if ``(i+1)(j+1) <= budget``. That leaves ``sum_i floor(budget/(i+1))`` pairs
  (280 at budget 64, 645 at 128) instead of ``budget * k`` (4096, 16384): one in-register sort of
  512 / 1024 keys per depth.
* Sort keys. A float32 score maps to an int32 with the same order; packed above a 32-bit tie-break
  into an int64, one ``tl.sort`` orders scores and carries the payload (the pair's index).

``algorithm="select"`` skips those full sorts (their compare-exchange stages dominate the kernel):
a radix select finds each depth's top set on the 32-bit ordered scores, a cumsum breaks score ties
as the key does, and only the kept nodes (<= budget) are ordered, by a pairwise rank count; the
global top-budget is the same select. The trees are bit-identical to the default ``"sort"``.

Scores are float32 and add in the same order as the torch version, so they match it bit for bit.
Scratch rows (per request, in global memory, L1/L2 resident) pass sorted lists between threads;
``tl.debug_barrier()`` orders each write before the reads of other threads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.device import on_input_device

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - only where triton is not installed
    triton = None
    tl = None

__all__ = ["tree_build_triton", "candidate_pairs", "ALGORITHMS"]

ALGORITHMS = ("sort", "select")  # tree_build_triton(algorithm=...): "sort" is the default

_PAIRS: dict[tuple[int, int, str], tuple[Tensor, Tensor]] = {}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def candidate_pairs(budget: int, k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """[C_PAD] int32 parent ranks i and child ranks j with ``(i+1)(j+1) <= budget``; -1 pads.

    Cached per (budget, k, device): the first call copies host data to the device, so make it
    (a warm-up) before capturing a CUDA graph.
    """
    key = (budget, k, str(device))
    if key not in _PAIRS:
        pairs = [(i, j) for i in range(budget) for j in range(min(k, budget // (i + 1)))]
        pad = max(_next_pow2(len(pairs)), _next_pow2(budget))
        ci = torch.full((pad,), -1, dtype=torch.int32)
        cj = torch.full((pad,), -1, dtype=torch.int32)
        if pairs:
            ci[: len(pairs)] = torch.tensor([p[0] for p in pairs], dtype=torch.int32)
            cj[: len(pairs)] = torch.tensor([p[1] for p in pairs], dtype=torch.int32)
        _PAIRS[key] = (ci.to(device), cj.to(device))
    return _PAIRS[key]


if triton is not None:

    @triton.jit
    def _ordered_score(score):
        """int32 with the order of float32 ``score`` (-0.0 just below +0.0): the key's high half."""
        bits = score.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as signed int order

    @triton.jit
    def _pack_key(score, index):
        """int64 whose order is (score, then lower index first); score float32, index int32 >= 0."""
        return (_ordered_score(score).to(tl.int64) << 32) + (0x7FFFFFFF - index).to(tl.int64)

    @triton.jit
    def _unpack_score(key):
        ordered = (key >> 32).to(tl.int32)
        bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _unpack_index(key):
        return 0x7FFFFFFF - (key & 0xFFFFFFFF).to(tl.int32)

    @triton.jit
    def _kth_largest(v, k):
        """The k-th largest of int32 ``v`` [N], counting repeats (1 <= k <= N), without a sort.

        Radix select from the most significant digit: 8 passes of 4 bits. A pass counts, for all
        16 values of the next digit at once, the elements at or above ``kth + digit`` ([N, 16]
        compares, one reduction) and keeps the largest digit whose count still reaches k. Plain
        compares and sums rather than ``tl.histogram``, whose masking varies across Triton
        versions; 8 reductions of [N, 16] replace the ~45 compare-exchange stages of a bitonic
        sort of N = 512 int64 keys.

        The 16 thresholds are formed in int64 (``15 << 28`` overflows int32) and then narrowed:
        before each pass ``kth + (16 << shift) <= 2**31`` (the previous pass rejected it, or, on
        the first, it is 2**31), so every threshold fits in int32 and the [N, 16] compares (the
        bulk of the work) stay 32-bit.
        """
        v2 = v[:, None]  # [N, 1] int32
        digits = tl.arange(0, 16).to(tl.int64)[None, :]  # [1, 16]
        kth = tl.full([], -2147483648, tl.int64)  # invariant: count(v >= kth) >= k
        for p in tl.static_range(8):
            cand = (kth + (digits << (28 - 4 * p))).to(tl.int32)  # [1, 16] ascending
            count = tl.sum((v2 >= cand).to(tl.int32), axis=0)  # [16] non-increasing, count[0] >= k
            kth += (tl.sum((count >= k).to(tl.int32), axis=0) - 1).to(tl.int64) << (28 - 4 * p)
        return kth.to(tl.int32)

    @triton.jit
    def _top_k(v, k):
        """The k largest of int32 ``v`` [N] (N < 2**16), ties to the lower position: the set a
        descending sort of ``(v, then lower position first)`` keys puts first.

        Returns (selected [N] bool, pos [N] int32: 0-based rank of a selected element among the
        selected in position order, i.e. where a compaction stores it).
        """
        kth = _kth_largest(v, k)
        above = v > kth
        tie = v == kth
        need = k - tl.sum(above.to(tl.int32), axis=0)  # ties to take, the first ones by position
        # One scan for two prefix counts (each < 2**16): `above` in the high half, ties in the low.
        both = tl.cumsum(above.to(tl.int32) * 65536 + tie.to(tl.int32), 0)  # [N]
        tie_rank = both & 0xFFFF  # 1-based among ties
        selected = above | (tie & (tie_rank <= need))
        pos = (both >> 16) + tl.minimum(tie_rank, need) - 1
        return selected, pos

    @triton.jit
    def _tree_build_kernel(
        top_lp_ptr,  # [R, DEPTH, K] float32, each row sorted descending
        top_tok_ptr,  # [R, DEPTH, K] int64
        root_ptr,  # [R] int64
        cand_i_ptr,  # [C_PAD] int32 parent rank of each candidate pair (-1: padding)
        cand_j_ptr,  # [C_PAD] int32 child rank
        lvl_score_ptr,  # scratch [R, DEPTH, B_PAD] float32 kept nodes per depth, descending
        lvl_tok_ptr,  # scratch [R, DEPTH, B_PAD] int64
        lvl_par_ptr,  # scratch [R, DEPTH, B_PAD] int32 rank of the parent in the previous depth
        keys_ptr,  # scratch [R, S_PAD] int64 sorted keys
        slot_ptr,  # scratch [R, G_PAD] int32 output slot of each kept node (0: not selected)
        tokens_ptr,  # [R, n_max] int64
        parents_ptr,  # [R, n_max] int64
        depths_ptr,  # [R, n_max] int64
        scores_ptr,  # [R, n_max] float32
        sizes_ptr,  # [R] int64
        n_max,
        K: tl.constexpr,
        DEPTH: tl.constexpr,
        BUDGET: tl.constexpr,
        B_PAD: tl.constexpr,
        C_PAD: tl.constexpr,
        G_PAD: tl.constexpr,
        S_PAD: tl.constexpr,
        N_PAD: tl.constexpr,
        SELECT: tl.constexpr,  # True: radix select + rank instead of the full sorts (same result)
    ):
        r = tl.program_id(0).to(tl.int64)
        lp_row = top_lp_ptr + r * DEPTH * K
        tok_row = top_tok_ptr + r * DEPTH * K
        lvl_base = r * DEPTH * B_PAD
        keys_row = keys_ptr + r * S_PAD
        offs_b = tl.arange(0, B_PAD)

        # Depth 1: the top-k tokens themselves, children of the root.
        first_ok = offs_b < K
        tl.store(lvl_score_ptr + lvl_base + offs_b, tl.load(lp_row + offs_b, mask=first_ok, other=float("-inf")))
        tl.store(lvl_tok_ptr + lvl_base + offs_b, tl.load(tok_row + offs_b, mask=first_ok, other=0))
        tl.store(lvl_par_ptr + lvl_base + offs_b, tl.zeros([B_PAD], tl.int32))
        tl.debug_barrier()

        offs_c = tl.arange(0, C_PAD)
        ci = tl.load(cand_i_ptr + offs_c)  # [C_PAD]
        cj = tl.load(cand_j_ptr + offs_c)
        width = tl.zeros([], tl.int32) + K  # kept nodes at the previous depth (a loop-carried tensor)
        for d in range(1, DEPTH):
            ok = (ci >= 0) & (ci < width)
            x = tl.load(lvl_score_ptr + lvl_base + (d - 1) * B_PAD + ci, mask=ok, other=float("-inf"))
            y = tl.load(lp_row + d * K + cj, mask=ok, other=float("-inf"))
            flat = tl.where(ok, ci * K + cj, 0x7FFFFFFF)  # invalid pairs sort last
            keep = tl.minimum(width * K, BUDGET)
            kept = offs_b < keep
            if SELECT:
                # The top-keep set by radix select on the score; ties go to the lower flat index,
                # which is candidate order (candidate_pairs ascends in ci * K + cj), as in the key.
                # Invalid pairs rank below every score, -inf included; at least `keep` pairs are
                # valid (sum_i min(K, BUDGET // (i+1)) over i < width), so none is selected.
                score = x + y  # [C_PAD]
                v = tl.where(ok, _ordered_score(score), -2147483648)
                sel, pos = _top_k(v, keep)
                tl.store(keys_row + pos, _pack_key(score, flat), mask=sel)  # compacted, unordered
                tl.debug_barrier()
                top = tl.load(keys_row + offs_b, mask=kept, other=0)  # [B_PAD] the best pairs
                # Keys are distinct (distinct flat indices): rank = how many kept keys beat it.
                beats = (top[None, :] > top[:, None]) & kept[None, :]  # [B_PAD, B_PAD]
                dest = tl.where(kept, tl.sum(beats.to(tl.int32), axis=1), offs_b)  # a permutation
            else:
                keys = tl.sort(_pack_key(x + y, flat), descending=True)  # [C_PAD]
                tl.store(keys_row + offs_c, keys)
                tl.debug_barrier()
                top = tl.load(keys_row + offs_b)  # [B_PAD] the best pairs, descending
                dest = offs_b
            idx = _unpack_index(top)
            parent = tl.where(kept, idx // K, 0)
            child = tl.where(kept, idx % K, 0)
            base = lvl_base + d * B_PAD + dest  # [B_PAD] descending key order once stored
            tl.store(lvl_score_ptr + base, tl.where(kept, _unpack_score(top), float("-inf")))
            tl.store(lvl_tok_ptr + base, tl.load(tok_row + d * K + child, mask=kept, other=0))
            tl.store(lvl_par_ptr + base, parent)
            width = keep
            tl.debug_barrier()

        # Global top-budget over all depths; ties go to the shallower (earlier) node, as the
        # stable sort of the torch version does, so the selection stays prefix-closed.
        offs_g = tl.arange(0, G_PAD)
        g_ok = offs_g < DEPTH * B_PAD
        score = tl.load(lvl_score_ptr + lvl_base + offs_g, mask=g_ok, other=float("-inf"))  # [G_PAD]
        finite = score > float("-inf")
        if SELECT:
            # Same set as the threshold below: with fewer than BUDGET finite scores, all of them;
            # else the BUDGET best, ties to the lower position (the key's tie-break).
            top_set, _ = _top_k(tl.where(finite, _ordered_score(score), -2147483648), BUDGET)
            selected = top_set & finite & g_ok
        else:
            keys = _pack_key(score, offs_g)
            tl.store(keys_row + offs_g, tl.sort(keys, descending=True))
            tl.debug_barrier()
            threshold = tl.load(keys_row + BUDGET - 1)
            selected = (keys >= threshold) & finite & g_ok
        slot = tl.cumsum(selected.to(tl.int32), 0)  # 1-based output slot in depth-then-rank order
        tl.store(slot_ptr + r * G_PAD + offs_g, tl.where(selected, slot, 0))
        tl.debug_barrier()

        depth = offs_g // B_PAD  # 0-based level; the node's depth is depth + 1
        has_grand = selected & (depth > 0)
        par_rank = tl.load(lvl_par_ptr + lvl_base + offs_g, mask=has_grand, other=0)
        parent_slot = tl.load(slot_ptr + r * G_PAD + (depth - 1) * B_PAD + par_rank, mask=has_grand, other=0)
        out = r * n_max + slot
        tl.store(tokens_ptr + out, tl.load(lvl_tok_ptr + lvl_base + offs_g, mask=selected, other=0), mask=selected)
        tl.store(parents_ptr + out, parent_slot.to(tl.int64), mask=selected)
        tl.store(depths_ptr + out, (depth + 1).to(tl.int64), mask=selected)
        tl.store(scores_ptr + out, score, mask=selected)

        # Root in slot 0, padding after the last selected node (disjoint from the slots above).
        size = 1 + tl.sum(selected.to(tl.int32), 0)
        offs_n = tl.arange(0, N_PAD)
        pad = (offs_n >= size) & (offs_n < n_max)
        is_root = offs_n == 0
        root = tl.load(root_ptr + r)
        row = r * n_max + offs_n
        tl.store(tokens_ptr + row, tl.where(is_root, root, 0), mask=pad | is_root)
        tl.store(parents_ptr + row, tl.full([N_PAD], -1, tl.int64), mask=pad | is_root)
        tl.store(depths_ptr + row, tl.zeros([N_PAD], tl.int64), mask=pad | is_root)
        tl.store(scores_ptr + row, tl.where(is_root, 0.0, float("-inf")), mask=pad | is_root)
        tl.store(sizes_ptr + r, size.to(tl.int64))


class TreeBuildOutput:
    """The five tensors of a tree batch (``services.draft.tree.TreeBatch`` wraps them)."""

    __slots__ = ("tokens", "parents", "depths", "scores", "sizes")

    def __init__(self, tokens: Tensor, parents: Tensor, depths: Tensor, scores: Tensor, sizes: Tensor) -> None:
        self.tokens = tokens  # [R, n_max] int64
        self.parents = parents  # [R, n_max] int64
        self.depths = depths  # [R, n_max] int64
        self.scores = scores  # [R, n_max] float32
        self.sizes = sizes  # [R] int64


@on_input_device
def tree_build_triton(
    logprobs: Tensor, budget: int, root_tokens: Tensor, num_warps: int = 8, algorithm: str = "sort"
) -> TreeBuildOutput:
    """The trees of ``build_trees`` for float32/bf16/fp16 log-probs: vocabulary top-k, then one launch.

    Args:
        logprobs: [R, D, V] log-softmax normalised draft log-probs; row d is depth d+1.
        budget: non-root nodes per tree, 1..128.
        root_tokens: [R] int64 pending token of each request.
        num_warps: warps per request's program. 8 by sweep on an H200 at batch 128, budget 64,
            depth 15: 77 us against 103 (4 warps), 136 (2) and 199 (1); the per-depth sorts are
            latency-bound and more warps shorten each compare-exchange stage.
        algorithm: ``"sort"`` (default) sorts all candidate keys per depth and all kept nodes for
            the global threshold; ``"select"`` finds the same top sets by radix select and orders
            only the kept nodes, by pairwise rank (see ``_kth_largest``): the sorts dominate the
            kernel, and the outputs are bit-identical (tests/test_tree_build.py).

    Returns:
        :class:`TreeBuildOutput` with ``n_max = budget + 1`` columns. No host sync; capturable in
        a CUDA graph after one warm-up call per (budget, k) (see :func:`candidate_pairs`).
    """
    if triton is None:
        raise RuntimeError("tree_build_triton needs triton")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    num_req, depth_limit, vocab = logprobs.shape
    assert 1 <= budget <= 128, f"budget must be in 1..128, got {budget}"
    assert logprobs.dtype in (torch.float32, torch.bfloat16, torch.float16), (
        f"logprobs dtype {logprobs.dtype}: the kernel scores in float32; use the torch builder for float64")
    depth = min(depth_limit, budget)
    assert depth >= 1 and vocab >= 1, "need at least one depth and one token"
    device = logprobs.device
    n_max = budget + 1
    k = min(budget, vocab)
    # Over a 163840-token vocabulary this top-k (torch) costs 2.4-3.6 ms at batch 128 on an H200,
    # 30x the tree itself: the drafter should hand over its top-k (fused into its LM head).
    top_lp, top_tok = logprobs[:, :depth].float().topk(k, dim=-1)  # [R, De, k] each, descending
    top_lp, top_tok = top_lp.contiguous(), top_tok.contiguous()
    ci, cj = candidate_pairs(budget, k, device)
    b_pad = _next_pow2(budget)
    c_pad = ci.numel()
    g_pad = _next_pow2(depth * b_pad)  # <= 2**14: _top_k's packed scan needs < 2**16
    s_pad = max(c_pad, g_pad)
    lvl_score = torch.empty(num_req, depth, b_pad, dtype=torch.float32, device=device)
    lvl_tok = torch.empty(num_req, depth, b_pad, dtype=torch.int64, device=device)
    lvl_par = torch.empty(num_req, depth, b_pad, dtype=torch.int32, device=device)
    keys = torch.empty(num_req, s_pad, dtype=torch.int64, device=device)
    slots = torch.empty(num_req, g_pad, dtype=torch.int32, device=device)
    out = TreeBuildOutput(
        tokens=torch.empty(num_req, n_max, dtype=torch.int64, device=device),
        parents=torch.empty(num_req, n_max, dtype=torch.int64, device=device),
        depths=torch.empty(num_req, n_max, dtype=torch.int64, device=device),
        scores=torch.empty(num_req, n_max, dtype=torch.float32, device=device),
        sizes=torch.empty(num_req, dtype=torch.int64, device=device),
    )
    if num_req == 0:
        return out
    _tree_build_kernel[(num_req,)](
        top_lp, top_tok, root_tokens.to(device=device, dtype=torch.int64).contiguous(), ci, cj,
        lvl_score, lvl_tok, lvl_par, keys, slots,
        out.tokens, out.parents, out.depths, out.scores, out.sizes,
        n_max,
        K=k, DEPTH=depth, BUDGET=budget, B_PAD=b_pad, C_PAD=c_pad, G_PAD=g_pad, S_PAD=s_pad,
        N_PAD=_next_pow2(n_max), SELECT=algorithm == "select", num_warps=num_warps,
    )
    return out
