"""Best-first draft trees in one Triton program per request (the GPU path of ``build_trees``).

Same selection as ``services.draft.tree.build_trees`` (see its docstring for why it is exact): per
depth keep the top-``budget`` of (kept nodes of the previous depth) x (top-k tokens of this depth),
then take the global top-``budget`` over all depths, which is prefix-closed. The torch version
issues ~130 small kernels at budget 64 x depth 15; here it is one launch (two where a vocabulary
of more than ``SORT_VOCAB_MAX`` tokens needs torch's top-k first).

Three things make a depth cheap enough for one program:

* Candidate pruning. Log-probs are <= 0, so every node is beaten by its ancestors. Both lists
  are sorted descending, so at level d >= 1 (level 0: the root's children) the pair (i, j) (i-th
  kept parent, j-th child token) is beaten by ``(i+1)(j+1) - 1`` pairs of its own level, by the
  ``i`` parents ranked before its own, by its parent and by the parent's ``d - 1`` ancestors: it can
  be in the global top ``budget`` only if ``(i+1)(j+2) + d - 1 <= budget``. A pruned node's
  descendants are beaten by all of those too, so nothing selectable is lost. At level 1 that
  leaves ``sum_i floor(budget/(i+1)) - budget`` pairs (216 at budget 64, 517 at 128) instead of
  ``budget * k`` (4096, 16384): one in-register sort of 256 / 1024 keys per level, fewer valid
  keys deeper.
* The vocabulary top-k. Up to ``SORT_VOCAB_MAX`` tokens every depth's row is sorted in the
  kernel's prologue, one ``[depth, vocab]`` sort along rows. A larger vocabulary comes ranked:
  the draft service hands over each depth's top-k from its logits (``top=``, from
  ``kernels.vocab_topk``; ``services.draft.tree.build_trees_from_logits``); given log-probs, the
  top-k is ``torch.topk``'s (a separate launch: 26 us at batch 128 x 15 x 64 on an H200, and
  2.4-3.6 ms over a 163840-token vocabulary).
* Sort keys. A float32 score maps to an int32 with the same order; packed above a 32-bit tie-break
  into an int64, one ``tl.sort`` orders scores and carries the payload (the pair's index).

Latency, not throughput, bounds it: batch 1 takes nearly as long as batch 128 (one program per
request, 15 dependent depths). So a depth keeps its work off the memory round trips: the next
depth's log-probs are loaded while this one sorts, the top ``budget`` keys are taken from the
sorted registers (a max over the [C_PAD / B_PAD, B_PAD] view of a descending sort is its first
row), and tokens are looked up once at the end from each kept node's child rank.

Scores are float32 and add in the same order as the torch version, so they match it bit for bit.
Scratch rows (per request, in global memory, L1/L2 resident) pass each depth's kept nodes to the
next depth's threads; ``tl.debug_barrier()`` orders each write before the reads of other threads.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from kernels.device import on_input_device

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - only where triton is not installed
    triton = None
    tl = None

__all__ = ["tree_build_triton", "tree_build_num_warps", "candidate_pairs", "pads_budget", "warm_up_kernels"]

_PAIRS: dict[tuple[int, int, int, str], tuple[Tensor, Tensor]] = {}
# Vocabularies up to this many tokens are ranked inside the kernel (its registers hold
# next_pow2(depth) x next_pow2(vocab) int64 keys); larger ones take torch.topk first. 128: the
# largest measured on a GPU (vocab = budget, bench/results/tree_build.json).
SORT_VOCAB_MAX = 128


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pairs(budget: int, k: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(budget) for j in range(min(k, budget // (i + 1) - 1))]


@functools.cache   # called on every build: counting the pairs of budget 127 takes ~70 us of Python
def candidate_pad(budget: int, k: int) -> int:
    """The power of two that holds the candidate pairs of (budget, k) (and at least budget)."""
    return max(_next_pow2(len(_pairs(budget, k))), _next_pow2(budget))


def pads_budget(budget: int) -> int:
    """The budget whose compile-time pads a budget's kernel takes: 10 kernels serve 1..128.

    A kernel compiles in 1-10 s on an H200, and one per budget meant a budget's first request
    stalled its draft replica while it compiled. Every budget now runs with the pads of the largest
    budget of its power-of-two bucket below the power of two (budgets 65..127 those of 127), so one
    kernel serves the bucket and the draft compiles them all at start-up. A power of two keeps its
    own: at 16 and 128 its level-1 candidates just pass a power of two (34 and 517), and the rest of
    its bucket would sort twice the keys it needs (budget 127 in 128's pads: 142 against 75 us).
    """
    return budget if budget & (budget - 1) == 0 else _next_pow2(budget) - 1


def candidate_pairs(budget: int, k: int, device: torch.device, pad: int | None = None) -> tuple[Tensor, Tensor]:
    """[pad] int32 parent ranks i and child ranks j with ``(i+1)(j+2) <= budget``; -1 pads.

    That is the pruning bound at level 1; the kernel masks deeper levels further. `pad` defaults
    to `candidate_pad(budget, k)`; the kernel passes that of :func:`pads_budget`, so that budgets
    share compiled kernels. Cached per (budget, k, pad, device): the first
    call copies host data to the device, so make it (a warm-up) before capturing a CUDA graph.
    """
    pad = candidate_pad(budget, k) if pad is None else pad
    key = (budget, k, pad, str(device))
    if key not in _PAIRS:
        pairs = _pairs(budget, k)
        assert pad >= len(pairs), f"pad {pad} < {len(pairs)} candidate pairs"
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

    # K, DEPTH and BUDGET are run-time values (not specialised): one compiled kernel serves every
    # budget with the same pads (pads_budget), which are the constexprs.
    @triton.jit(do_not_specialize=["n_max", "K", "DEPTH", "BUDGET"])
    def _tree_build_kernel(
        raw_ptr,  # SORT_INPUT: [R, >= DEPTH, V] log-probs (any float dtype, unit stride along V)
        raw_stride_r,
        raw_stride_d,
        top_lp_ptr,  # [R, DEPTH, K] float32, each row sorted descending (written here if SORT_INPUT)
        top_tok_ptr,  # [R, DEPTH, K] int64 (written here if SORT_INPUT)
        root_ptr,  # [R] int64
        cand_i_ptr,  # [C_PAD] int32 parent rank of each candidate pair (-1: padding)
        cand_j_ptr,  # [C_PAD] int32 child rank
        lvl_score_ptr,  # scratch [R, DEPTH, B_PAD] float32 kept nodes per depth, descending
        lvl_child_ptr,  # scratch [R, DEPTH, B_PAD] int32 child rank j (the token is top_tok[d, j])
        lvl_par_ptr,  # scratch [R, DEPTH, B_PAD] int32 rank of the parent in the previous depth
        slot_ptr,  # scratch [R, G_PAD] int32 output slot of each kept node (0: not selected)
        tokens_ptr,  # [R, n_max] int64
        parents_ptr,  # [R, n_max] int64
        depths_ptr,  # [R, n_max] int64
        scores_ptr,  # [R, n_max] float32
        sizes_ptr,  # [R] int64
        n_max,
        K,
        DEPTH,
        BUDGET,
        V: tl.constexpr,
        B_PAD: tl.constexpr,
        C_PAD: tl.constexpr,  # a multiple of B_PAD (both powers of two, C_PAD >= B_PAD)
        G_PAD: tl.constexpr,
        N_PAD: tl.constexpr,
        SORT_INPUT: tl.constexpr,
        D_PAD: tl.constexpr,  # SORT_INPUT: next power of two of DEPTH
        V_PAD: tl.constexpr,  # SORT_INPUT: next power of two of V
    ):
        r = tl.program_id(0).to(tl.int64)
        lp_row = top_lp_ptr + r * DEPTH * K
        tok_row = top_tok_ptr + r * DEPTH * K
        lvl_base = r * DEPTH * B_PAD
        offs_b = tl.arange(0, B_PAD)

        if SORT_INPUT:  # the top-k of every depth: sort each [V] row, keep the first K columns
            offs_dd = tl.arange(0, D_PAD)[:, None]
            offs_v = tl.arange(0, V_PAD)[None, :]
            in_row = (offs_dd < DEPTH) & (offs_v < V)
            lp = tl.load(raw_ptr + r * raw_stride_r + offs_dd * raw_stride_d + offs_v, mask=in_row,
                         other=float("-inf")).to(tl.float32)
            ranked = _pack_key(lp, offs_v + tl.zeros([D_PAD, V_PAD], tl.int32))
            if V_PAD > 1:  # one token a row is ranked already
                ranked = tl.sort(ranked, dim=1, descending=True)
            top_ok = (offs_dd < DEPTH) & (offs_v < K)
            tl.store(lp_row + offs_dd * K + offs_v, _unpack_score(ranked), mask=top_ok)
            tl.store(tok_row + offs_dd * K + offs_v, _unpack_index(ranked).to(tl.int64), mask=top_ok)
            tl.debug_barrier()

        # Depth 1: the top-k tokens themselves, children of the root.
        first_ok = offs_b < K
        tl.store(lvl_score_ptr + lvl_base + offs_b, tl.load(lp_row + offs_b, mask=first_ok, other=float("-inf")))
        tl.store(lvl_child_ptr + lvl_base + offs_b, tl.where(first_ok, offs_b, 0))
        tl.store(lvl_par_ptr + lvl_base + offs_b, tl.zeros([B_PAD], tl.int32))

        offs_c = tl.arange(0, C_PAD)
        ci = tl.load(cand_i_ptr + offs_c)  # [C_PAD]
        cj = tl.load(cand_j_ptr + offs_c)
        pair = ci >= 0
        # Depth 2's child scores, where there is a depth 2 (row 1 of the [DEPTH, K] table).
        y_next = tl.load(lp_row + K + cj, mask=pair & (K + cj < DEPTH * K), other=float("-inf"))
        tl.debug_barrier()
        width = tl.zeros([], tl.int32) + K  # kept nodes at the previous depth (a loop-carried tensor)
        for d in range(1, DEPTH):
            ok = pair & (ci < width) & ((ci + 1) * (cj + 2) + d - 1 <= BUDGET)
            x = tl.load(lvl_score_ptr + lvl_base + (d - 1) * B_PAD + ci, mask=ok, other=float("-inf"))
            y = tl.where(ok, y_next, float("-inf"))
            # Issued now, used next depth: its latency hides behind this depth's sort.
            y_next = tl.load(lp_row + (d + 1) * K + cj, mask=pair & ((d + 1) * K + cj < DEPTH * K), other=float("-inf"))
            flat = tl.where(ok, ci * K + cj, 0x7FFFFFFF)  # invalid pairs sort last
            keep = tl.minimum(width * K, BUDGET - d)  # rank r of level d has r + d nodes before it
            kept = offs_b < keep
            keys = tl.sort(_pack_key(x + y, flat), descending=True)  # [C_PAD]
            # A descending [C_PAD] viewed as [C_PAD / B_PAD, B_PAD] has its largest in row 0.
            top = tl.max(tl.reshape(keys, [C_PAD // B_PAD, B_PAD]), axis=0)  # [B_PAD] best pairs, descending
            idx = _unpack_index(top)
            base = lvl_base + d * B_PAD + offs_b
            tl.store(lvl_score_ptr + base, tl.where(kept, _unpack_score(top), float("-inf")))
            tl.store(lvl_child_ptr + base, tl.where(kept, idx % K, 0))
            tl.store(lvl_par_ptr + base, tl.where(kept, idx // K, 0))
            width = keep
            tl.debug_barrier()

        # Global top-budget over all depths; ties go to the shallower (earlier) node, as the
        # stable sort of the torch version does, so the selection stays prefix-closed.
        offs_g = tl.arange(0, G_PAD)
        g_ok = offs_g < DEPTH * B_PAD
        score = tl.load(lvl_score_ptr + lvl_base + offs_g, mask=g_ok, other=float("-inf"))  # [G_PAD]
        finite = score > float("-inf")
        keys = _pack_key(score, offs_g)
        best = tl.max(tl.reshape(tl.sort(keys, descending=True), [G_PAD // B_PAD, B_PAD]), axis=0)  # [B_PAD]
        threshold = tl.min(tl.where(offs_b < BUDGET, best, 0x7FFFFFFFFFFFFFFF), axis=0)  # the BUDGET-th key
        selected = (keys >= threshold) & finite & g_ok
        slot = tl.cumsum(selected.to(tl.int32), 0)  # 1-based output slot in depth-then-rank order
        tl.store(slot_ptr + r * G_PAD + offs_g, tl.where(selected, slot, 0))
        tl.debug_barrier()

        depth = offs_g // B_PAD  # 0-based level; the node's depth is depth + 1
        has_grand = selected & (depth > 0)
        par_rank = tl.load(lvl_par_ptr + lvl_base + offs_g, mask=has_grand, other=0)
        parent_slot = tl.load(slot_ptr + r * G_PAD + (depth - 1) * B_PAD + par_rank, mask=has_grand, other=0)
        out = r * n_max + slot
        child = tl.load(lvl_child_ptr + lvl_base + offs_g, mask=selected, other=0)
        tl.store(tokens_ptr + out, tl.load(tok_row + depth * K + child, mask=selected, other=0), mask=selected)
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


def tree_build_num_warps(budget: int, k: int) -> int:
    """The default warps of a request's program: one candidate sort key a thread, 4..16 warps.

    At the T-tree shape (budget 64) that was the best of 4/8/16/32 warps on an H200
    (bench/results/tree_build.json); budget 128 gets 16 warps, two keys a thread.
    """
    return max(4, min(16, candidate_pairs(budget, k, torch.device("cpu"))[0].numel() // 32))


def warm_up_kernels(depth_limit: int, vocab: int, device: torch.device | str, max_budget: int = 128) -> list[int]:
    """Compiles every kernel budgets 1..max_budget need (one batch-1 call a pads budget).

    From a thread each: the compiles overlap (on an H200 with an empty Triton cache, 18.5 s for
    all of them against 38 s one after another, bench/results/tree_build_buckets-b1dee91.json).
    The first runs alone: it sets up the kernel's per-device caches, which two threads making them
    at once could each make (the loser's compiled kernels would be loaded again on first use).
    Returns the pads budgets called.
    """
    shared = sorted({pads_budget(b) for b in range(1, max_budget + 1)})
    logprobs = torch.log_softmax(torch.randn(1, depth_limit, vocab, device=device), dim=-1)  # [1, D, V]
    roots = torch.zeros(1, dtype=torch.int64, device=device)
    tree_build_triton(logprobs, shared[0], roots)
    with ThreadPoolExecutor(len(shared) - 1 or 1) as pool:
        list(pool.map(lambda b: tree_build_triton(logprobs, b, roots), shared[1:]))
    return shared


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
    logprobs: Tensor, budget: int, root_tokens: Tensor, num_warps: int | None = None, max_depth: int | None = None,
    top: tuple[Tensor, Tensor] | None = None,
) -> TreeBuildOutput:
    """The trees of ``build_trees`` for float32/bf16/fp16 log-probs in one launch (two above
    ``SORT_VOCAB_MAX`` tokens, where the vocabulary top-k is ``top``'s, or else torch's).

    Args:
        logprobs: [R, D, V] log-softmax normalised draft log-probs; row d is depth d+1.
        budget: non-root nodes per tree, 1..128.
        root_tokens: [R] int64 pending token of each request.
        num_warps: warps per request's program; default :func:`tree_build_num_warps`.
        max_depth: the deepest level a tree may have (default D). A run-time value: the pads are
            those of all D depths, so a cap (a request near its context end) compiles nothing new.
        top: the vocabulary's top-k already taken, for ``V > SORT_VOCAB_MAX``: float32 log-probs
            (descending) and int64 tokens, ``[R, depth, min(budget, V)]`` each, depth the one the
            cap gives (``kernels.vocab_topk`` of the drafter's logits). ``logprobs`` then gives
            only the shape: the logits may stand there.

    Returns:
        :class:`TreeBuildOutput` with ``n_max = budget + 1`` columns. No host sync; capturable in
        a CUDA graph after one warm-up call per (budget, k) (see :func:`candidate_pairs`). Budgets
        share compiled kernels (:func:`pads_budget`).
    """
    if triton is None:
        raise RuntimeError("tree_build_triton needs triton")
    num_req, depth_limit, vocab = logprobs.shape
    assert 1 <= budget <= 128, f"budget must be in 1..128, got {budget}"
    assert logprobs.dtype in (torch.float32, torch.bfloat16, torch.float16), (
        f"logprobs dtype {logprobs.dtype}: the kernel scores in float32; use the torch builder for float64")
    depth = min(depth_limit, budget, depth_limit if max_depth is None else max_depth)
    assert depth >= 1 and vocab >= 1, "need at least one depth and one token"
    device = logprobs.device
    n_max = budget + 1
    k = min(budget, vocab)
    sort_input = vocab <= SORT_VOCAB_MAX
    if top is not None:
        assert not sort_input, f"top: for vocabularies above {SORT_VOCAB_MAX} tokens"
        top_lp, top_tok = top
        assert top_lp.shape == top_tok.shape == (num_req, depth, k), (
            f"top: [{num_req}, {depth}, {k}] expected, got {tuple(top_lp.shape)} / {tuple(top_tok.shape)}")
        assert top_lp.dtype == torch.float32 and top_tok.dtype == torch.int64
        top_lp, top_tok = top_lp.contiguous(), top_tok.contiguous()
    elif sort_input:  # the kernel's prologue ranks each row
        top_lp = torch.empty(num_req, depth, k, dtype=torch.float32, device=device)
        top_tok = torch.empty(num_req, depth, k, dtype=torch.int64, device=device)
    else:
        # Over a 163840-token vocabulary this top-k costs 2.4-3.6 ms at batch 128 on an H200,
        # ~100x the tree itself: the draft service hands over its top-k instead (``top``).
        top_lp, top_tok = logprobs[:, :depth].float().topk(k, dim=-1)  # [R, De, k] each, descending
        top_lp, top_tok = top_lp.contiguous(), top_tok.contiguous()
    if sort_input:
        raw = logprobs if logprobs.stride(-1) == 1 else logprobs[:, :depth].contiguous()
        raw_strides = (raw.stride(0), raw.stride(1))
    else:
        # The kernel does not read raw then. Triton compiles a kernel for each dtype of a pointer
        # (and alignment, and stride divisible by 16 or equal to 1): the draft's bf16 logits in
        # raw's place compiled every pads budget anew on its first request, against the float32
        # of the start-up, stalling the replica for seconds each. So the same float32 tensor and
        # strides stand there on every launch.
        raw, raw_strides = top_lp, (0, 0)
    # Every pad is that of pads_budget(budget) (>= budget), so budgets share compiled kernels.
    pads = pads_budget(budget)
    pads_k, pads_depth = min(pads, vocab), min(depth_limit, pads)
    ci, cj = candidate_pairs(budget, k, device, pad=candidate_pad(pads, pads_k))
    b_pad = _next_pow2(pads)
    c_pad = ci.numel()
    g_pad = _next_pow2(pads_depth * b_pad)
    lvl_score = torch.empty(num_req, depth, b_pad, dtype=torch.float32, device=device)
    lvl_child = torch.empty(num_req, depth, b_pad, dtype=torch.int32, device=device)
    lvl_par = torch.empty(num_req, depth, b_pad, dtype=torch.int32, device=device)
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
    if num_warps is None:
        num_warps = tree_build_num_warps(pads, pads_k)
    _tree_build_kernel[(num_req,)](
        raw, *raw_strides, top_lp, top_tok,
        root_tokens.to(device=device, dtype=torch.int64).contiguous(), ci, cj,
        lvl_score, lvl_child, lvl_par, slots, out.tokens, out.parents, out.depths, out.scores, out.sizes,
        n_max, k, depth, budget,
        V=vocab if sort_input else 0, B_PAD=b_pad, C_PAD=c_pad,
        G_PAD=g_pad, N_PAD=2 * b_pad, SORT_INPUT=sort_input, D_PAD=_next_pow2(pads_depth),
        V_PAD=_next_pow2(vocab) if sort_input else 1, num_warps=num_warps,
    )
    return out
