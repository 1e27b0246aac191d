"""The top-k tokens of each row of draft logits, as log-probs, in one program a row.

Why: the tree builder needs, per request and depth, the ``k`` best tokens (k = the budget, at
most 128) and their log-probs. As served before, the drafter wrote float32 ``log_softmax`` of its
logits over the whole vocabulary and ``torch.topk`` ran on that: at Kimi-K2's 163840 tokens and
batch 128 (1920 rows) 5.6 ms on an H200, about as long as the drafter's LM head; ``torch.topk`` of
the bf16 logits alone took 2.3 ms (``bench/results/vocab_topk.json``). Here a row's logits are
read twice:

* Pass 1: the row's log-sum-exp (float32, one exponential an element) and the maxima of
  ``TILE`` strided groups (element i is in group ``i % TILE``). The k-th largest group maximum
  ``t`` is a lower bound of the row's k-th largest logit (k groups have a maximum >= t), so every
  top-k token is >= t. With strided groups, tokens that crowd one region of the vocabulary still
  fall into different groups, and on random rows about k + 10 logits pass ``t``.
* Pass 2: the logits >= t, compacted (in row order) into at most ``CMAX`` candidates; one sort
  of their (value, index) keys gives the top k, ties to the lower token id.
* A row with more than ``CMAX`` logits >= t (many equal values, or a pattern with the groups'
  period) takes the exact threshold instead: the k-th largest logit by bisection over the
  ordered keys (a count over the row a step), then the logits above it and, in row order, as many
  equal to it as k needs. Correct for any row, slow only for such rows.

Values are compared as float32 (bf16 and fp16 convert exactly) through an int32 key with the same
order. The log-probs are ``logit - lse`` in float32; ``vocab_topk_reference`` (torch) gives
``log_softmax`` then ``topk``: the same tokens up to ties, the same values to float32 rounding.
A NaN logit counts as -inf (a token never chosen; torch would make the whole row NaN), and -0.0
as +0.0, so that the two tie.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.device import interpreted, on_input_device

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - only where triton is not installed
    triton = None
    tl = None

__all__ = ["vocab_topk", "vocab_topk_reference", "TILE", "CMAX"]

TILE = 4096   # elements a step of a pass, and the number of strided groups
CMAX = 1024   # candidates a row keeps for its final sort; more take the exact threshold


def vocab_topk_reference(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """float32 log-probs and int64 tokens of the k best of each row: ``log_softmax``, ``topk``."""
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


if triton is not None:

    @triton.jit
    def _key(x):
        """int32 with the order of float32 ``x``."""
        bits = x.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _load(base, idx, vocab):
        """float32 logits at ``idx``: -inf past the vocabulary and for NaN, +0.0 for -0.0."""
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        return tl.where(x == x, x + 0.0, float("-inf"))

    @triton.jit
    def _count_ge(base, vocab, t, TILE: tl.constexpr):
        """How many logits of the row have a key >= t (int64 t)."""
        offs = tl.arange(0, TILE)
        n = 0
        for start in range(0, vocab, TILE):
            idx = start + offs
            n += tl.sum(((_key(_load(base, idx, vocab)).to(tl.int64) >= t) & (idx < vocab)).to(tl.int32), 0)
        return n

    @triton.jit(do_not_specialize=["inner", "k"])   # every budget (k) and depth cap (inner): one kernel
    def _vocab_topk_kernel(x_ptr, stride_outer, stride_inner, inner, vocab, k, lp_ptr, tok_ptr, cand_ptr,
                           TILE: tl.constexpr, CMAX: tl.constexpr, SEARCH_STEPS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)   # row (outer, inner) of an [outer, inner, vocab] view
        base = x_ptr + (row // inner) * stride_outer + (row % inner) * stride_inner
        cand = cand_ptr + row * CMAX
        offs = tl.arange(0, TILE)

        # Pass 1: log-sum-exp, and the maxima of the strided groups. Per lane a running max m and
        # sum s of exp(x - m): exp(-|x - m|) is the new term when x <= m, else the factor for s.
        m = tl.full([TILE], float("-inf"), tl.float32)
        s = tl.zeros([TILE], tl.float32)
        for start in range(0, vocab, TILE):
            idx = start + offs
            x = _load(base, idx, vocab)
            e = tl.where(x == float("-inf"), 0.0, tl.exp(-tl.abs(x - m)))
            grows = x > m
            s = tl.where(grows, s * tl.where(m == float("-inf"), 0.0, e) + 1.0, s + e)
            m = tl.where(grows, x, m)
        row_max = tl.max(m, 0)
        lse = row_max + tl.log(tl.sum(s * tl.where(m == float("-inf"), 0.0, tl.exp(m - row_max)), 0))

        # t: the k-th largest group maximum (the largest key with >= k group maxima at or above it).
        # Lanes past the vocabulary hold -inf, the lowest key a logit can have.
        gkey = _key(m).to(tl.int64)
        lo = tl.min(gkey, 0)            # count(>= lo) = TILE >= k
        hi = tl.max(gkey, 0) + 1        # count(>= hi) = 0 < k
        for _ in range(SEARCH_STEPS):
            mid = lo + (hi - lo) // 2
            ok = tl.sum((gkey >= mid).to(tl.int32), 0) >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        t = lo

        # Pass 2: the logits >= t, in row order, as (key, index) sort keys.
        n = 0
        for start in range(0, vocab, TILE):
            idx = start + offs
            x = _load(base, idx, vocab)
            key = _key(x).to(tl.int64)
            keep = (key >= t) & (idx < vocab)
            pos = n + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(cand + pos, (key << 32) | (0x7FFFFFFF - idx), mask=keep & (pos < CMAX))
            n += tl.sum(keep.to(tl.int32), 0)

        if n > CMAX:
            # The exact k-th largest key, then the keys above it and the first ties (row order).
            lo = tl.min(gkey, 0)
            hi = tl.max(gkey, 0) + 1
            for _ in range(SEARCH_STEPS):
                mid = lo + (hi - lo) // 2
                ok = _count_ge(base, vocab, mid, TILE) >= k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            above = _count_ge(base, vocab, lo + 1, TILE)   # < k
            n_above = 0
            n_tied = 0
            for start in range(0, vocab, TILE):
                idx = start + offs
                x = _load(base, idx, vocab)
                key = _key(x).to(tl.int64)
                gt = (key > lo) & (idx < vocab)
                eq = (key == lo) & (idx < vocab)
                pos_gt = n_above + tl.cumsum(gt.to(tl.int32), 0) - 1
                pos_eq = above + n_tied + tl.cumsum(eq.to(tl.int32), 0) - 1
                packed = (key << 32) | (0x7FFFFFFF - idx)
                tl.store(cand + pos_gt, packed, mask=gt & (pos_gt < k))   # fewer than k are above
                tl.store(cand + pos_eq, packed, mask=eq & (pos_eq < k))
                n_above += tl.sum(gt.to(tl.int32), 0)
                n_tied += tl.sum(eq.to(tl.int32), 0)
            n = k
        tl.debug_barrier()   # the candidates' stores before other threads read them

        offs_c = tl.arange(0, CMAX)
        keys = tl.load(cand + offs_c, mask=offs_c < n, other=-0x7FFFFFFFFFFFFFFF - 1)
        best = tl.sort(keys, descending=True)
        tl.debug_barrier()   # every thread's read of the candidates before the sorted keys overwrite them
        tl.store(cand + offs_c, best)
        tl.debug_barrier()
        top = tl.load(cand + offs_c, mask=offs_c < k, other=0)
        tok = 0x7FFFFFFF - (top & 0xFFFFFFFF)
        bits = (top >> 32).to(tl.int32)
        value = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        # -inf stays -inf (a row of -inf has lse -inf too: never NaN, never chosen by the tree)
        tl.store(lp_ptr + row * k + offs_c, tl.where(value == float("-inf"), value, value - lse), mask=offs_c < k)
        tl.store(tok_ptr + row * k + offs_c, tok, mask=offs_c < k)


@on_input_device
def vocab_topk(logits: Tensor, k: int, tile: int | None = None, cmax: int | None = None) -> tuple[Tensor, Tensor]:
    """``[..., k]`` float32 log-probs (descending) and int64 tokens of each row of ``[..., V]``
    float32 / bf16 / fp16 logits: ``vocab_topk_reference``'s up to ties (the lower token id
    first here). 1 <= k <= min(V, cmax). No host sync; capturable in a CUDA graph. ``tile`` and
    ``cmax`` (powers of two, ``tile >= k``) are the module's ``TILE`` and ``CMAX`` unless a test
    makes them small."""
    tile, cmax = TILE if tile is None else tile, CMAX if cmax is None else cmax
    if tile & (tile - 1) or cmax & (cmax - 1):
        raise ValueError(f"tile and cmax must be powers of two, got {tile} and {cmax}")
    vocab = logits.shape[-1]
    if not 1 <= k <= min(vocab, cmax, tile):
        raise ValueError(f"k must be in 1..{min(vocab, cmax, tile)} (the vocabulary, at most {min(cmax, tile)}), got {k}")
    if triton is None or not (logits.is_cuda or interpreted()):
        return vocab_topk_reference(logits, k)
    # [outer, inner, V]: a depth slice of [R, D, V] logits stays a view (no copy of the rows).
    x = logits.reshape(-1, logits.shape[-2] if logits.dim() > 1 else 1, vocab)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0] * x.shape[1]
    lp = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    tok = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    cand = torch.empty(rows, cmax, dtype=torch.int64, device=logits.device)
    if rows:
        _vocab_topk_kernel[(rows,)](x, x.stride(0), x.stride(1), x.shape[1], vocab, k, lp, tok, cand,
                                    TILE=tile, CMAX=cmax, SEARCH_STEPS=33, num_warps=8)
    return lp.view(*logits.shape[:-1], k), tok.view(*logits.shape[:-1], k)
