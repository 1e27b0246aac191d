"""Tree-attention MLA for Hopper (sm_90), written in Gluon: FlashMLA's schedule on a paged cache.

Why a second kernel: ``kernels/tree_mla.py`` (Triton) keeps its accumulator in registers for 128
rows by giving each program half the value dims, so both programs compute all the logits (at 8
heads and a 9-node tree, 2.7x the MMA work the attention needs), and Triton cannot split one
CTA's warps into a copy engine and two compute roles. Gluon can:

* One CTA = 64 query rows x all 512 value dims, three partitions (``warp_specialize``):
  - a loader warpgroup streams q once and the key tiles (latent and rope parts) into a ring of
    ``NUM_STAGES`` shared buffers. Whole prefix tiles go by TMA, one copy per page run (the page
    table gives each run's first row); a split's last, partial tile and the tree's own keys go by
    ``cp.async``, which zero-fills rows past the keys (their probabilities are 0, and 0 x a stale
    NaN would not be);
  - two consumer warpgroups take turns: the owner of tile t computes its logits ``S = Q K^T``
    ``[64, BLOCK_N]`` and softmax, publishes P and the row statistics in shared memory, and both
    add their half of ``P V`` (256 value dims, 128 fp32 registers a thread). Each issues the
    logits of its next tile before it waits for the other's P, so one warpgroup's MMAs run while
    the other's softmax does.
* mbarriers only: tile ready (TMA bytes or cp.async arrivals), tile free (both halves done), P
  published. No CTA-wide barrier in the loop.
* The tree's own keys (a few tiles) follow on the last split, with the ancestor bits as mask.
* Splits write float32 partials and per-row log-sum-exps that ``tree_mla.merge_splits``
  combines, exactly as the Triton kernel's do (one value-dim part).

Rows past 64 a request take more CTAs (a 72-row tree: 64 + 8 live rows), each reading the same key
tiles (from L2 when they run side by side: the row tile is the grid's fastest index).

Where it stands on an H200 (BENCHMARKS.md; ``bench/results/tree_mla_schedule_ab.json``): 1.13-1.51x
the previous Gluon kernel (8 warps, cp.async from every warp, each step waited in turn) at every
shape measured; at batch 32 x 4096 and 8 heads 61 us for 64 rows a request (60% of copy
bandwidth), 91 us for tree 9's 72 rows (41%), which pays the products of 128 rows. 32-key tiles
on four stages beat 64-key tiles on two (more bytes in flight); TMA beats cp.async (1.1-1.3x).
SM clock stamps (``trace=``, ``bench/tree_mla_timeline.py``) show one chain through the two
warpgroups: a tile costs the other's half P V (about 700 cycles) plus its softmax (about 1300),
2200 cycles at every shape. At 64 rows that is already the memory's pace. Reorderings of the loop
did not shorten it (BENCHMARKS.md).

The few-row kernel (``_tree_mla_few_rows_kernel``): a decode step has 8 rows a request at 8 heads,
a 2-node tree 16, yet the 64-row kernel multiplies 64 rows and runs its two-warpgroup chain for
them. One warpgroup a (16 rows, split, request) instead computes ``S^T = K Q^T`` with the keys on
the wgmma's 64-row M side and the rows on its N side, a softmax down each column, and ``O^T += V^T
P^T`` (V^T read from the key tile as it lies: the transposed-A form of wgmma); 64-key tiles
through a ring of ``few_rows_stages`` slots (2 at Kimi-K2's dims, 4 at the demo's; TMA or cp.async
as above). Decode shapes run 1.08-1.34x faster on it
(batch 128 x 4096: 4.0 TB/s, 96% of copy). Larger requests take a CTA a 16 rows, each re-reading
the keys, which pays at small batch and context (``few_rows_serves``). Built alongside, and
removed: the last few rows of a tree (72 = 64 + 8) on the few-row kernel after or beside the
64-row launch, which re-read every key from HBM and lost at every shape
(``bench/results/tree_mla_tails-ef8089e.json``); and the same rows attended by the 64-row CTA's
loader warpgroup, which was correct but 0.48-0.93x, since the ~120 registers it needs leave the
consumers 176 instead of 224 (``bench/results/tree_mla_tail_ablate-f2c2d20.json``); and the
transposed products for whole requests (64 rows a CTA on two warpgroups, two 64-key ring slots):
0.80-0.84x at every shape measured, and no shared memory left on Triton 3.6 for tree 9's last 8
rows (``bench/results/tree_mla_transposed-f601eeb.json``, BENCHMARKS.md).

The CPU has no Gluon: the CPU path and every CPU test use ``tree_mla_reference`` / the Triton kernel
under the interpreter; ``tests/test_tree_mla_hopper.py`` builds both kernels for sm_90, and
``bench/tree_mla_bench.py`` / ``bench/tree_mla_few_rows.py`` check them against the float32
reference on the GPU.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kernels import pdl
from kernels.device import is_hopper, on_input_device

if TYPE_CHECKING:
    from kernels.tree_mla import TreeAttentionDeviceMetadata, TreeAttentionMetadata

try:  # Gluon ships with Triton >= 3.5; absent or incompatible: the Triton kernel serves
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # pragma: no cover - depends on the installed Triton
    gluon = None

__all__ = [
    "hopper_available", "unsupported_reason", "tree_mla_hopper", "choose_splits", "tma_rows_for", "few_rows_serves",
    "few_rows_splits", "few_rows_stages",
    "BLOCK_M", "FEW_ROWS", "FEW_KEYS", "FEW_ROWS_MAX_TILES", "SUPPORTED_DIMS",
]

BLOCK_M = 64  # query rows a CTA: one wgmma M tile per warpgroup
FEW_ROWS = 16  # query rows a few-row CTA (the wgmma N side of its transposed products)
FEW_KEYS = 64  # keys a few-row tile (the wgmma M side)
FEW_ROWS_MAX_TILES = 8  # key tiles a few-row CTA may walk where a request's rows take more than one CTA
TRACE_EVENTS = 8  # stamps a trace slot holds (``tree_mla_hopper(trace=...)``)
CONSUMER_REGS = 224  # registers of each consumer warpgroup; the loader gets the rest (232: 1-3% slower, H200)
# Dims the kernel was checked at on the GPU (bench/tree_mla_bench.py): Kimi-K2 and the demo model.
SUPPORTED_DIMS = ((512, 64), (128, 32))


def hopper_available(device: torch.device | str) -> bool:
    """True where this kernel can run: Gluon importable and a CUDA device of compute capability 9.x."""
    return gluon is not None and is_hopper(torch.device(device))


def unsupported_reason(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, new_kv: Tensor) -> str | None:
    """Why these operands cannot take this kernel (None: they can): dims, dtypes and alignment."""
    kvr, rope = q_latent.shape[-1], q_pe.shape[-1]
    if q_latent.dtype not in (torch.bfloat16, torch.float16):
        return f"q is {q_latent.dtype}; the kernel takes bf16 / fp16"
    if not (kv_cache.dtype == new_kv.dtype == q_pe.dtype == q_latent.dtype):
        return "q, q_pe, kv_cache and new_kv must share one dtype"
    if (kvr, rope) not in SUPPORTED_DIMS or kv_cache.shape[-1] != kvr + rope:
        return f"latent {kvr} + rope {rope} (cache {kv_cache.shape[-1]}): supported {SUPPORTED_DIMS}"
    for name, t in (("q_latent", q_latent), ("q_pe", q_pe), ("kv_cache", kv_cache), ("new_kv", new_kv)):
        # Triton knows a stride is aligned only when it is a multiple of 16 elements.
        if t.stride(-1) != 1 or any(st % 16 for st in t.stride()[:-1]) or t.data_ptr() % 16:
            return f"{name}: rows must be contiguous, strides multiples of 16 elements, data 16-byte aligned"
    return None


def tma_rows_for(kv_cache: Tensor, block_n: int) -> int:
    """Rows one TMA copy of a key tile takes from ``kv_cache`` ``[pages, page_size, dim]``, or 0 where
    the loader must use ``cp.async``. TMA reads the cache as rows ``[pages * page_size, dim]``, so the
    pages must lie back to back; a copy must not cross a page, so it takes a divisor of the page
    (and of the tile); and a box shorter than 16 rows is not worth a copy."""
    _, page_size, _ = kv_cache.shape
    flat = kv_cache.stride(0) == page_size * kv_cache.stride(1)
    return math.gcd(page_size, block_n) if flat and page_size % 16 == 0 else 0


def choose_splits(num_requests: int, m_tiles: int, rows: int, max_prefix: int, kvr: int, rope: int, sm_count: int) -> int:
    """KV splits a request for this kernel: ``tree_mla.choose_num_splits`` (fill one wave) while a
    split's grid is under half the GPU; above that, the split count that minimises a cost model of
    whole waves. A CTA holds an SM (its shared memory and registers), so a grid of ``C`` CTAs a split
    runs ``ceil(C * s / SMs)`` waves of CTAs that each read ``1/s`` of the prefix and a q tile, and
    ``s > 1`` splits write and re-read float32 partials. Against the grid that ``choose_num_splits``
    gives (one split once a split fills half the GPU), on an H200 at batch 32 with 8 heads: tree 33
    at context 4096 / 16384 252 / 789 us with 4 splits against 320 / 1188 with 1, tree 17 149 / 474
    against 160 / 601; unchanged at batch 128 (``bench/results/tree_mla_splits_large_batch.json``)."""
    from kernels.tree_mla import choose_num_splits

    base = choose_num_splits(num_requests, m_tiles, rows, max_prefix, kvr, rope, sm_count)
    ctas = num_requests * m_tiles
    if 2 * ctas < sm_count or max_prefix < 128:
        return base
    kv_bytes = max_prefix * (kvr + rope) * 2  # a request's prefix
    q_bytes = BLOCK_M * (kvr + rope) * 2

    def cost(s: int) -> float:  # bytes a CTA slot moves, the partials spread over all SMs
        waves = -(-ctas * s // sm_count)
        partials = 0 if s == 1 else s * num_requests * rows * kvr * 4 * 2
        return waves * (kv_bytes / s + q_bytes) + partials / sm_count

    candidates = [s for s in range(1, 9) if max_prefix // s >= 64]
    return min(candidates, key=lambda s: (cost(s), s))


if gluon is not None:
    _BM = gl.constexpr(BLOCK_M)
    _COPY_ROWS = gl.constexpr(16)  # rows the loader's cp.async copies take at a time
    # Renamed after Triton 3.6 (the GPU image's); CI's newer Triton has the new names.
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _cp_async = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _EVENTS = gl.constexpr(TRACE_EVENTS)
    _FEW_ROWS = gl.constexpr(FEW_ROWS)
    _FEW_KEYS = gl.constexpr(FEW_KEYS)

    @gluon.jit
    def _trace(trace_ptr, slot, event, ok, TRACE: gl.constexpr, WALL: gl.constexpr = False):
        """Traced builds only: store this warpgroup's SM cycle count (``WALL``: the global timer, ns)
        at ``trace_ptr[slot * TRACE_EVENTS + event]``, to see where a CTA's time goes
        (``bench/tree_mla_timeline.py``). Untraced builds compile nothing here."""
        if TRACE:
            lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            lane = gl.arange(0, 128, layout=lay)
            if WALL:
                now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [lane], dtype=gl.int64,
                                                is_pure=False, pack=1)
            else:
                now = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [lane], dtype=gl.int64,
                                                is_pure=False, pack=1)
            gl.store(trace_ptr + slot.to(gl.int64) * _EVENTS + event + lane, now, mask=(lane == 0) & ok)

    @gluon.jit
    def _issue_tile(lat_buf, pe_buf, base, page, offs, key_ok, pg_size, stride_page, stride_tok,
                    KVR: gl.constexpr, ROPE: gl.constexpr, LAT_LD: gl.constexpr, PE_LD: gl.constexpr):
        """cp.async one key tile: rows ``base + slot`` (``page`` / ``offs`` in LAT_LD's row slice)."""
        slot = page.to(gl.int64) * stride_page + (offs % pg_size) * stride_tok  # [BN]
        cols = gl.arange(0, KVR, layout=gl.SliceLayout(0, LAT_LD))
        _cp_async(lat_buf, base + slot[:, None] + cols[None, :], mask=key_ok[:, None])
        slot_pe = gl.convert_layout(slot, gl.SliceLayout(1, PE_LD))
        ok_pe = gl.convert_layout(key_ok, gl.SliceLayout(1, PE_LD))
        cols_pe = KVR + gl.arange(0, ROPE, layout=gl.SliceLayout(0, PE_LD))
        _cp_async(pe_buf, base + slot_pe[:, None] + cols_pe[None, :], mask=ok_pe[:, None])

    @gluon.jit
    def _split_range(prefix_len, split, num_splits, n_nodes, BLOCK_N: gl.constexpr):
        """This split's prefix keys ``[lo, hi)`` (chunks whole tiles long), its prefix tiles, and all
        its tiles: the last split also takes the tree's own keys."""
        chunk = gl.cdiv(gl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = gl.minimum(lo + chunk, prefix_len)
        n_prefix = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        n_total = n_prefix + gl.where(split == num_splits - 1, gl.cdiv(n_nodes, BLOCK_N), 0)
        return lo, hi, n_prefix, n_total

    @gluon.jit
    def _tile_keys(t, n_prefix, lo, hi, n_nodes, offs, BLOCK_N: gl.constexpr):
        """Key positions of tile ``t`` (prefix tiles first, then the tree's own) and which exist."""
        if t < n_prefix:
            pos = lo + t * BLOCK_N + offs
            ok = pos < hi
        else:
            pos = (t - n_prefix) * BLOCK_N + offs
            ok = pos < n_nodes
        return pos, ok

    @gluon.jit
    def _copy_tile(k_lat_t, k_pe_t, ready, t, n_prefix, lo, hi, n_nodes, pt_row, page_size, kv_ptr, new_kv_ptr,
                   q_start, stride_kv_page, stride_kv_tok, stride_new_n,
                   KVR: gl.constexpr, ROPE: gl.constexpr, BLOCK_N: gl.constexpr, LAT_LD: gl.constexpr, PE_LD: gl.constexpr):
        """cp.async one key tile, ``_COPY_ROWS`` rows a copy (rows past the keys zero-filled: their
        probabilities are 0, and 0 x stale NaN would not be), then arrive on ``ready`` when landed."""
        offs_r = gl.arange(0, _COPY_ROWS, layout=gl.SliceLayout(1, LAT_LD))
        for c in gl.static_range(BLOCK_N // _COPY_ROWS):
            pos, ok = _tile_keys(t, n_prefix, lo, hi, n_nodes, c * _COPY_ROWS + offs_r, BLOCK_N)
            lat_buf = k_lat_t.slice(c * _COPY_ROWS, _COPY_ROWS)
            pe_buf = k_pe_t.slice(c * _COPY_ROWS, _COPY_ROWS)
            if t < n_prefix:
                page = gl.load(pt_row + pos // page_size, mask=ok, other=0)
                _issue_tile(lat_buf, pe_buf, kv_ptr, page, pos, ok, page_size, stride_kv_page, stride_kv_tok,
                            KVR, ROPE, LAT_LD, PE_LD)
            else:
                slot = (q_start + pos).to(gl.int64)  # new_kv row = flat query token
                _issue_tile(lat_buf, pe_buf, new_kv_ptr, slot, slot, ok, 1, stride_new_n, 0, KVR, ROPE, LAT_LD, PE_LD)
        cp.mbarrier_arrive(ready, increment_count=True)  # +1 expected arrival now, the arrival when landed
        _cta_barrier()  # every thread counted its arrival ...
        mbarrier.arrive(ready)  # ... before the one the barrier was initialised with

    @gluon.jit
    def _issue_key_tile(k_lat_t, k_pe_t, ready, t, n_prefix, lo, hi, n_nodes, pt_row, page_size, kv_ptr, new_kv_ptr,
                        q_start, stride_kv_page, stride_kv_tok, stride_new_n, lat_desc, pe_desc,
                        KVR: gl.constexpr, ROPE: gl.constexpr, BLOCK_N: gl.constexpr, TMA_ROWS: gl.constexpr,
                        LAT_LD: gl.constexpr, PE_LD: gl.constexpr):
        """Key tile t into one ring slot: a whole prefix tile by TMA where the cache allows, anything
        else by cp.async (rows past the keys zero-filled)."""
        if TMA_ROWS > 0:
            start = lo + t * BLOCK_N
            if (t < n_prefix) & (start + BLOCK_N <= hi):
                mbarrier.expect(ready, BLOCK_N * (KVR + ROPE) * 2)
                for c in gl.static_range(BLOCK_N // TMA_ROWS):
                    pos = start + c * TMA_ROWS
                    page = gl.load(pt_row + pos // page_size)
                    row = page * page_size + pos % page_size
                    _tma_load(lat_desc, [row, 0], ready, k_lat_t.slice(c * TMA_ROWS, TMA_ROWS))
                    _tma_load(pe_desc, [row, 0], ready, k_pe_t.slice(c * TMA_ROWS, TMA_ROWS))
            else:
                _copy_tile(k_lat_t, k_pe_t, ready, t, n_prefix, lo, hi, n_nodes, pt_row, page_size, kv_ptr, new_kv_ptr,
                           q_start, stride_kv_page, stride_kv_tok, stride_new_n, KVR, ROPE, BLOCK_N, LAT_LD, PE_LD)
        else:
            _copy_tile(k_lat_t, k_pe_t, ready, t, n_prefix, lo, hi, n_nodes, pt_row, page_size, kv_ptr, new_kv_ptr,
                       q_start, stride_kv_page, stride_kv_tok, stride_new_n, KVR, ROPE, BLOCK_N, LAT_LD, PE_LD)

    @gluon.jit
    def _loader(q_lat, q_pe, k_lat, k_pe, q_ready, kv_ready, kv_free, lat_desc, pe_desc,
                q_lat_ptr, q_pe_ptr, kv_ptr, new_kv_ptr, pt_row, q_start, pid_m, rows, num_heads,
                n_prefix, n_total, lo, hi, n_nodes, page_size,
                stride_ql_n, stride_ql_h, stride_qp_n, stride_qp_h, stride_kv_page, stride_kv_tok, stride_new_n,
                trace_ptr, trace_slot,
                KVR: gl.constexpr, ROPE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                TMA_ROWS: gl.constexpr, LOADER_WARPS: gl.constexpr, TRACE: gl.constexpr, TRACE_TILES: gl.constexpr):
        """Stream the q tile and every key tile into the ring. Whole prefix tiles go by TMA
        (``TMA_ROWS`` rows a copy, so a copy never crosses a page) where ``TMA_ROWS > 0``; a split's
        last, partial tile and the tree's own keys by cp.async, which zero-fills the rows past the
        keys."""
        LAT_LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [LOADER_WARPS, 1], [1, 0])
        PE_LD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (ROPE // 8), ROPE // 8], [LOADER_WARPS, 1], [1, 0])
        offs_r = gl.arange(0, _COPY_ROWS, layout=gl.SliceLayout(1, LAT_LD))
        cols = gl.arange(0, KVR, layout=gl.SliceLayout(0, LAT_LD))
        offs_rp = gl.arange(0, _COPY_ROWS, layout=gl.SliceLayout(1, PE_LD))
        cols_pe = gl.arange(0, ROPE, layout=gl.SliceLayout(0, PE_LD))
        for c in gl.static_range(_BM // _COPY_ROWS):
            offs_m = pid_m * _BM + c * _COPY_ROWS + offs_r
            tok = (q_start + offs_m // num_heads).to(gl.int64)
            q_ptrs = q_lat_ptr + (tok * stride_ql_n + (offs_m % num_heads) * stride_ql_h)[:, None] + cols[None, :]
            _cp_async(q_lat.slice(c * _COPY_ROWS, _COPY_ROWS), q_ptrs, mask=(offs_m < rows)[:, None])
            offs_mp = pid_m * _BM + c * _COPY_ROWS + offs_rp
            tok_p = (q_start + offs_mp // num_heads).to(gl.int64)
            qp_ptrs = q_pe_ptr + (tok_p * stride_qp_n + (offs_mp % num_heads) * stride_qp_h)[:, None] + cols_pe[None, :]
            _cp_async(q_pe.slice(c * _COPY_ROWS, _COPY_ROWS), qp_ptrs, mask=(offs_mp < rows)[:, None])
        cp.mbarrier_arrive(q_ready, increment_count=False)
        for t in range(n_total):
            st = t % NUM_STAGES
            _trace(trace_ptr, trace_slot + t, 0, t < TRACE_TILES, TRACE)
            mbarrier.wait(kv_free.index(st), ((t // NUM_STAGES) & 1) ^ 1)  # both warpgroups are done with it
            _trace(trace_ptr, trace_slot + t, 1, t < TRACE_TILES, TRACE)
            _issue_key_tile(k_lat.index(st), k_pe.index(st), kv_ready.index(st), t, n_prefix, lo, hi, n_nodes, pt_row,
                            page_size, kv_ptr, new_kv_ptr, q_start, stride_kv_page, stride_kv_tok, stride_new_n,
                            lat_desc, pe_desc, KVR, ROPE, BLOCK_N, TMA_ROWS, LAT_LD, PE_LD)
        cp.commit_group()
        cp.wait_group(0)  # belt and braces: the consumers already wait for every copy (q_ready, kv_ready)

    @gluon.jit
    def _logits(q_lat, q_pe, k_lat_t, k_pe_t, BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr):
        """Issue ``S = Q K^T`` for one resident tile (async; the caller waits)."""
        s0 = gl.zeros([_BM, BLOCK_N], gl.float32, layout=S_LAYOUT)
        s = warpgroup_mma(q_lat, k_lat_t.permute((1, 0)), s0, use_acc=False, is_async=True)
        return warpgroup_mma(q_pe, k_pe_t.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _softmax(s, j, m_i, l_i, n_prefix, lo, hi, n_nodes, bits_row, row_ok, scale_log2,
                 BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr, P_DTYPE: gl.constexpr):
        """Tile j's softmax from its logits ``s`` and the row stats through tile j-1: the new max and
        sum, P (bf16) and the rescale of what came before."""
        offs_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        if j < n_prefix:  # prefix keys past the split's end are masked
            key_ok = (lo + j * BLOCK_N + offs_s) < hi
            s_mask = gl.full([_BM, BLOCK_N], 1, gl.int1, layout=S_LAYOUT) & key_ok[None, :]
        else:  # the tree's own keys: visible where the ancestor bit is set (one or two words a row and tile)
            w0 = (j - n_prefix) * (BLOCK_N // 32)
            word = gl.load(bits_row + w0, mask=row_ok & (w0 * 32 < n_nodes), other=0)[:, None]  # [BM, 1]
            if BLOCK_N == 64:
                hi_w = gl.load(bits_row + w0 + 1, mask=row_ok & ((w0 + 1) * 32 < n_nodes), other=0)
                word = gl.where((offs_s < 32)[None, :], word, hi_w[:, None])  # [BM, BN]
            s_mask = (((word >> (offs_s % 32)[None, :]) & 1) != 0) & ((w0 * 32 + offs_s) < n_nodes)[None, :]
        s = gl.where(s_mask, s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet stay finite
        alpha = gl.exp2(m_i - m_use)
        p32 = gl.exp2(s - m_use[:, None])
        l_new = l_i * alpha + gl.sum(p32, 1)
        return m_new, l_new, p32.to(P_DTYPE), alpha

    @gluon.jit
    def _publish_p(p, m_i, l_i, alpha, p_buf, m_smem, l_smem, a_smem, p_ready, j):
        """P of tile j and the row max / sum / rescale into shared memory for the other warpgroup's
        ``P V``, on ``p_ready[j % 2]``."""
        m_smem.store(m_i)
        l_smem.store(l_i)
        a_smem.store(alpha)
        p_buf.store(p)
        fence_async_shared()  # the other warpgroup's wgmma reads it through the async proxy
        _cta_barrier()  # every thread of this warpgroup wrote its part
        mbarrier.arrive(p_ready.index(j % 2))

    @gluon.jit
    def _own_pv(acc, p, alpha, v_tile, ROLE: gl.constexpr, HALF: gl.constexpr, O_LAYOUT: gl.constexpr):
        """This warpgroup's half of ``P V`` for a tile it owns, P from registers (waited: the
        accumulator is loop-carried)."""
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))
        p_op = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2))
        acc = warpgroup_mma(p_op, v_tile.slice(ROLE * HALF, HALF, dim=1), acc * alpha_o[:, None], is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    @gluon.jit
    def _other_pv(acc, alpha_o, p_buf, v_tile, ROLE: gl.constexpr, HALF: gl.constexpr):
        """This warpgroup's half of ``P V`` for a tile the other one owns, P from shared memory (waited)."""
        acc = warpgroup_mma(p_buf, v_tile.slice(ROLE * HALF, HALF, dim=1), acc * alpha_o[:, None], is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    @gluon.jit
    def _store_out(acc, m_i, l_i, out_ptr, o_part_ptr, lse_part_ptr, q_start, pid_m, split, rows, num_heads,
                   total_rows, ROLE: gl.constexpr, KVR: gl.constexpr, DIRECT: gl.constexpr, O_LAYOUT: gl.constexpr):
        """This warpgroup's half of the output rows: the output itself (one split) or the split's
        float32 partial, and (warpgroup 0) the rows' log-sum-exps for the merge."""
        HALF: gl.constexpr = KVR // 2
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)  # an empty split: weight 0 in the merge
        o = acc / gl.convert_layout(l_safe, ROW_O)[:, None]
        offs_o = pid_m * _BM + gl.arange(0, _BM, layout=ROW_O)
        flat_o = q_start.to(gl.int64) * num_heads + offs_o
        cols = ROLE * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_LAYOUT))
        ok_o = (offs_o < rows)[:, None]
        if DIRECT:
            gl.store(out_ptr + flat_o[:, None] * KVR + cols[None, :], o.to(out_ptr.dtype.element_ty), mask=ok_o)
        else:
            part = split.to(gl.int64) * total_rows + flat_o
            gl.store(o_part_ptr + part[:, None] * KVR + cols[None, :], o, mask=ok_o)
            if ROLE == 0:
                offs_row = pid_m * _BM + gl.arange(0, _BM, layout=m_i.type.layout)
                lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_safe))
                lse_part = split.to(gl.int64) * total_rows + q_start.to(gl.int64) * num_heads + offs_row
                gl.store(lse_part_ptr + lse_part, lse, mask=offs_row < rows)

    @gluon.jit
    def _consumer(q_lat, q_pe, k_lat, k_pe, p_smem, m_smem, l_smem, a_smem, q_ready, kv_ready, kv_free, p_ready,
                  anc_bits_ptr, out_ptr, o_part_ptr, lse_part_ptr,
                  q_start, pid_m, split, rows, num_heads, n_prefix, n_total, lo, hi, n_nodes,
                  total_rows, stride_anc_n, scale_log2, trace_ptr, trace_slot,
                  ROLE: gl.constexpr, KVR: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  DIRECT: gl.constexpr, TRACE: gl.constexpr, TRACE_TILES: gl.constexpr):
        """One warpgroup: value dims ``[ROLE * KVR/2, (ROLE + 1) * KVR/2)`` of every tile's ``P V``, and
        the logits and softmax of the tiles ``t % 2 == ROLE``. The owner of tile t publishes its
        probabilities (shared memory) and the running max / sum / rescale (``m_smem`` / ``l_smem`` / ``a_smem``) on
        ``p_ready[t % 2]``; the other warpgroup reads them for its half. Each warpgroup issues the
        logits of its next tile before it waits for the other's probabilities, so one warpgroup's
        MMAs run while the other's softmax does."""
        HALF: gl.constexpr = KVR // 2
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

        acc = gl.zeros([_BM, HALF], gl.float32, layout=O_LAYOUT)
        m_i = gl.full([_BM], float("-inf"), gl.float32, layout=ROW_S)
        l_i = gl.zeros([_BM], gl.float32, layout=ROW_S)
        offs_row = pid_m * _BM + gl.arange(0, _BM, layout=ROW_S)
        bits_row = anc_bits_ptr + (q_start + offs_row // num_heads).to(gl.int64) * stride_anc_n
        row_ok = offs_row < rows
        head = trace_slot + TRACE_TILES  # this warpgroup's start / end stamps
        _trace(trace_ptr, head, 0, True, TRACE)
        _trace(trace_ptr, head, 2, True, TRACE, True)
        mbarrier.wait(q_ready, 0)
        _trace(trace_ptr, head, 4, True, TRACE)
        if ROLE == 0:
            if n_total >= 1:  # tile 0: no earlier tile to fold in
                mbarrier.wait(kv_ready.index(0), 0)
                s = _logits(q_lat, q_pe, k_lat.index(0), k_pe.index(0), BLOCK_N, S_LAYOUT)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                m_i, l_i, p, alpha = _softmax(s, 0, m_i, l_i, n_prefix, lo, hi, n_nodes, bits_row, row_ok, scale_log2,
                                              BLOCK_N, S_LAYOUT, p_smem.dtype)
                _publish_p(p, m_i, l_i, alpha, p_smem, m_smem, l_smem, a_smem, p_ready, 0)
                acc = _own_pv(acc, p, alpha, k_lat.index(0), ROLE, HALF, O_LAYOUT)
                mbarrier.arrive(kv_free.index(0))
        for j in range(2 - ROLE, n_total, 2):  # the tiles this warpgroup owns, each after the other's j-1
            st = j % NUM_STAGES
            sp = (j - 1) % NUM_STAGES
            slot = trace_slot + j
            traced = j < TRACE_TILES
            _trace(trace_ptr, slot, 0, traced, TRACE)
            mbarrier.wait(kv_ready.index(st), (j // NUM_STAGES) & 1)
            _trace(trace_ptr, slot, 1, traced, TRACE)
            s = _logits(q_lat, q_pe, k_lat.index(st), k_pe.index(st), BLOCK_N, S_LAYOUT)
            mbarrier.wait(p_ready.index((j - 1) % 2), ((j - 1) // 2) & 1)
            _trace(trace_ptr, slot, 2, traced, TRACE)
            m_i = m_smem.load(ROW_S)
            l_i = l_smem.load(ROW_S)
            alpha_o = a_smem.load(ROW_O)
            acc = warpgroup_mma(p_smem, k_lat.index(sp).slice(ROLE * HALF, HALF, dim=1), acc * alpha_o[:, None],
                                is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # the logits; P V of tile j-1 may still run
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # ... it read p_smem before we rewrite it
            mbarrier.arrive(kv_free.index(sp))
            _trace(trace_ptr, slot, 3, traced, TRACE)
            m_i, l_i, p, alpha = _softmax(s, j, m_i, l_i, n_prefix, lo, hi, n_nodes, bits_row, row_ok, scale_log2,
                                          BLOCK_N, S_LAYOUT, p_smem.dtype)
            _publish_p(p, m_i, l_i, alpha, p_smem, m_smem, l_smem, a_smem, p_ready, j)
            _trace(trace_ptr, slot, 4, traced, TRACE)
            acc = _own_pv(acc, p, alpha, k_lat.index(st), ROLE, HALF, O_LAYOUT)
            _trace(trace_ptr, slot, 5, traced, TRACE)
            mbarrier.arrive(kv_free.index(st))
        if n_total >= 1:
            if (n_total - 1) % 2 != ROLE:  # the last tile is the other's: its half here
                j = n_total - 1
                mbarrier.wait(kv_ready.index(j % NUM_STAGES), (j // NUM_STAGES) & 1)
                mbarrier.wait(p_ready.index(j % 2), (j // 2) & 1)
                m_i = m_smem.load(ROW_S)
                l_i = l_smem.load(ROW_S)
                acc = _other_pv(acc, a_smem.load(ROW_O), p_smem, k_lat.index(j % NUM_STAGES), ROLE, HALF)
                mbarrier.arrive(kv_free.index(j % NUM_STAGES))

        _trace(trace_ptr, head, 1, True, TRACE)
        _trace(trace_ptr, head, 3, True, TRACE, True)
        _store_out(acc, m_i, l_i, out_ptr, o_part_ptr, lse_part_ptr, q_start, pid_m, split, rows, num_heads,
                   total_rows, ROLE, KVR, DIRECT, O_LAYOUT)

    @gluon.jit(do_not_specialize=["stride_pt_r", "stride_anc_n", "num_heads", "total_rows", "num_splits"])
    def _tree_mla_hopper_kernel(
        q_lat_ptr, q_pe_ptr, kv_ptr, new_kv_ptr, lat_desc, pe_desc,
        page_table_ptr, prefix_lens_ptr, query_starts_ptr, anc_bits_ptr,
        out_ptr, o_part_ptr, lse_part_ptr,
        stride_ql_n, stride_ql_h, stride_qp_n, stride_qp_h,
        stride_kv_page, stride_kv_tok, stride_new_n, stride_pt_r, stride_anc_n,
        num_heads, page_size, total_rows, num_splits, scale_log2, trace_ptr,
        KVR: gl.constexpr, ROPE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, DIRECT: gl.constexpr,
        TMA_ROWS: gl.constexpr, CONSUMER_REGS: gl.constexpr, TRACE: gl.constexpr, TRACE_TILES: gl.constexpr,
        Q_LAT_SMEM: gl.constexpr, Q_PE_SMEM: gl.constexpr, K_LAT_SMEM: gl.constexpr, K_PE_SMEM: gl.constexpr,
        P_SMEM: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
    ):
        """One 64-row tile, one split, one request a CTA: the loader (default partition, 4 warps) and
        the two consumer warpgroups (``_consumer``, ROLE 0 / 1)."""
        pdl.grid_sync_gluon(PDL)
        dtype: gl.constexpr = q_lat_ptr.dtype.element_ty
        pid_m = gl.program_id(0)
        split = gl.program_id(1)
        r = gl.program_id(2)
        q_start = gl.load(query_starts_ptr + r)
        n_nodes = gl.load(query_starts_ptr + r + 1) - q_start
        rows = n_nodes * num_heads
        if pid_m * _BM < rows:
            prefix_len = gl.load(prefix_lens_ptr + r)
            lo, hi, n_prefix, n_total = _split_range(prefix_len, split, num_splits, n_nodes, BLOCK_N)

            q_lat = gl.allocate_shared_memory(dtype, [_BM, KVR], Q_LAT_SMEM)
            q_pe = gl.allocate_shared_memory(dtype, [_BM, ROPE], Q_PE_SMEM)
            k_lat = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, KVR], K_LAT_SMEM)
            k_pe = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, ROPE], K_PE_SMEM)
            p_smem = gl.allocate_shared_memory(dtype, [_BM, BLOCK_N], P_SMEM)
            flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
            m_smem = gl.allocate_shared_memory(gl.float32, [_BM], flat)
            l_smem = gl.allocate_shared_memory(gl.float32, [_BM], flat)
            a_smem = gl.allocate_shared_memory(gl.float32, [_BM], flat)
            q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
            kv_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
            p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(NUM_STAGES):
                mbarrier.init(kv_ready.index(i), count=1)
                mbarrier.init(kv_free.index(i), count=2)
            for i in gl.static_range(2):
                mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(q_ready, count=32 * num_warps)
            fence_async_shared()
            pt_row = page_table_ptr + r * stride_pt_r
            cta = (r * num_splits + split) * gl.num_programs(0) + pid_m
            slots = TRACE_TILES + 1  # a partition's trace: a slot a tile, then its start / end stamps
            gl.warp_specialize([
                (_loader, (q_lat, q_pe, k_lat, k_pe, q_ready, kv_ready, kv_free, lat_desc, pe_desc,
                           q_lat_ptr, q_pe_ptr, kv_ptr, new_kv_ptr, pt_row, q_start, pid_m, rows, num_heads,
                           n_prefix, n_total, lo, hi, n_nodes, page_size,
                           stride_ql_n, stride_ql_h, stride_qp_n, stride_qp_h, stride_kv_page, stride_kv_tok,
                           stride_new_n, trace_ptr, cta * 3 * slots,
                           KVR, ROPE, BLOCK_N, NUM_STAGES, TMA_ROWS, num_warps, TRACE, TRACE_TILES)),
                (_consumer, (q_lat, q_pe, k_lat, k_pe, p_smem, m_smem, l_smem, a_smem, q_ready, kv_ready, kv_free,
                             p_ready, anc_bits_ptr, out_ptr, o_part_ptr, lse_part_ptr,
                             q_start, pid_m, split, rows, num_heads, n_prefix, n_total, lo, hi, n_nodes,
                             total_rows, stride_anc_n, scale_log2, trace_ptr, (cta * 3 + 1) * slots,
                             0, KVR, BLOCK_N, NUM_STAGES, DIRECT, TRACE, TRACE_TILES)),
                (_consumer, (q_lat, q_pe, k_lat, k_pe, p_smem, m_smem, l_smem, a_smem, q_ready, kv_ready, kv_free,
                             p_ready, anc_bits_ptr, out_ptr, o_part_ptr, lse_part_ptr,
                             q_start, pid_m, split, rows, num_heads, n_prefix, n_total, lo, hi, n_nodes,
                             total_rows, stride_anc_n, scale_log2, trace_ptr, (cta * 3 + 2) * slots,
                             1, KVR, BLOCK_N, NUM_STAGES, DIRECT, TRACE, TRACE_TILES)),
            ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])

    @gluon.jit(do_not_specialize=["stride_pt_r", "stride_anc_n", "num_heads", "total_rows", "num_splits"])
    def _tree_mla_few_rows_kernel(
        q_lat_ptr, q_pe_ptr, kv_ptr, new_kv_ptr, lat_desc, pe_desc,
        page_table_ptr, prefix_lens_ptr, query_starts_ptr, anc_bits_ptr,
        out_ptr, o_part_ptr, lse_part_ptr,
        stride_ql_n, stride_ql_h, stride_qp_n, stride_qp_h,
        stride_kv_page, stride_kv_tok, stride_new_n, stride_pt_r, stride_anc_n,
        num_heads, page_size, total_rows, num_splits, scale_log2,
        KVR: gl.constexpr, ROPE: gl.constexpr, NUM_STAGES: gl.constexpr, DIRECT: gl.constexpr, TMA_ROWS: gl.constexpr,
        Q_LAT_SMEM: gl.constexpr, Q_PE_SMEM: gl.constexpr, K_LAT_SMEM: gl.constexpr, K_PE_SMEM: gl.constexpr,
        P_SMEM: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
    ):
        """Rows ``[g * FEW_ROWS, (g + 1) * FEW_ROWS)`` of one request, one split, one warpgroup: the products
        transposed, so the keys fill the wgmma's 64-row M side and the few query rows its N side.
        ``S^T = K Q^T`` ``[64 keys, 16 rows]``, a softmax down each column, ``O^T += V^T P^T``
        ``[kvr, 16]`` (64 fp32 registers a thread at kvr 512). The 64-row kernel would multiply
        64 rows (and run its two-warpgroup chain) for these 8 or 16; here a tile's products are
        a quarter of its. Keys stream through a ring of ``NUM_STAGES`` 64-key slots, each refilled
        once its products are done."""
        pdl.grid_sync_gluon(PDL)
        BN: gl.constexpr = _FEW_KEYS
        RN: gl.constexpr = _FEW_ROWS
        dtype: gl.constexpr = q_lat_ptr.dtype.element_ty
        row0 = gl.program_id(0) * RN
        split = gl.program_id(1)
        r = gl.program_id(2)
        q_start = gl.load(query_starts_ptr + r)
        n_nodes = gl.load(query_starts_ptr + r + 1) - q_start
        prefix_len = gl.load(prefix_lens_ptr + r)  # beside the loads above, not after them
        rows = n_nodes * num_heads
        if row0 < rows:
            lo, hi, n_prefix, n_total = _split_range(prefix_len, split, num_splits, n_nodes, BN)

            q_lat = gl.allocate_shared_memory(dtype, [RN, KVR], Q_LAT_SMEM)
            q_pe = gl.allocate_shared_memory(dtype, [RN, ROPE], Q_PE_SMEM)
            k_lat = gl.allocate_shared_memory(dtype, [NUM_STAGES, BN, KVR], K_LAT_SMEM)
            k_pe = gl.allocate_shared_memory(dtype, [NUM_STAGES, BN, ROPE], K_PE_SMEM)
            p_smem = gl.allocate_shared_memory(dtype, [RN, BN], P_SMEM)
            ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(NUM_STAGES):
                mbarrier.init(ready.index(i), count=1)
            fence_async_shared()
            pt_row = page_table_ptr + r * stride_pt_r

            # q: row i is node (row0 + i) // H, head (row0 + i) % H; rows past the request read as 0
            LAT_LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
            PE_LD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (ROPE // 8), ROPE // 8], [num_warps, 1], [1, 0])
            offs_q = row0 + gl.arange(0, RN, layout=gl.SliceLayout(1, LAT_LD))
            tok = (q_start + offs_q // num_heads).to(gl.int64)
            cols = gl.arange(0, KVR, layout=gl.SliceLayout(0, LAT_LD))
            _cp_async(q_lat, q_lat_ptr + (tok * stride_ql_n + (offs_q % num_heads) * stride_ql_h)[:, None] + cols[None, :],
                      mask=(offs_q < rows)[:, None])
            offs_qp = row0 + gl.arange(0, RN, layout=gl.SliceLayout(1, PE_LD))
            tok_p = (q_start + offs_qp // num_heads).to(gl.int64)
            cols_pe = gl.arange(0, ROPE, layout=gl.SliceLayout(0, PE_LD))
            _cp_async(q_pe, q_pe_ptr + (tok_p * stride_qp_n + (offs_qp % num_heads) * stride_qp_h)[:, None] + cols_pe[None, :],
                      mask=(offs_qp < rows)[:, None])
            cp.commit_group()
            for t0 in gl.static_range(NUM_STAGES):  # fill the ring
                if t0 < n_total:
                    _issue_key_tile(k_lat.index(t0), k_pe.index(t0), ready.index(t0), t0, n_prefix, lo, hi, n_nodes,
                                    pt_row, page_size, kv_ptr, new_kv_ptr, q_start, stride_kv_page, stride_kv_tok,
                                    stride_new_n, lat_desc, pe_desc, KVR, ROPE, BN, TMA_ROWS, LAT_LD, PE_LD)
            cp.wait_group(0)  # q's group (the tiles' copies report to their barriers)
            fence_async_shared()
            _cta_barrier()

            S_T: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, RN, 16])
            COL: gl.constexpr = gl.SliceLayout(0, S_T)
            offs_k = gl.arange(0, BN, layout=gl.SliceLayout(1, S_T))
            offs_n = row0 + gl.arange(0, RN, layout=COL)
            row_ok = offs_n < rows
            bits_col = anc_bits_ptr + (q_start + offs_n // num_heads).to(gl.int64) * stride_anc_n
            acc = gl.zeros([KVR, RN], gl.float32, layout=S_T)
            m_i = gl.full([RN], float("-inf"), gl.float32, layout=COL)
            l_i = gl.zeros([RN], gl.float32, layout=COL)
            for t in range(n_total):
                st = t % NUM_STAGES
                mbarrier.wait(ready.index(st), (t // NUM_STAGES) & 1)
                s = gl.zeros([BN, RN], gl.float32, layout=S_T)
                s = warpgroup_mma(k_lat.index(st), q_lat.permute((1, 0)), s, use_acc=False, is_async=True)
                s = warpgroup_mma(k_pe.index(st), q_pe.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                if t < n_prefix:  # prefix keys past the split's end are masked
                    key_ok = (lo + t * BN + offs_k) < hi
                    s_mask = gl.full([BN, RN], 1, gl.int1, layout=S_T) & key_ok[:, None]
                else:  # the tree's own keys: visible where the row's node has the key's ancestor bit
                    kk = (t - n_prefix) * BN + offs_k
                    word = gl.load(bits_col[None, :] + (kk // 32)[:, None], mask=(kk < n_nodes)[:, None] & row_ok[None, :],
                                   other=0)
                    s_mask = ((word >> (kk % 32)[:, None]) & 1) != 0
                s = gl.where(s_mask, s * scale_log2, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 0))
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # columns that saw no key yet stay finite
                alpha = gl.exp2(m_i - m_use)
                p = gl.exp2(s - m_use[None, :])
                l_i = l_i * alpha + gl.sum(p, 0)
                m_i = m_new
                p_smem.store(gl.permute(p.to(dtype), [1, 0]))
                fence_async_shared()
                _cta_barrier()  # every thread's part of P is in place before the product reads it
                acc = warpgroup_mma(k_lat.index(st).permute((1, 0)), p_smem.permute((1, 0)), acc * alpha[None, :],
                                    is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                if t + NUM_STAGES < n_total:  # the slot's products are done: refill it
                    _issue_key_tile(k_lat.index(st), k_pe.index(st), ready.index(st), t + NUM_STAGES, n_prefix, lo, hi,
                                    n_nodes, pt_row, page_size, kv_ptr, new_kv_ptr, q_start, stride_kv_page,
                                    stride_kv_tok, stride_new_n, lat_desc, pe_desc, KVR, ROPE, BN, TMA_ROWS, LAT_LD, PE_LD)

            # out[row, d] = O^T[d, row] / l, stored with d contiguous
            OUT_L: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, num_warps], [0, 1])
            l_safe = gl.where(l_i == 0.0, 1.0, l_i)  # an empty split: weight 0 in the merge
            o = gl.convert_layout(acc / l_safe[None, :], OUT_L)
            offs_o = row0 + gl.arange(0, RN, layout=gl.SliceLayout(0, OUT_L))
            flat_o = q_start.to(gl.int64) * num_heads + offs_o
            d = gl.arange(0, KVR, layout=gl.SliceLayout(1, OUT_L))
            ok_o = gl.full([KVR, RN], 1, gl.int1, layout=OUT_L) & (offs_o < rows)[None, :]
            if DIRECT:
                gl.store(out_ptr + flat_o[None, :] * KVR + d[:, None], o.to(out_ptr.dtype.element_ty), mask=ok_o)
            else:
                part = split.to(gl.int64) * total_rows + flat_o
                gl.store(o_part_ptr + part[None, :] * KVR + d[:, None], o, mask=ok_o)
                lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_safe))
                lse_at = split.to(gl.int64) * total_rows + q_start.to(gl.int64) * num_heads + offs_n
                gl.store(lse_part_ptr + lse_at, lse, mask=row_ok)


@on_input_device
def tree_mla_hopper(
    q_latent: Tensor,
    q_pe: Tensor,
    kv_cache: Tensor,
    new_kv: Tensor,
    meta: TreeAttentionMetadata | TreeAttentionDeviceMetadata,
    softmax_scale: float,
    *,
    num_splits: int | None = None,
    block_n: int = 32,
    num_stages: int = 4,
    trace: Tensor | None = None,
    few_rows: bool | None = None,
) -> Tensor:
    """``tree_mla_triton``'s contract on the Gluon kernel: same arguments (host metadata is packed
    here, with a host sync), same result ``[N, H, kvr]``. Needs ``hopper_available`` and operands
    ``unsupported_reason`` accepts. ``block_n`` / ``num_stages``: key-tile rows and ring depth; the
    served 32 / 4 and the alternative 64 / 2 fill the H200's shared memory (H200, batch 32 x 4096,
    8 heads: 61 / 91 / 160 us at 64 / 72 / 136 rows a request against 80 / 113 / 182;
    ``bench/results/tree_mla_schedule_ab.json``). ``trace``: an int64 ``[CTAs, 3, tiles + 1,
    TRACE_EVENTS]`` buffer builds a copy of the kernel that stamps SM clocks into it
    (``bench/tree_mla_timeline.py`` reads them): CTA ``(r * splits + split) * m_tiles + m``,
    partition loader / consumer 0 / 1, a slot per key tile (the first ``tiles``), then one of start
    and end stamps. ``few_rows``: True takes the few-row kernel (one warpgroup a ``FEW_ROWS`` rows,
    transposed products; ``block_n`` / ``num_stages`` / ``trace`` are the 64-row kernel's), False the
    64-row one, None what ``few_rows_serves`` says."""
    from kernels.tree_mla import (
        _LOG2E, _shared_memory_limit, _sm_count, check_operands, merge_splits, split_partials,
    )

    if not hopper_available(q_latent.device):
        raise RuntimeError(f"tree_mla_hopper needs Triton's Gluon and a compute capability 9.x GPU; q is on {q_latent.device}")
    reason = unsupported_reason(q_latent, q_pe, kv_cache, new_kv)
    if reason is not None:
        raise ValueError(f"tree_mla_hopper: {reason}")
    meta = check_operands(q_latent, q_pe, kv_cache, new_kv, meta)
    kv_bytes = kv_cache.shape[-1] * kv_cache.element_size()
    assert block_n in (32, 64) and num_stages >= 2, f"block_n {block_n} / num_stages {num_stages}"
    need = (BLOCK_M + block_n * num_stages) * kv_bytes + BLOCK_M * block_n * 2 + 1024  # + P tile, row stats, barriers
    limit = _shared_memory_limit(q_latent.device)
    assert limit is None or need <= limit, f"q and {num_stages} tiles of {block_n} keys need {need} bytes of shared memory, {limit} here"
    if num_splits is not None:
        assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    N, H, kvr = q_latent.shape
    rope = q_pe.shape[-1]
    _, page_size, _ = kv_cache.shape
    R = meta.num_requests
    out = torch.empty(N, H, kvr, dtype=q_latent.dtype, device=q_latent.device)
    if N == 0 or R == 0:
        return out
    rows = meta.max_nodes * H
    max_prefix = meta.page_table.shape[1] * page_size
    sms = _sm_count(q_latent.device)
    if few_rows is None:
        few_rows = few_rows_serves(R, rows, max_prefix, sms)
    few = trace is None and few_rows
    groups = -(-rows // FEW_ROWS)
    m_tiles = -(-rows // BLOCK_M)
    if num_splits is None:
        num_splits = (few_rows_splits(R * groups, max_prefix, sms) if few
                      else choose_splits(R, m_tiles, rows, max_prefix, kvr, rope, sms))
    total_rows = N * H
    o_part, lse_part = split_partials(out, num_splits, 1)
    gdt = gl.bfloat16 if q_latent.dtype == torch.bfloat16 else gl.float16
    if few:
        _launch_few_rows(q_latent, q_pe, kv_cache, new_kv, meta, softmax_scale * _LOG2E, out, o_part, lse_part,
                         num_splits, groups, gdt, limit)
        merge_splits(o_part, lse_part, out, num_splits, 1, after_ctas=groups * num_splits * R)
        return out
    smem = {
        "Q_LAT_SMEM": gl.NVMMASharedLayout.get_default_for([BLOCK_M, kvr], gdt),
        "Q_PE_SMEM": gl.NVMMASharedLayout.get_default_for([BLOCK_M, rope], gdt),
        "K_LAT_SMEM": gl.NVMMASharedLayout.get_default_for([block_n, kvr], gdt),
        "K_PE_SMEM": gl.NVMMASharedLayout.get_default_for([block_n, rope], gdt),
        "P_SMEM": gl.NVMMASharedLayout.get_default_for([BLOCK_M, block_n], gdt),
    }
    trace_tiles = 0
    if trace is not None:
        ctas = m_tiles * num_splits * R
        trace_tiles = trace.shape[2] - 1
        assert trace.dtype == torch.int64 and trace.is_contiguous() and trace.dim() == 4 and trace.shape[0] >= ctas \
            and trace.shape[1] == 3 and trace_tiles >= 1 and trace.shape[3] == TRACE_EVENTS, \
            f"trace: int64 [>= {ctas}, 3, tiles + 1, {TRACE_EVENTS}], contiguous; got {trace.dtype} {tuple(trace.shape)}"
    tma_rows, lat_desc, pe_desc = _key_descriptors(kv_cache, kvr, block_n, smem)
    use_pdl = pdl.enabled(q_latent.device) and trace is None  # a traced CTA's start stamp would include its wait
    _tree_mla_hopper_kernel[(m_tiles, num_splits, R)](
        q_latent, q_pe, kv_cache, new_kv, lat_desc, pe_desc,
        meta.page_table, meta.prefix_lens, meta.query_starts, meta.ancestor_bits,
        out, o_part, lse_part,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), new_kv.stride(0), meta.page_table.stride(0), meta.ancestor_bits.stride(0),
        H, page_size, total_rows, num_splits, softmax_scale * _LOG2E, out if trace is None else trace,
        KVR=kvr, ROPE=rope, BLOCK_N=block_n, NUM_STAGES=num_stages, DIRECT=num_splits == 1, TMA_ROWS=tma_rows,
        CONSUMER_REGS=CONSUMER_REGS, TRACE=trace is not None, TRACE_TILES=trace_tiles, **smem, PDL=use_pdl, num_warps=4,
        launch_pdl=use_pdl,
    )
    merge_splits(o_part, lse_part, out, num_splits, 1, after_ctas=m_tiles * num_splits * R)
    return out


def _key_descriptors(kv_cache: Tensor, kvr: int, block_n: int, smem: dict) -> tuple[int, object, object]:
    """``tma_rows_for``'s rows a copy, and the TMA descriptors of the cache's latent and rope columns
    read as rows ``[pages * page_size, dim]`` (built, unused, where the loader must use cp.async)."""
    pages, page_size, dim = kv_cache.shape
    tma_rows = tma_rows_for(kv_cache, block_n)
    box = max(tma_rows, 16)
    kv_rows = kv_cache.as_strided((pages * page_size if tma_rows else page_size, dim), (kv_cache.stride(1), 1))
    lat_desc = TensorDescriptor.from_tensor(kv_rows[:, :kvr], [box, kvr], smem["K_LAT_SMEM"])
    pe_desc = TensorDescriptor.from_tensor(kv_rows[:, kvr:], [box, dim - kvr], smem["K_PE_SMEM"])
    return tma_rows, lat_desc, pe_desc


def few_rows_serves(num_requests: int, rows: int, max_prefix: int, sm_count: int) -> bool:
    """Whether ``tree_mla_hopper`` takes the few-row kernel (``few_rows=None``). Where a request has at
    most ``FEW_ROWS`` rows (a decode step, or a 2-node tree, at 8 heads) it reads the keys once, as
    the 64-row kernel does, with a quarter of the products: always. Above that each 16-row group
    reads the keys again (from L2 when the groups run together), which pays while the GPU has room:
    while a CTA walks at most ``FEW_ROWS_MAX_TILES`` key tiles at ``few_rows_splits``' count. On an
    H200 at 8 heads (``bench/results/tree_mla_few_rows_groups-6000c41.json``) every swept tree shape
    under that bound ran 1.10-1.43x faster on the few-row kernel (batch 1 x 4096: tree 9 23.7 -> 17.4
    us, tree 17 23.9 -> 18.5); at 10 tiles it ranged 0.96-1.23x, past it down to 0.25x."""
    groups = -(-rows // FEW_ROWS)
    if groups == 1:
        return True
    splits = few_rows_splits(num_requests * groups, max_prefix, sm_count)
    return -(-max_prefix // (splits * FEW_KEYS)) <= FEW_ROWS_MAX_TILES


def few_rows_splits(ctas_a_split: int, max_prefix: int, sm_count: int) -> int:
    """KV splits for the few-row kernel: about ``0.375 * sqrt(context)`` (a CTA's keys shrink as
    ``1 / splits`` while the merge's reads grow with them), at most one wave of CTAs, at least 64
    keys a split. At one node and 8 heads on an H200 (``bench/results/tree_mla_few_rows_splits-7e54300.json``,
    ``tree_mla_few_rows_merges-4a9229d.json``) the best swept counts were 8-16 / 24 / 48 at batch 1 and
    context 1024 / 4096 / 16384 (24 at 4096: 16.5 us against 19.6 with 32, the wave-filling count),
    24 at batch 4 x 4096 and one wave (16, 8) at batch 8 and 16."""
    if max_prefix <= 0:
        return 1
    want = math.ceil(0.375 * math.sqrt(max_prefix))
    return max(1, min(want, sm_count // max(1, ctas_a_split), max_prefix // 64))


def few_rows_stages(kvr: int, rope: int, elem_bytes: int, limit_bytes: int | None) -> int:
    """Ring slots (64 keys each, 2 to 4) of the few-row kernel that fit beside its q rows, P and
    the output's layout change: 2 at Kimi-K2's 512 + 64 (H200: 227 KB a CTA), 4 at the demo's."""
    kv_bytes = (kvr + rope) * elem_bytes
    fixed = FEW_ROWS * kv_bytes + FEW_ROWS * FEW_KEYS * elem_bytes + kvr * FEW_ROWS * 4 + 2048
    limit = limit_bytes if limit_bytes is not None else 227 << 10
    stages = min(4, (limit - fixed) // (FEW_KEYS * kv_bytes))
    assert stages >= 2, f"the few-row kernel needs two {FEW_KEYS}-key slots of {kv_bytes} bytes a key; {limit} bytes here"
    return stages


def _launch_few_rows(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, new_kv: Tensor, meta: TreeAttentionDeviceMetadata,
                     scale_log2: float, out: Tensor, o_part: Tensor, lse_part: Tensor, num_splits: int, groups: int,
                     gdt: object, limit: int | None) -> None:
    """Every request's rows on the few-row kernel: a CTA a (group of ``FEW_ROWS`` rows, split, request)."""
    N, H, kvr = q_latent.shape
    rope = q_pe.shape[-1]
    _, page_size, _ = kv_cache.shape
    smem = {
        "Q_LAT_SMEM": gl.NVMMASharedLayout.get_default_for([FEW_ROWS, kvr], gdt),
        "Q_PE_SMEM": gl.NVMMASharedLayout.get_default_for([FEW_ROWS, rope], gdt),
        "K_LAT_SMEM": gl.NVMMASharedLayout.get_default_for([FEW_KEYS, kvr], gdt),
        "K_PE_SMEM": gl.NVMMASharedLayout.get_default_for([FEW_KEYS, rope], gdt),
        "P_SMEM": gl.NVMMASharedLayout.get_default_for([FEW_ROWS, FEW_KEYS], gdt),
    }
    tma_rows, lat_desc, pe_desc = _key_descriptors(kv_cache, kvr, FEW_KEYS, smem)
    use_pdl = pdl.enabled(q_latent.device)
    _tree_mla_few_rows_kernel[(groups, num_splits, meta.num_requests)](
        q_latent, q_pe, kv_cache, new_kv, lat_desc, pe_desc,
        meta.page_table, meta.prefix_lens, meta.query_starts, meta.ancestor_bits,
        out, o_part, lse_part,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), new_kv.stride(0), meta.page_table.stride(0), meta.ancestor_bits.stride(0),
        H, page_size, N * H, num_splits, scale_log2,
        KVR=kvr, ROPE=rope, NUM_STAGES=few_rows_stages(kvr, rope, q_latent.element_size(), limit),
        DIRECT=num_splits == 1, TMA_ROWS=tma_rows, **smem, PDL=use_pdl, num_warps=4,
        launch_pdl=use_pdl,
    )
