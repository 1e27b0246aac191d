"""The top-k tokens of each row of draft logits, as log-probs, without a log-softmax of the row.

Why: the tree builder needs, per request and depth, the ``k`` best tokens (k = the budget, at
most 128) and their log-probs. As served before, the drafter wrote the float32 ``log_softmax`` of
its logits over the whole vocabulary and ``torch.topk`` ran on that: at Kimi-K2's 163840 tokens
and batch 128 (1920 rows) 5.6 ms on an H200, about as long as the drafter's LM head. A log-softmax
is a shift of each row, so the top-k of the logits themselves (in their own dtype: bf16 halves
the bytes ``torch.topk`` reads) are the same tokens, and their log-probs are ``logit - lse``
with ``lse`` each row's log-sum-exp: ``row_logsumexp`` reads the row once, in float32. 2.5 ms
there, 2.2x faster; 1.2-1.8x at the demo's 4096 tokens (``bench/results/vocab_topk.json``).

A selection kernel of our own (log-sum-exp and strided group maxima, then the candidates above
the k-th maximum, sorted) was built and measured, and lost to this at most shapes (BENCHMARKS.md,
"The draft's vocabulary top-k").
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

__all__ = ["vocab_topk", "vocab_topk_reference", "row_logsumexp"]

BLOCK = 2048   # elements of a row a step


def vocab_topk_reference(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """float32 log-probs and int64 tokens of the k best of each row: ``log_softmax``, ``topk``."""
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


if triton is not None:

    # A depth cap (inner), and the outer stride a capped view of one request's rows gets (cap x V),
    # run the kernel the start-up compiled.
    @triton.jit(do_not_specialize=["stride_outer", "inner"])
    def _row_lse_kernel(x_ptr, stride_outer, stride_inner, inner, vocab, out_ptr, BLOCK: tl.constexpr):
        # Per lane a running max m and sum s of exp(x - m), one exponential an element:
        # exp(-|x - m|) is the new term when x <= m, and the factor that rescales s when x is
        # the new max. A NaN makes the row's result NaN, as log_softmax's.
        row = tl.program_id(0).to(tl.int64)   # row (outer, inner) of an [outer, inner, vocab] view
        base = x_ptr + (row // inner) * stride_outer + (row % inner) * stride_inner
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
            e = tl.where(x == float("-inf"), 0.0, tl.exp(-tl.abs(x - m)))
            grows = x > m
            s = tl.where(grows, s * tl.where(m == float("-inf"), 0.0, e) + 1.0, s + e)
            m = tl.where(grows, x, m)
        row_max = tl.max(m, 0)
        total = tl.sum(s * tl.where(m == float("-inf"), 0.0, tl.exp(m - row_max)), 0)
        tl.store(out_ptr + row, row_max + tl.log(total))


@on_input_device
def row_logsumexp(logits: Tensor) -> Tensor:
    """float32 log-sum-exp of each row of ``[..., V]`` logits (any float dtype), one read of the
    row and no float32 copy of it; ``torch.logsumexp(logits.float(), -1)`` off the GPU."""
    if triton is None or not (logits.is_cuda or interpreted()) or not logits.numel():   # (no rows: no reshape)
        return torch.logsumexp(logits.float(), dim=-1)
    vocab = logits.shape[-1]
    # [outer, inner, V]: a depth slice of [R, D, V] logits stays a view (no copy of the rows).
    x = logits.reshape(-1, logits.shape[-2] if logits.dim() > 1 else 1, vocab)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0] * x.shape[1], dtype=torch.float32, device=logits.device)
    if out.numel():
        _row_lse_kernel[(out.numel(),)](x, x.stride(0), x.stride(1), x.shape[1], vocab, out, BLOCK=BLOCK, num_warps=8)
    return out.view(logits.shape[:-1])


def vocab_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``[..., k]`` float32 log-probs (descending) and int64 tokens of each row of ``[..., V]``
    logits: ``vocab_topk_reference``'s up to ties, and float32 rounding of the values. No host
    sync; capturable in a CUDA graph."""
    vocab = logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in 1..{vocab} (the vocabulary), got {k}")
    values, tokens = logits.topk(k, dim=-1)
    return values.float() - row_logsumexp(logits)[..., None], tokens
