"""Keyed Gumbel-max sampling of many rows at once, each row with its own temperature, top-k,
top-p and key: the GPU path of ``services.verifier.sampling.draw_tokens``.

Why: the torch path (``posterior_tokens``, the reference) runs per request and sorts the whole
vocabulary for top-p; its noise is ten int64 passes and two float64 logs over [rows, V]. At
Kimi-K2's 163840 tokens one request's 129-node tree took 6.4 ms (top-p 3.1, noise 2.8), and a
step pays that once per sampled request. Here one launch pair serves every sampled row of a step:

* ``_floor_kernel`` finds each row's keep threshold on its scaled logits without sorting: the
  k-th largest value (top-k) and then the smallest value whose strictly-greater mass is below
  ``top_p`` of the kept mass (top-p), each by a search over the order-preserving integer image of
  float32 that tests ``WAYS`` probes a pass over the row (32 bits in 8 passes at 16). The result
  is a logit of the row, exactly; a row holding NaN or +inf, or no finite logit, gets NaN.
* ``_gumbel_argmax_kernel`` adds each kept token's noise (the reference's hash, in uint32, and
  its float64 ``-log(-log(u))``) to its scaled logit less the row's maximum (so the noise is not
  lost beside logits of 1e16 and more) and keeps the first maximum; tiles with no kept token are
  skipped, so a filtered row costs little more than one read. A NaN floor writes token -1.

Ties at a threshold keep every tied token, as the reference does. The kept set's mass is summed
in float32, blockwise, the reference's cumulative sum in float64, so the two can part only where
``top_p`` lies within float32 rounding of a cumulative mass: at K2's 163840 tokens and top-p 0.95,
3-5 rows of 129 on an H100, by a boundary token (``bench/results/sampling-check-acb5f4b.json``; a
float32 reference had parted in every row; ``bench/sampling_check.py`` bounds how far the kept set
misses the top-p rule in float64). The noise's float64 logs may differ in the last bit.
Either moves a draw only at such a near tie.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.device import interpreted, on_input_device

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - only where triton is not installed
    triton = None
    tl = None

__all__ = ["gumbel_sample", "gumbel_sample_runs", "keep_floors"]

SEARCH_BLOCK = 512    # elements of a row a step of the threshold search
WAYS = 16             # probes a search pass, WAYS + 1 parts (a power of two, for tl.arange: 32 bits in 8 passes)
DRAW_BLOCK = 2048     # elements of a row a step of the draw


if triton is not None:

    @triton.jit
    def _key(x):
        """float32 -> int64 with the same order (NaN excluded): negative floats' magnitude bits flip."""
        b = x.to(tl.int32, bitcast=True)
        return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.int64)

    @triton.jit
    def _unkey(k):
        b = k.to(tl.int32)
        return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.float32, bitcast=True)

    @triton.jit
    def _scaled(base, idx, vocab, inv_t):
        """Scaled logits of a row at ``idx`` (-inf past its end), as the reference scales them: every
        pass of both kernels computes the same bits, so a threshold found by one is exact in the other."""
        return tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_t

    @triton.jit
    def _search(base, vocab, inv_t, m, lo, hi, target, MASS: tl.constexpr, BLOCK: tl.constexpr,
                WAYS: tl.constexpr):
        """The smallest key in (lo, hi] whose predicate holds: (count or mass of the row's scaled
        values strictly above it) < target, where it fails at lo and the predicate is monotone.
        Each pass tests ``WAYS`` probes splitting (lo, hi] into ``WAYS + 1`` parts; where none
        holds the answer is in the last part, so hi is never tested: where even hi fails (a target
        of 0), hi comes back, the row's maximum for a top-p search (greedy, as the reference)."""
        offs = tl.arange(0, BLOCK)
        ways = tl.arange(0, WAYS)
        while hi - lo > 1:
            step = (hi - lo + WAYS) // (WAYS + 1)
            probes = tl.minimum(lo + step * (ways + 1), hi)                 # [WAYS] keys
            t = _unkey(probes)                                              # [WAYS] float32
            acc = tl.zeros([BLOCK, WAYS], tl.float32)   # summed across lanes once a pass, not a step
            for start in range(0, vocab, BLOCK):
                idx = start + offs
                x = _scaled(base, idx, vocab, inv_t)
                if MASS:
                    w = tl.where(x == float("-inf"), 0.0, tl.exp(x - m))
                else:
                    w = tl.where(idx < vocab, 1.0, 0.0)
                acc += tl.where(x[:, None] > t[None, :], w[:, None], 0.0)
            above = tl.sum(acc, axis=0)                                     # [WAYS]
            first = tl.min(tl.where(above < target, ways, WAYS), axis=0)   # the first probe that holds
            new_hi = tl.where(first == WAYS, hi, tl.sum(tl.where(ways == first, probes, 0), axis=0))
            lo = tl.where(first == 0, lo, tl.sum(tl.where(ways == first - 1, probes, 0), axis=0))
            hi = new_hi
        return hi

    @triton.jit
    def _floor_kernel(x_ptr, stride, inv_t_ptr, top_k_ptr, top_p_ptr, floor_ptr, max_ptr, vocab,
                      BLOCK: tl.constexpr, WAYS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        inv_t = tl.load(inv_t_ptr + row)
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        least = tl.full([BLOCK], float("inf"), tl.float32)   # smallest finite value
        finite = tl.zeros([BLOCK], tl.int32)
        bad = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            x = _scaled(base, idx, vocab, inv_t)
            ok = (x > float("-inf")) & (x < float("inf"))
            bad += ((x != x) | (x == float("inf"))).to(tl.int32)
            finite += ok.to(tl.int32)
            m = tl.maximum(m, tl.where(ok, x, float("-inf")))
            least = tl.minimum(least, tl.where(ok, x, float("inf")))
        m_row = tl.max(m, axis=0)
        floor = tl.full([], float("-inf"), tl.float32)
        if (top_k > 0) & (tl.sum(finite, axis=0) > top_k):
            floor = _unkey(_search(base, vocab, inv_t, m_row, _key(tl.min(least, axis=0)) - 1, _key(m_row),
                                   top_k.to(tl.float32), False, BLOCK, WAYS))
        if top_p < 1.0:
            kept = tl.zeros([BLOCK], tl.float32)
            for start in range(0, vocab, BLOCK):
                idx = start + offs
                x = _scaled(base, idx, vocab, inv_t)
                kept += tl.where((x >= floor) & (x > float("-inf")), tl.exp(x - m_row), 0.0)
            lo = tl.where(floor == float("-inf"), _key(tl.min(least, axis=0)), _key(floor)) - 1
            floor = _unkey(_search(base, vocab, inv_t, m_row, lo, _key(m_row), top_p * tl.sum(kept, axis=0),
                                   True, BLOCK, WAYS))
        if (tl.sum(bad, axis=0) > 0) | (m_row == float("-inf")):
            floor = tl.full([], float("nan"), tl.float32)
        tl.store(floor_ptr + row, floor)
        tl.store(max_ptr + row, m_row)

    @triton.jit
    def _mix32(x):
        """Wellons' lowbias32, as ``sampling._mix32`` (uint32 arithmetic wraps as its masks do)."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _gumbel_argmax_kernel(x_ptr, stride, inv_t_ptr, floor_ptr, max_ptr, key_ptr, out_ptr, vocab,
                              BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        inv_t = tl.load(inv_t_ptr + row)
        floor = tl.load(floor_ptr + row)
        top = tl.load(max_ptr + row).to(tl.float64)
        key = tl.load(key_ptr + row)
        low = (key & 0xFFFFFFFF).to(tl.uint32)
        high = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
        offs = tl.arange(0, BLOCK)
        best = tl.full([], float("-inf"), tl.float64)
        best_i = tl.full([], -1, tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            x = _scaled(base, idx, vocab, inv_t)
            keep = (idx < vocab) & (x >= floor)
            if tl.max(keep.to(tl.int32), axis=0) > 0:
                h = _mix32(_mix32(idx.to(tl.uint32) * 0x9E3779B9 + low) ^ high)
                u = (h.to(tl.float64) + 0.5) * 2.3283064365386963e-10   # 2 ** -32
                if LIBDEVICE:
                    g = -libdevice.log(-libdevice.log(u))
                else:
                    g = -tl.log(-tl.log(u))
                v = tl.where(keep, (x.to(tl.float64) - top) + g, float("-inf"))
                tile_best = tl.max(v, axis=0)
                if tile_best > best:
                    best = tile_best
                    best_i = start + tl.argmax(v, axis=0)
        tl.store(out_ptr + row, tl.where(floor == floor, best_i, -1).to(tl.int64))


def gumbel_sample_runs(logits: Tensor) -> bool:
    """Whether the kernel serves ``logits``: on a GPU with Triton (the reference is the CPU path;
    the CPU tests call ``gumbel_sample`` under the interpreter themselves)."""
    return triton is not None and logits.is_cuda


def _check_rows(logits: Tensor, **per_row: tuple[Tensor, torch.dtype]) -> None:
    """The kernels index every tensor by row alone: a wrong shape, dtype, stride or device would be
    read past its end or as other values, not refused."""
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"gumbel_sample: logits must be [rows, V], each row contiguous; got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    for name, (t, dtype) in per_row.items():
        if t.shape != logits.shape[:1] or t.dtype != dtype or t.device != logits.device or \
                (t.numel() > 1 and t.stride(0) != 1):
            raise ValueError(f"gumbel_sample: {name} must be [{logits.shape[0]}] contiguous {dtype} on "
                             f"{logits.device}; got {tuple(t.shape)} {t.dtype} on {t.device}")


def _floors_and_maxima(logits: Tensor, inv_temperature: Tensor, top_k: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    _check_rows(logits, inv_temperature=(inv_temperature, torch.float32), top_k=(top_k, torch.int32),
                top_p=(top_p, torch.float32))
    n, vocab = logits.shape
    floor = torch.empty(n, dtype=torch.float32, device=logits.device)
    top = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _floor_kernel[(n,)](logits, logits.stride(0), inv_temperature, top_k, top_p, floor, top, vocab,
                            BLOCK=SEARCH_BLOCK, WAYS=WAYS, num_warps=8)
    return floor, top


@on_input_device
def keep_floors(logits: Tensor, inv_temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """[n] float32: each row's smallest kept scaled logit (``logits * inv_temperature``; -inf where
    neither filter is on; NaN for a row holding NaN or +inf, or no finite logit). Arguments as
    ``gumbel_sample``'s."""
    return _floors_and_maxima(logits, inv_temperature, top_k, top_p)[0]


@on_input_device
def gumbel_sample(logits: Tensor, inv_temperature: Tensor, top_k: Tensor, top_p: Tensor, keys: Tensor) -> Tensor:
    """[n] int64: each row's argmax of ``logits * inv_temperature + G`` over its kept tokens, G the
    keyed Gumbel noise of ``sampling.gumbel_noise``; -1 for a row holding NaN or +inf, or no
    finite logit.

    Args:
        logits: [n, V] (float32, bf16 or fp16), each row contiguous.
        inv_temperature: [n] float32, 1 / T (the reference scales by this product too).
        top_k: [n] int32, 0 = off. top_p: [n] float32, 1 = off. keys: [n] int64 (``token_keys``).
    """
    _check_rows(logits, keys=(keys, torch.int64))
    floor, top = _floors_and_maxima(logits, inv_temperature, top_k, top_p)
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        _gumbel_argmax_kernel[(n,)](logits, logits.stride(0), inv_temperature, floor, top, keys, out, vocab,
                                    BLOCK=DRAW_BLOCK, LIBDEVICE=not interpreted(), num_warps=8)
    return out
