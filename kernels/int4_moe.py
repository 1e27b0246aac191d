"""Fused INT4 MoE (routed experts): token-expert alignment, gate/up GEMM with SiLU, down GEMM.

Why fused: a decode / tree-verify step routes a few to a few hundred tokens through K2's 384
experts. Each activated expert's weights are streamed from HBM once per step (once per block of
``BLOCK_M`` of its tokens), dequantised in registers from the checkpoint's compressed-tensors
``pack-quantized`` layout as stored (no repacking at load), and multiplied on the tensor cores.
No launch syncs with the host, so the op can be captured in a CUDA graph:

1. ``_int4_moe_count_kernel`` (a program per chunk of assignments): assignments per expert;
   ``_int4_moe_align_kernel`` (``ALIGN_PROGRAMS`` programs): per-expert padding to ``BLOCK_M``,
   ``block_expert`` (expert of each block of ``BLOCK_M`` rows, -1 when unused) and sentinels in
   the padding rows;
   ``_int4_moe_scatter_kernel`` (a program per chunk) writes ``sorted_ids`` (flat assignment
   ``token * top_k + slot`` per padded row).
2. ``_int4_moe_gemm_kernel`` (GATED): ``h = silu(x Wg^T) * (x Wu^T)`` per padded row. With
   ``gu_split_k > 1`` (small M) K slices write fp32 partial sums to a workspace, and the last
   slice of each output tile to finish (a counter a tile, ``kernels.device.tile_counters``) adds
   them in slice order and forms ``h``: one launch, deterministic.
3. ``_int4_moe_gemm_kernel`` (not GATED): ``h Wd^T`` times the routing weight, written per
   assignment (``reduce="sum"``, then ``_int4_moe_topk_sum_kernel`` adds each token's rows in slot
   order: deterministic) or added atomically per token (``reduce="atomic"``).

Small M (``cfg.gemv``; ``choose_config`` takes it for a handful of assignments, one token a
request, i.e. decode): there the path
above is mostly overhead, 38 us at M=1 TP8 for 25 MB of weights (~7 us at HBM speed): each token
pads a 16-row MMA block, and alignment, a zero-fill, split-K atomics, a SiLU kernel and a torch sum
surrounded the two GEMMs then. The GEMV path is two launches with none of these, on the CUDA cores:

4. ``_int4_moe_gemv_gate_up_kernel``: one program per (assignment, ``BLOCK_N`` intermediate rows)
   streams those rows of its expert's gate and up weights, dequantises them (same tile loader),
   multiplies by ``x[token]`` into fp32 ``[BLOCK_N, BLOCK_K]`` partial sums (reduced once, after the
   K loop) and writes ``h[a] = silu(g) * u``, ``[A, I]``.
5. ``_int4_moe_gemv_down_kernel``: one program per (token, ``BLOCK_N`` hidden rows) runs over its
   top-k slots and sums them itself in a fixed order: deterministic, no atomics, no torch sum.

An expert chosen by several tokens is streamed once per token (from L2 after the first), so the
GEMV path pays only while assignments are few.

Grid order (tensor cores): the block index varies fastest, so the blocks of one expert (and, at
small M, all experts for one N tile) run side by side and share weight tiles through L2.

Dequantisation: element ``8j + i`` of a row is bits ``4i .. 4i+3`` of int32 word ``j`` and
decodes to ``(nibble - 8) * scale[row, col // group]``. On CUDA with bf16 activations and scales
(K2's format) ``_dequant_int4_bf16x2`` does two nibbles per 32-bit op in PTX (``| 0x4300`` makes
the bf16 ``128 + n``; ``- 136`` is exact; ``* scale`` rounds once, like the reference): 27-30%
fewer instructions per element than the portable path and 5-9% faster end to end (K2 M=72). The
portable path (CPU interpreter, fp16/fp32) masks a nibble into the mantissa of 1.0f and uses one
FMA with per-group constants (``_plane``), exact for bf16/fp16 scales; float32 scales, for which
those constants round, take ``_dequant_int4_exact`` (shift, mask, ``(n - 8) * scale``). The eight nibble planes
``[BN, BK/8]`` go back to K order with ``tl.interleave``.

``SWAP_AB`` computes ``W @ X^T`` instead of ``X @ W^T``: the weight tile is the MMA's M side
(>= 16 rows of output features) and the few tokens its N side, the usual layout for skinny GEMMs.

Where this kernel stands on an H200 (BENCHMARKS.md): 29-42% of copy bandwidth at K2 shapes
(vLLM's Triton int4 kernel: 5-11%); M=1 TP8 in 21 us on the GEMV path. Not the access pattern:
the same tile loads alone read at 3.9-4.2 TB/s. Nsight Compute on gate/up (TP8, M=72): 3 warps
per scheduler, 7 cycles between issues, DRAM 28% busy: latency-bound between the loads, the
dequantisation and the shared-memory round trip of the MMA operands (Triton converts the
dequantised tile to the operand layout through shared memory: four times the bytes of the INT4
words). On Hopper the tensor-core launches run ``kernels/int4_moe_hopper.py`` instead (Gluon,
weights dequantised straight into the operand registers, weight words by TMA: 55-72% of copy at
EP8 M=1-72, 52-74% at TP8 M=9-1152, 40% at EP8 M=288);
this kernel serves other GPUs and the CPU tests.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import int4_moe_hopper as hop
from kernels import pdl
from kernels.device import TILE_COUNTERS, on_input_device, tile_counters
from kernels.int4_ptx import DEQUANT_BF16X2, DEQUANT_BF16X2_CONSTRAINTS

from services.common.int4 import Int4Weight, unpack_int4

__all__ = [
    "Int4MoEConfig",
    "MoEAlignment",
    "fused_int4_moe",
    "int4_moe_align",
    "int4_moe_gate_up",
    "int4_moe_down",
    "int4_moe_gemv",
    "int4_moe_gemv_gate_up",
    "int4_moe_gemv_down",
    "int4_moe_reference",
    "choose_config",
    "CONFIG_ENV",
    "config_from_env",
]

_DEQ_BF16X2_PTX = tl.constexpr(DEQUANT_BF16X2)
_DEQ_BF16X2_CONSTRAINTS = tl.constexpr(DEQUANT_BF16X2_CONSTRAINTS)

# Pins one config, e.g. "bm=16,gu=64x128x4x3,dn=128x64x4x4,split=4" (tensor cores) or
# "gemv=1,gv=8x256x4x1,gvd=16x128x4x1" (GEMV: block_n x block_k x warps x stages per kernel).
CONFIG_ENV = "DDTREE_INT4_MOE_CONFIG"


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["A"])
def _int4_moe_count_kernel(
    ids_ptr,  # [A] int32/int64 flat top-k expert ids
    counts_ptr,  # [E_PAD] int32, zeroed: assignments per expert
    A,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.grid_sync(PDL)
    i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    ok = i < A
    ids = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)  # [CHUNK]
    tl.atomic_add(counts_ptr + ids, tl.full([CHUNK], 1, tl.int32), mask=ok, sem="relaxed")


@triton.jit(do_not_specialize=["A", "P", "NUM_BLOCKS"])
def _int4_moe_align_kernel(
    counts_ptr,  # [E_PAD] int32: assignments per expert
    cursor_ptr,  # [E_PAD] int32 out: first padded row of each expert (the scatter's cursors)
    sorted_ids_ptr,  # [P] int32 out: A at every row no assignment takes (the scatter fills the rest)
    block_expert_ptr,  # [P / BLOCK_M] int32 out: expert of each block, -1 when unused
    A,
    E,
    P,
    NUM_BLOCKS,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,  # power of two >= E
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Every program lays out the experts' rows from the counts (a cumsum over E_PAD lanes), then
    writes its share of the sentinels and block experts: the stores, not the cumsum, are the work,
    and one program doing them all took 8.9 us at K2 TP8 M = 1152 (``int4_moe_steps.json``)."""
    pdl.grid_sync(PDL)
    g = tl.program_id(0)
    G = tl.num_programs(0)
    offs_e = tl.arange(0, E_PAD)  # [E_PAD]
    offs_c = tl.arange(0, CHUNK)  # [CHUNK]
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)  # [E_PAD]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]
    ends = tl.cumsum(padded, 0)  # [E_PAD]
    starts = ends - padded  # [E_PAD]
    if g == 0:
        tl.store(cursor_ptr + offs_e, starts)
    # Sentinels only where no assignment lands, so the scatter needs no ordering against them:
    # each expert's padding rows, then every row past the last expert's.
    for j in range(g, BLOCK_M - 1, G):
        tl.store(sorted_ids_ptr + starts + counts + j, tl.zeros([E_PAD], dtype=tl.int32) + A, mask=j < padded - counts)
    used = tl.sum(padded, 0)
    for p0 in range(g * CHUNK, P, G * CHUNK):
        p = p0 + offs_c  # [CHUNK]
        tl.store(sorted_ids_ptr + p, tl.zeros([CHUNK], dtype=tl.int32) + A, mask=(p >= used) & (p < P))
    for b0 in range(g * CHUNK, NUM_BLOCKS, G * CHUNK):
        b = b0 + offs_c  # [CHUNK]
        tl.store(block_expert_ptr + b, tl.full([CHUNK], -1, tl.int32), mask=(b * BLOCK_M >= used) & (b < NUM_BLOCKS))
    nblk = padded // BLOCK_M  # [E_PAD]
    first = starts // BLOCK_M  # [E_PAD]
    for j in range(g, tl.max(nblk, 0), G):
        tl.store(block_expert_ptr + first + j, offs_e, mask=j < nblk)


@triton.jit(do_not_specialize=["A"])
def _int4_moe_scatter_kernel(
    ids_ptr,  # [A] int32/int64 flat top-k expert ids
    sorted_ids_ptr,  # [P] int32 out: flat assignment per padded row
    cursor_ptr,  # [E_PAD] int32: next free padded row per expert (``_int4_moe_align_kernel``'s starts)
    counts_ptr,  # [E_PAD] int32: the count kernel's counts, zeroed here for the next call
    A,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.grid_sync(PDL)
    if tl.program_id(0) == 0:  # the align kernel, which read them, has finished
        tl.store(counts_ptr + tl.arange(0, E_PAD), tl.zeros([E_PAD], dtype=tl.int32))
    i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    ok = i < A
    ids = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)  # [CHUNK]
    # Row order inside an expert is whatever the atomics give: each row's result depends on
    # that row alone, so the output is the same for any order.
    slot = tl.atomic_add(cursor_ptr + ids, tl.full([CHUNK], 1, tl.int32), mask=ok, sem="relaxed")  # [CHUNK]
    tl.store(sorted_ids_ptr + slot, i, mask=ok)


@triton.jit
def _int4_moe_topk_sum_kernel(
    rows_ptr,  # [M, TOP_K, K] per-assignment down rows
    out_ptr,  # [M, K]
    K,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[t] = sum_j rows[t, j]`` in fp32, slots in order (deterministic), 16-byte accesses."""
    pdl.grid_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    ok = c < K
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (t * TOP_K + j) * K + c, mask=ok, other=0).to(tl.float32)
    tl.store(out_ptr + t * K + c, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _plane(q, POS: tl.constexpr, b, c):
    """The nibble at bits ``POS .. POS+3`` of ``q`` as a weight: ``(n - 8) * scale``.

    ``(q & 0xF << POS) | bits(1.0f)`` is the float ``1 + n * 2^(POS-23)``; with ``b = 2^(23-POS) *
    scale`` and ``c = -(2^(23-POS) + 8) * scale`` one FMA gives ``(n - 8) * scale`` exactly (the
    product is exact inside the FMA, and ``c`` is exact for bf16/fp16 scales at POS >= 8).
    """
    return tl.fma(((q & (0xF << POS)) | 0x3F800000).to(tl.float32, bitcast=True), b, c)


@triton.jit
def _dequant_int4_exact(p, s, DTYPE: tl.constexpr, GROUP: tl.constexpr):
    """``_dequant_int4`` for float32 scales: the one-FMA constants ``-(2^k + 8) * s`` round for
    them (a zero nibble came out about ``s / 512`` from 0), so ``(n - 8) * s`` is formed as the
    reference forms it, one rounding. About twice the instructions; no served checkpoint has such
    scales (K2's are bf16)."""
    if GROUP == 32:  # one scale per 4 words: [BN, BKW/4] -> [BN, BKW]
        s = tl.interleave(s, s)
        s = tl.interleave(s, s)
    v0 = ((((p >> 0) & 0xF) - 8).to(tl.float32) * s).to(DTYPE)
    v1 = ((((p >> 4) & 0xF) - 8).to(tl.float32) * s).to(DTYPE)
    v2 = ((((p >> 8) & 0xF) - 8).to(tl.float32) * s).to(DTYPE)
    v3 = ((((p >> 12) & 0xF) - 8).to(tl.float32) * s).to(DTYPE)
    v4 = ((((p >> 16) & 0xF) - 8).to(tl.float32) * s).to(DTYPE)
    v5 = ((((p >> 20) & 0xF) - 8).to(tl.float32) * s).to(DTYPE)
    v6 = ((((p >> 24) & 0xF) - 8).to(tl.float32) * s).to(DTYPE)
    v7 = ((((p >> 28) & 0xF) - 8).to(tl.float32) * s).to(DTYPE)
    even = tl.interleave(tl.interleave(v0, v4), tl.interleave(v2, v6))
    odd = tl.interleave(tl.interleave(v1, v5), tl.interleave(v3, v7))
    return tl.interleave(even, odd)  # [BN, 8 * BKW]


@triton.jit
def _dequant_int4(p, s, DTYPE: tl.constexpr, GROUP: tl.constexpr, EXACT: tl.constexpr):
    """``p [BN, BKW]`` int32 words, ``s [BN, BKW // (GROUP // 8)]`` float32 scales -> ``[BN, 8*BKW]``.
    ``EXACT``: the scales were float32 in memory (`_dequant_int4_exact`).

    Each nibble is read at bit 8, 12 or 16 of the word or of one of three shifted copies
    (``p << 8``, ``p >> 8``, ``p >> 16``): 3 shifts per 8 nibbles instead of 7.
    """
    if EXACT:
        return _dequant_int4_exact(p, s, DTYPE, GROUP)
    b8 = s * 32768.0  # POS 8: 2^15
    c8 = s * -32776.0
    b12 = s * 2048.0  # POS 12: 2^11
    c12 = s * -2056.0
    b16 = s * 128.0  # POS 16: 2^7
    c16 = s * -136.0
    if GROUP == 32:  # one scale per 4 words: [BN, BKW/4] -> [BN, BKW]
        b8 = tl.interleave(b8, b8)
        b8 = tl.interleave(b8, b8)
        c8 = tl.interleave(c8, c8)
        c8 = tl.interleave(c8, c8)
        b12 = tl.interleave(b12, b12)
        b12 = tl.interleave(b12, b12)
        c12 = tl.interleave(c12, c12)
        c12 = tl.interleave(c12, c12)
        b16 = tl.interleave(b16, b16)
        b16 = tl.interleave(b16, b16)
        c16 = tl.interleave(c16, c16)
        c16 = tl.interleave(c16, c16)
    pl8 = p << 8  # nibbles 0, 1 at bits 8, 12
    pr8 = p >> 8  # nibble 5 at bit 12
    pr16 = p >> 16  # nibbles 6, 7 at bits 8, 12
    v0 = _plane(pl8, 8, b8, c8).to(DTYPE)
    v1 = _plane(pl8, 12, b12, c12).to(DTYPE)
    v2 = _plane(p, 8, b8, c8).to(DTYPE)
    v3 = _plane(p, 12, b12, c12).to(DTYPE)
    v4 = _plane(p, 16, b16, c16).to(DTYPE)
    v5 = _plane(pr8, 12, b12, c12).to(DTYPE)
    v6 = _plane(pr16, 8, b8, c8).to(DTYPE)
    v7 = _plane(pr16, 12, b12, c12).to(DTYPE)
    # Interleave tree: (0,4) (2,6) -> 0,2,4,6 ; (1,5) (3,7) -> 1,3,5,7 ; then 0..7 per word.
    even = tl.interleave(tl.interleave(v0, v4), tl.interleave(v2, v6))
    odd = tl.interleave(tl.interleave(v1, v5), tl.interleave(v3, v7))
    return tl.interleave(even, odd)  # [BN, 8 * BKW]


@triton.jit
def _dequant_int4_bf16x2(p, s):
    """GPU-only twin of ``_dequant_int4`` for bf16 activations and bf16 scales (``s [BN, BKW]``):
    the PTX of ``kernels/int4_ptx.py``, about half the instructions per element of the fp32 path
    (no bf16 conversion, two elements per op)."""
    return tl.inline_asm_elementwise(
        asm=_DEQ_BF16X2_PTX,
        constraints=_DEQ_BF16X2_CONSTRAINTS,
        args=[p, s],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _load_int4_tile(
    w_base, s_base, n_ok, k0, KW, KG,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr, DEQ_ASM: tl.constexpr,
):
    """Dequantised ``[BN, BLOCK_K]`` tile of one expert's weight, columns ``k0 .. k0+BLOCK_K``.

    ``w_base [BN, 1]`` points at the packed rows, ``s_base [BN, 1]`` at the scale rows (rows past
    N are clamped by the caller, so only a K tail needs masks).
    """
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK/8] word index
    if EVEN_K:
        p = tl.load(w_base + kw[None, :])  # [BN, BK/8] int32
    else:
        p = tl.load(w_base + kw[None, :], mask=(kw < KW)[None, :], other=0)
    if GROUP == 32:
        kg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)  # [BK/32]
    else:
        kg = (k0 + 8 * tl.arange(0, BLOCK_K // 8)) // GROUP  # [BK/8] group of each word
    if EVEN_K:
        s = tl.load(s_base + kg[None, :])
    else:
        s = tl.load(s_base + kg[None, :], mask=(kg < KG)[None, :], other=0)
    if DEQ_ASM:
        if GROUP == 32:  # [BN, BK/32] -> [BN, BK/8]: 4 words per group
            s = tl.interleave(s, s)
            s = tl.interleave(s, s)
        v0, v1, v2, v3, v4, v5, v6, v7 = _dequant_int4_bf16x2(p, s)
        even = tl.interleave(tl.interleave(v0, v4), tl.interleave(v2, v6))
        odd = tl.interleave(tl.interleave(v1, v5), tl.interleave(v3, v7))
        w = tl.interleave(even, odd)  # [BN, BK]
    else:
        w = _dequant_int4(p, s.to(tl.float32), DTYPE, GROUP, s.dtype == tl.float32)  # [BN, BK]
    return w


@triton.jit(do_not_specialize=["A", "top_k", "num_m_blocks"])
def _int4_moe_gemm_kernel(
    a_ptr,  # GATED: hidden [M, K]; else h [P, K] (K = intermediate)
    w0_ptr,  # [E, N, K/8] int32: gate (GATED) or down
    s0_ptr,  # [E, N, K/GROUP] scales of w0
    w1_ptr,  # [E, N, K/8] int32: up (GATED only)
    s1_ptr,  # [E, N, K/GROUP] scales of w1
    out_ptr,  # GATED: h [P, N]; reduce sum: [A, N]; atomic: [M, N] fp32
    ws_ptr,  # GATED, SPLIT_K > 1: [SPLIT_K, P, 2N] fp32 partial sums, gate | up (else unused)
    count_ptr,  # GATED, SPLIT_K > 1: int32 counters, one an output tile, zero between launches
    sorted_ids_ptr,  # [P] int32 flat assignment per padded row (A = padding)
    block_expert_ptr,  # [P / BLOCK_M] int32
    topk_w_ptr,  # [A] routing weights (not GATED)
    N,
    K,
    A,
    top_k,
    num_m_blocks,
    k_split,  # K range of one split (a multiple of BLOCK_K)
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    stride_ws,  # elements from one split's partials to the next's (P * 2N)
    GATED: tl.constexpr,
    ATOMIC: tl.constexpr,
    SWAP_AB: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # GATED: programs per output tile along K; the last to finish adds their sums
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks in the main loop
    DEQ_ASM: tl.constexpr,  # bf16x2 PTX dequantisation (GPU, bf16 activations and scales)
    DOT_F32: tl.constexpr,  # CPU interpreter only: its tl.dot multiplies bf16 bit patterns
    DTYPE: tl.constexpr,  # activation dtype: dequantised weights are cast to it
):
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    pid_n = (pid // num_m_blocks) % tl.cdiv(N, BLOCK_N)
    pid_k = pid // (num_m_blocks * tl.cdiv(N, BLOCK_N))
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] padded rows
    flat = tl.load(sorted_ids_ptr + offs_m)  # [BM]
    row_ok = flat < A  # [BM]
    if GATED:
        a_rows = flat // top_k  # [BM] token of each assignment
    else:
        a_rows = offs_m
    a_rows = tl.where(row_ok, a_rows, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    n_rd = tl.where(n_ok, offs_n, N - 1).to(tl.int64)  # rows past N read row N-1; never stored
    KW = K // 8
    KG = K // GROUP
    e64 = expert.to(tl.int64)
    w0_base = w0_ptr + e64 * stride_we + n_rd[:, None] * stride_wn  # [BN, 1]
    s0_base = s0_ptr + e64 * stride_se + n_rd[:, None] * stride_sn  # [BN, 1]
    w1_base = w1_ptr + e64 * stride_we + n_rd[:, None] * stride_wn  # [BN, 1]
    s1_base = s1_ptr + e64 * stride_se + n_rd[:, None] * stride_sn  # [BN, 1]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    if SWAP_AB:
        acc0 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = tl.multiple_of(pid_k * k_split, BLOCK_K)  # k_split is a multiple of BLOCK_K: aligned 16-byte copies
    k_hi = tl.minimum(k_lo + k_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k  # [BK]
        # Padding rows read row 0 of A (a_rows is clamped); their results are never stored.
        if SWAP_AB:
            a_ptrs = a_ptr + a_rows[None, :] * stride_am + kk[:, None]  # [BK, BM]
            k_mask = (kk < K)[:, None]
        else:
            a_ptrs = a_ptr + a_rows[:, None] * stride_am + kk[None, :]  # [BM, BK]
            k_mask = (kk < K)[None, :]
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k_mask, other=0)
        if DOT_F32:
            a = a.to(tl.float32)
        b0 = _load_int4_tile(w0_base, s0_base, n_ok, k0, KW, KG, GROUP, BLOCK_K, EVEN_K, DTYPE, DEQ_ASM)  # [BN, BK]
        if DOT_F32:
            b0 = b0.to(tl.float32)
        if SWAP_AB:
            acc0 = tl.dot(b0, a, acc0)  # [BN, BM]
        else:
            acc0 = tl.dot(a, tl.trans(b0), acc0)  # [BM, BN]
        if GATED:
            b1 = _load_int4_tile(w1_base, s1_base, n_ok, k0, KW, KG, GROUP, BLOCK_K, EVEN_K, DTYPE, DEQ_ASM)  # [BN, BK]
            if DOT_F32:
                b1 = b1.to(tl.float32)
            if SWAP_AB:
                acc1 = tl.dot(b1, a, acc1)
            else:
                acc1 = tl.dot(a, tl.trans(b1), acc1)
    if GATED:
        rows = offs_m.to(tl.int64)
    else:
        wt = tl.load(topk_w_ptr + flat, mask=row_ok, other=0).to(tl.float32)  # [BM]
        if SWAP_AB:
            res = acc0 * wt[None, :]
        else:
            res = acc0 * wt[:, None]
        if ATOMIC:
            rows = (flat // top_k).to(tl.int64)
        else:
            rows = flat.to(tl.int64)
    if SWAP_AB:
        o_ptrs = out_ptr + rows[None, :] * stride_om + offs_n[:, None]  # [BN, BM]
        o_mask = row_ok[None, :] & n_ok[:, None]
    else:
        o_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]  # [BM, BN]
        o_mask = row_ok[:, None] & n_ok[None, :]
    if GATED:
        if SPLIT_K > 1:
            # This slice's partial sums; the last slice of the tile to finish adds all of them in
            # slice order (the result does not depend on which finished last) and resets the count.
            if SWAP_AB:
                part = ws_ptr + rows[None, :] * (2 * N) + offs_n[:, None]  # [BN, BM] in split 0
            else:
                part = ws_ptr + rows[:, None] * (2 * N) + offs_n[None, :]  # [BM, BN]
            tl.store(part + pid_k * stride_ws, acc0, mask=o_mask)
            tl.store(part + pid_k * stride_ws + N, acc1, mask=o_mask)
            tl.debug_barrier()  # every thread's partials are written before the count says so
            tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
            if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                acc0 = tl.zeros_like(acc0)
                acc1 = tl.zeros_like(acc1)
                for s in tl.static_range(SPLIT_K):
                    acc0 += tl.load(part + s * stride_ws, mask=o_mask, other=0.0, cache_modifier=".cg")
                    acc1 += tl.load(part + s * stride_ws + N, mask=o_mask, other=0.0, cache_modifier=".cg")
                tl.store(count_ptr + tile, 0)  # ready for the next launch (and graph replay)
                tl.store(o_ptrs, (acc0 / (1.0 + tl.exp(-acc0)) * acc1).to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            tl.store(o_ptrs, (acc0 / (1.0 + tl.exp(-acc0)) * acc1).to(out_ptr.dtype.element_ty), mask=o_mask)  # silu(gate) * up
    elif ATOMIC:
        tl.atomic_add(o_ptrs, res, mask=o_mask, sem="relaxed")
    else:
        tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["top_k"])
def _int4_moe_gemv_gate_up_kernel(
    x_ptr,  # [M, K] hidden
    ids_ptr,  # [A] int32/int64 flat top-k expert ids (token-major)
    wg_ptr,  # [E, N, K/8] int32 gate
    sg_ptr,  # [E, N, K/GROUP] gate scales
    wu_ptr,  # [E, N, K/8] int32 up (same strides as gate)
    su_ptr,  # [E, N, K/GROUP] up scales
    h_ptr,  # [A, N] out: silu(gate x) * (up x) per assignment
    N,
    K,
    top_k,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_hm,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,  # > 1: software-pipeline the weight loads of the K loop
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks in the loop
    DEQ_ASM: tl.constexpr,
    DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (assignment, BLOCK_N rows of the intermediate dim); grid (A, cdiv(N, BLOCK_N)).

    The assignment index varies fastest, so assignments of one expert (same N tile) run side by
    side and share its weight rows through L2.
    """
    pdl.grid_sync(PDL)
    a = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + a).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    n_rd = tl.where(n_ok, offs_n, N - 1).to(tl.int64)  # rows past N read row N-1; never stored
    wg_base = wg_ptr + expert * stride_we + n_rd[:, None] * stride_wn  # [BN, 1]
    sg_base = sg_ptr + expert * stride_se + n_rd[:, None] * stride_sn  # [BN, 1]
    wu_base = wu_ptr + expert * stride_we + n_rd[:, None] * stride_wn  # [BN, 1]
    su_base = su_ptr + expert * stride_se + n_rd[:, None] * stride_sn  # [BN, 1]
    x_row = x_ptr + (a // top_k) * stride_xm
    KW = K // 8
    KG = K // GROUP
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    # Elementwise fp32 partial products, reduced over K once after the loop.
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        kk = k0 + offs_k  # [BK]
        if EVEN_K:
            xk = tl.load(x_row + kk)
        else:
            xk = tl.load(x_row + kk, mask=kk < K, other=0)
        xk = xk.to(tl.float32)[None, :]  # [1, BK]
        g = _load_int4_tile(wg_base, sg_base, n_ok, k0, KW, KG, GROUP, BLOCK_K, EVEN_K, DTYPE, DEQ_ASM)  # [BN, BK]
        acc_g += g.to(tl.float32) * xk
        u = _load_int4_tile(wu_base, su_base, n_ok, k0, KW, KG, GROUP, BLOCK_K, EVEN_K, DTYPE, DEQ_ASM)  # [BN, BK]
        acc_u += u.to(tl.float32) * xk
    gate = tl.sum(acc_g, 1)  # [BN]
    up = tl.sum(acc_u, 1)  # [BN]
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + a * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["top_k"])
def _int4_moe_gemv_down_kernel(
    h_ptr,  # [A, K] gate/up output per assignment (K = intermediate)
    ids_ptr,  # [A] int32/int64 flat top-k expert ids (token-major)
    topk_w_ptr,  # [A] routing weights
    w_ptr,  # [E, N, K/8] int32 down (N = hidden)
    s_ptr,  # [E, N, K/GROUP] scales
    out_ptr,  # [M, N] out
    N,
    K,
    top_k,
    stride_hm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    DEQ_ASM: tl.constexpr,
    DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (token, BLOCK_N rows of the hidden dim); grid (M, cdiv(N, BLOCK_N)).

    The sum over the token's top-k slots happens in the program (fixed order: deterministic, no
    atomics, no torch sum). Slots and K steps are one flat loop: K2 TP8's K = 256 is only one or
    two steps per slot, too short a loop to stream on its own. ``h`` is scaled by the slot's
    routing weight, so one accumulator serves all slots and is reduced once.
    """
    pdl.grid_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    n_rd = tl.where(n_ok, offs_n, N - 1).to(tl.int64)  # rows past N read row N-1; never stored
    w_rows = w_ptr + n_rd[:, None] * stride_wn  # [BN, 1]
    s_rows = s_ptr + n_rd[:, None] * stride_sn  # [BN, 1]
    KW = K // 8
    KG = K // GROUP
    nk = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for it in tl.range(0, top_k * nk, num_stages=STAGES):
        j = it // nk  # top-k slot
        k0 = (it - j * nk) * BLOCK_K
        a = t * top_k + j  # flat assignment
        expert = tl.load(ids_ptr + a).to(tl.int64)
        wt = tl.load(topk_w_ptr + a).to(tl.float32)
        kk = k0 + offs_k  # [BK]
        if EVEN_K:
            hk = tl.load(h_ptr + a * stride_hm + kk)
        else:
            hk = tl.load(h_ptr + a * stride_hm + kk, mask=kk < K, other=0)
        hk = (hk.to(tl.float32) * wt)[None, :]  # [1, BK]
        w = _load_int4_tile(
            w_rows + expert * stride_we, s_rows + expert * stride_se, n_ok, k0, KW, KG,
            GROUP, BLOCK_K, EVEN_K, DTYPE, DEQ_ASM,
        )  # [BN, BK]
        acc += w.to(tl.float32) * hk
    out = tl.sum(acc, 1)  # [BN]
    tl.store(out_ptr + t * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Int4MoEConfig:
    """Launch parameters of one call. ``gu_*`` for the gate/up GEMM, ``dn_*`` for down; with
    ``gemv`` the GEMV path runs instead, ``gv_*`` for its gate/up kernel and ``gvd_*`` for down."""

    block_m: int = 16
    gu_block_n: int = 32
    gu_block_k: int = 256
    gu_warps: int = 4
    gu_stages: int = 3
    dn_block_n: int = 64
    dn_block_k: int = 256
    dn_warps: int = 4
    dn_stages: int = 3
    swap_ab: bool = True
    reduce: str = "sum"  # "sum": per-assignment rows, then a sum over top-k in slot order; "atomic": fp32 atomics
    gu_split_k: int = 1  # > 1: gate/up over K slices, the last of a tile adds their sums (small M: more programs)
    deq_asm: bool = True  # bf16x2 PTX dequantisation where it applies (CUDA, bf16 activations + scales)
    hopper: bool = True  # the Gluon kernels of kernels/int4_moe_hopper.py where they apply (sm_90, bf16, swap_ab)
    hp_stages: int = 2  # their ring depth (H200, K2 shapes: 2 best or within 0.1% of 3; 4 and 6 slower)
    hp_dn_tiles: int = 1  # down weight tiles one Gluon CTA streams (a short intermediate keeps its ring full)
    hp_gu_tma: bool = True  # Gluon gate/up: weight words by TMA (K2, H200: 1.07-1.38x), not cp.async
    hp_dn_tma: bool = False  # the same for the Gluon down GEMM (wins only on whole experts)
    hp_gu_regs: int = 0  # Gluon gate/up: registers a thread (maxnreg), so more CTAs share an SM; 0: ptxas's choice
    # GEMV path (few assignments): no alignment, CUDA-core dot products per assignment / token.
    # Defaults: choose_config's TP-style GEMV config above 8 assignments (see _gemv_launch).
    gemv: bool = False
    gv_block_n: int = 4  # gate/up: intermediate rows per program
    gv_block_k: int = 512  # gate/up: hidden columns per loop step
    gv_warps: int = 2
    gv_stages: int = 1  # > 1: software-pipelined weight loads (tl.range num_stages)
    gvd_block_n: int = 16  # down: hidden rows per program
    gvd_block_k: int = 256  # down: intermediate columns per loop step
    gvd_warps: int = 2
    gvd_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "gu_block_n", "gu_block_k", "dn_block_n", "dn_block_k"):
            v = getattr(self, name)
            assert v >= 16 and v & (v - 1) == 0, f"{name}={v} must be a power of two >= 16 (tl.dot)"
        for name in ("gv_block_n", "gvd_block_n", "gv_warps", "gvd_warps"):
            v = getattr(self, name)
            assert v >= 1 and v & (v - 1) == 0, f"{name}={v} must be a power of two"
        for name in ("gu_block_k", "dn_block_k", "gv_block_k", "gvd_block_k"):
            v = getattr(self, name)
            # Group 32 reads BLOCK_K / 32 scales per row; larger groups read one per word.
            assert v >= 32 and v & (v - 1) == 0, f"{name}={v} must be a power of two >= 32 (a 32-wide scale group)"
        assert self.reduce in ("sum", "atomic"), f"reduce must be 'sum' or 'atomic', got {self.reduce!r}"
        assert self.gu_split_k >= 1, f"gu_split_k must be >= 1, got {self.gu_split_k}"
        assert self.gv_stages >= 1 and self.gvd_stages >= 1, f"stages must be >= 1, got {self.gv_stages}, {self.gvd_stages}"
        assert 2 <= self.hp_stages <= 8, f"hp_stages must be 2..8, got {self.hp_stages}"
        assert self.hp_dn_tiles >= 1, f"hp_dn_tiles must be >= 1, got {self.hp_dn_tiles}"
        assert self.hp_gu_regs == 0 or 24 <= self.hp_gu_regs <= 255, f"hp_gu_regs must be 0 or 24..255, got {self.hp_gu_regs}"
        # The Triton down kernel's fp32 atomics gave wrong sums in 1 of 3 runs with 256-row tiles
        # (H200, K2 EP8 M=1; 64 and 128 rows were exact; cause not found): atomics stay on tiles
        # of <= 128 rows. Split-K gate/up shared that bound while it added with atomics; its
        # workspace sums (since a182555) are not measured at 256-row tiles, so the bound stays.
        assert not (self.reduce == "atomic" and self.dn_block_n > 128), "reduce='atomic' needs dn_block_n <= 128"
        assert not (self.gu_split_k > 1 and self.gu_block_n > 128), "gu_split_k > 1 needs gu_block_n <= 128"

    def spec(self) -> str:
        """The ``CONFIG_ENV`` string of this config."""
        return (
            f"bm={self.block_m},gu={self.gu_block_n}x{self.gu_block_k}x{self.gu_warps}x{self.gu_stages},"
            f"dn={self.dn_block_n}x{self.dn_block_k}x{self.dn_warps}x{self.dn_stages},"
            f"swap={int(self.swap_ab)},reduce={self.reduce},split={self.gu_split_k},asm={int(self.deq_asm)},"
            f"hopper={int(self.hopper)},hps={self.hp_stages},hpt={self.hp_dn_tiles},"
            f"gut={int(self.hp_gu_tma)},dnt={int(self.hp_dn_tma)},gur={self.hp_gu_regs},"
            f"gemv={int(self.gemv)},gv={self.gv_block_n}x{self.gv_block_k}x{self.gv_warps}x{self.gv_stages},"
            f"gvd={self.gvd_block_n}x{self.gvd_block_k}x{self.gvd_warps}x{self.gvd_stages}"
        )

    @classmethod
    def parse(cls, spec: str) -> "Int4MoEConfig":
        """Inverse of ``spec``; missing keys keep their defaults."""
        kw: dict = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, _, val = item.partition("=")
            if key in ("gu", "dn", "gv", "gvd"):
                parts = val.split("x")
                if len(parts) != 4:
                    raise ValueError(f"{key}={val!r}: must be BLOCK_NxBLOCK_KxWARPSxSTAGES, e.g. 64x128x4x3")
                bn, bk, w, st = (_spec_int(key, val, v) for v in parts)
                kw.update({f"{key}_block_n": bn, f"{key}_block_k": bk, f"{key}_warps": w, f"{key}_stages": st})
            elif key in _SPEC_INTS:
                kw[_SPEC_INTS[key]] = _spec_int(key, val, val)
            elif key in _SPEC_FLAGS:
                if val.lower() not in ("0", "1", "false", "true"):   # `hopper=off` was read as on
                    raise ValueError(f"{key}={val!r}: must be 0 or 1")
                kw[_SPEC_FLAGS[key]] = val.lower() in ("1", "true")
            elif key == "reduce":
                kw["reduce"] = val
            else:
                raise ValueError(f"{CONFIG_ENV}: unknown key {key!r} in {spec!r}")
        return cls(**kw)


def _spec_int(key: str, val: str, part: str) -> int:
    try:
        return int(part)
    except ValueError:
        raise ValueError(f"{key}={val!r}: {part!r} is not an integer") from None


def config_from_env() -> Int4MoEConfig | None:
    """The config ``CONFIG_ENV`` pins, or None. One that does not parse is refused naming the
    variable; the verifier checks it at start-up, where its first fused-MoE launch (after the
    weights load) raised a bare ValueError or AssertionError."""
    spec = os.environ.get(CONFIG_ENV)
    if not spec:
        return None
    try:
        return Int4MoEConfig.parse(spec)
    except (ValueError, AssertionError) as exc:
        raise ValueError(f"{CONFIG_ENV}={spec!r}: {str(exc).removeprefix(CONFIG_ENV + ': ')} "
                         f"(the syntax: {Int4MoEConfig().spec()})") from None


# ``Int4MoEConfig.spec`` keys of single fields: integers, and flags written 0 / 1.
_SPEC_INTS = {"bm": "block_m", "split": "gu_split_k", "hps": "hp_stages", "hpt": "hp_dn_tiles", "gur": "hp_gu_regs"}
_SPEC_FLAGS = {"swap": "swap_ab", "asm": "deq_asm", "hopper": "hopper", "gut": "hp_gu_tma", "dnt": "hp_dn_tma", "gemv": "gemv"}


# The GEMV path re-reads an expert for each of its assignments, so it pays while experts are
# rarely shared: up to 0.75 assignments per expert (H200 sweep, bench/results/int4_moe_gemv.json:
# faster than the tensor cores at K2 TP8 up to M = 36, 0.75 per expert, 1.08x with that point's best
# config and about break-even with the served one; at EP8 up to M = 4,
# 0.67 per expert, 1.06x; both lose at 1.5 per expert).
_GEMV_MAX_PER_EXPERT = 0.75


def _gemv_launch(assignments: int, whole_experts: bool) -> dict[str, int]:
    """The sweep's configs (block_n, block_k, warps, stages per kernel), robust across its points."""
    if whole_experts:  # K2 EP8 M = 1: gate/up 69 us, down 68 us
        return dict(gv_block_n=8, gv_block_k=256, gv_warps=2, gv_stages=3,
                    gvd_block_n=8, gvd_block_k=256, gvd_warps=2, gvd_stages=2)
    if assignments <= 8:  # K2 TP8 M = 1 (int4_moe_gemv_m1.json): gate/up 11.9 us, down 10.1 us; 21.4 end to end
        return dict(gv_block_n=1, gv_block_k=1024, gv_warps=1, gv_stages=1,
                    gvd_block_n=8, gvd_block_k=256, gvd_warps=1, gvd_stages=3)
    return dict(gv_block_n=4, gv_block_k=512, gv_warps=2, gv_stages=1,  # M = 2..36: within 11% of each point's best
                gvd_block_n=16, gvd_block_k=256, gvd_warps=2, gvd_stages=1)


def choose_config(
    tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int, routing_groups: int | None = None
) -> Int4MoEConfig:
    """Launch parameters from the model dims and the rows per expert ``tokens * top_k / num_experts``.

    A host-side number, so no device sync; a handful of buckets, not one config per M.
    ``CONFIG_ENV`` pins one config for every call. The table is the H200 sweep of
    ``bench/int4_moe_bench.py`` (all timings in ``bench/results/int4_moe.json``; BENCHMARKS.md).
    A handful of assignments take the GEMV path; its config keeps the tensor-core fields of that
    M, so ``dataclasses.replace(cfg, gemv=False)`` is what the tensor-core path would run.

    ``routing_groups``: how many independent groups the tokens come in (the requests of a step;
    None: every token its own). The GEMV path streams an expert once per assignment, so it pays
    only while a step's assignments hit distinct experts; the nodes of one draft tree (and the
    tokens of one prefill chunk) share a context and tend to share experts, so only steps of one
    token a group (decode) take it. The trade-off, measured: on the K2 TP8 slice's synthetic
    router, a budget-16 verify at batch 1 (136 assignments over ~16 experts a layer) took
    25.6 ms a step on the GEMV path and 18.1 on the tensor cores (bench/results/
    k2-slice-moe-path.json); under uniform routing the GEMV is 1.27-1.35x faster at those M
    (bench/results/int4_moe_gemv.json). A real router lies between. Choosing on the GPU from
    the step's distinct-expert count was measured and not kept (bench/results/int4_moe_auto.json):
    launching both paths, with the unchosen one's programs returning at once, cost 14-43 us a
    layer at K2 TP8 M = 9-36, more than the choice saves unless routing is as skewed as the
    slice's. On Hopper a tree's tokens also split the gate/up GEMM over more K slices
    (``_hopper_config``'s ``shared``).

    On Hopper (``_hopper_here``) the tensor-core launches run the Gluon kernels, whose table
    differs: the GEMV keeps up to five tokens of a TP-style shape (K2 TP8, GEMV vs tensor cores:
    M = 4 63 vs 71 us; M = 9 134 vs 122) and none of a whole-expert one (EP8 M = 1: 139 vs 105),
    and large M puts the weights on the MMA's M side too.
    """
    pinned = config_from_env()
    if pinned is not None:
        return pinned
    whole_experts = intermediate >= 1024  # EP-style ranks hold whole experts (K2 EP8: I = 2048)
    r = tokens * top_k / max(num_experts, 1)
    hopper = _hopper_here()
    independent = routing_groups is None or tokens <= routing_groups
    cfg = _hopper_config(r, whole_experts, shared=not independent) if hopper else _tensor_core_config(r, whole_experts)
    gemv_pays = r <= _GEMV_MAX_PER_EXPERT and (not hopper or (not whole_experts and tokens * top_k <= _HOPPER_GEMV_MAX_ASSIGNMENTS))
    if gemv_pays and independent:
        return dataclasses.replace(cfg, gemv=True, **_gemv_launch(tokens * top_k, whole_experts))
    return cfg


# On Hopper the GEMV path serves a TP-style MoE up to this many assignments (K2 TP8, H200,
# bench/results/int4_moe_hopper_gemv_crossover.json: GEMV / Gluon tensor cores 21 / 32 us at M = 1,
# 63 / 71 at M = 4, 91 / 92 at M = 6, 134 / 122 at M = 9); whole-expert shapes take the tensor
# cores from M = 1 (EP8, GEMV vs tensor cores: 139 vs 105 us).
_HOPPER_GEMV_MAX_ASSIGNMENTS = 40


def _hopper_here() -> bool:
    """Whether the Gluon kernels run on the current CUDA device (False without CUDA). The table
    assumes they serve the launches; fp16 models or other group sizes run its configs on Triton."""
    return torch.cuda.is_available() and hop.available(torch.device("cuda", torch.cuda.current_device()))


def _hopper_config(r: float, whole_experts: bool, shared: bool = False) -> Int4MoEConfig:
    """``_tensor_core_config`` for the Gluon kernels (K2 shapes, the H200 sweep in bench/results/
    int4_moe.json): 64-row down tiles on 4 warps below 32 rows per expert (TP8 M=72 down 168 us
    vs 178 at 128 rows), less split-K (whole experts: 2 slices below half a row an expert), and weights on
    the M side at large M too (EP8 M=288 gate/up 502 us vs 635 on the Triton kernel's regular
    tiles, down 306 vs 352; M=1152: 1445 vs 2073 and 1007 vs 1152). The Gluon kernel fixes K
    steps at 128 and warps at rows / 16. Gate/up weights come by TMA at every M (the dataclass
    default): TP8 M=72 / 288 / 1152 204 / 247 / 332 us vs 281 / 336 / 390 on cp.async, EP8 M=72 /
    288 290 / 443 vs 339 / 475; EP8 M=1152 1538 vs 1481 (bench/results/int4_moe_w_tma.json).

    ``shared``: the tokens come in groups that tend to share experts (a tree's nodes, a prefill
    chunk), so a step touches fewer experts than ``r`` suggests and more K slices pay."""
    # A TP-style down GEMM (K = the rank's slice of the intermediate, 256 at K2 TP8: two K steps)
    # streams 8 weight tiles a CTA with its activations resident: TP8 down M=72 116 us vs 155,
    # M=288 158 vs 207, M=1152 266 vs 353 (bench/results/int4_moe_tiles_ab.json). Whole experts
    # (K = 2048) already keep the ring full and lose with more tiles (EP8 M=72 219 us vs 184).
    tiles = 1 if whole_experts else 8
    if r <= 8:
        # Gate/up K slices at K2 TP8 (bench/results/int4_moe_verify_probe-a182555-r*.json; whole call,
        # uniform routing / tokens on 12-21 experts, as a tree's on the K2 slice): M=9 8 slices 96 /
        # 41 us, 4 88 / 46; M=17 152 / 50 against 138 / 52; M=33 (r = 0.69) 2 slices 204 / 70, 4
        # 210 / 57. On the K2 slice (moe_split_ab-3e5b5c7.json, this rule against 8 / 2 slices) a
        # budget-32 verify at batch 1 went from 10.19 to 9.43 ms and AR batch 32 from 9.77 to 9.20;
        # AR batch 16 from 7.86 to 8.13, as its synthetic router sends 16 tokens to a few experts.
        # Whole experts (K2 EP8: K = 7168, N = 2048 a matrix) take 2 slices below half a row an expert:
        # EP8 M=1 gate/up 47.9 / 46.3 us against 53.0 / 51.6 unsplit, 4 slices 50.3 / 48.7; at M=9
        # (1.5 rows) 2 slices tie (197.5 vs 195.8) (int4_moe_960fafe.json, int4_moe_88ab166.json sweeps).
        if whole_experts:
            split = 2 if r < 0.5 else 1
        else:
            split = (8 if shared else 4) if r < 0.5 else 4 if r <= 1 else 2 if r <= 2 else 1
        # 8 slices make thousands of short CTAs: capped at 112 registers more of them share an SM
        # (int4_moe_verify_probe-853c60d.json, 8 slices: M=17 152.4 -> 143.3 us uniform, 49.8 -> 47.9
        # a tree's; M=9 95.6 -> 92.5 / 40.3 -> 40.5). 4 slices gained nothing from it (137.4 -> 137.7 / 51.4 -> 51.7).
        return Int4MoEConfig(block_m=16, gu_block_n=64, gu_block_k=128, gu_split_k=split,
                             dn_block_n=64, dn_block_k=128, dn_warps=4, dn_stages=3, swap_ab=True, hp_dn_tiles=tiles,
                             hp_gu_regs=112 if split == 8 else 0)
    if r <= 32:
        dn_n = 128 if whole_experts else 64  # TP8 M=1152 down: 373 us at 64 rows vs 385 at 128; EP8 M=72: 189 either way
        # block_m 32 gate/up at 128 registers (133 uncapped with TMA words): 4 CTAs an SM instead of 3,
        # TP8 M=1152 gate/up 321.5 us vs 337.5, EP8 M=72 290.6 vs 293.1 (bench/results/int4_moe_tma_regs.json);
        # whole call 549.3 vs 560.8 and 476.8 vs 483.0 in another run (int4_moe_gur_ab.json)
        return Int4MoEConfig(block_m=32, gu_block_n=64, gu_block_k=128, dn_block_n=dn_n, dn_block_k=128,
                             dn_warps=dn_n // 16, swap_ab=True, hp_dn_tiles=tiles, hp_gu_regs=128)
    # Down weights by TMA only pay on whole experts' 128-row tiles at large M (EP8 M=288 258 us vs
    # 269, M=1152 821 vs 868; TP8 and EP8 M=72 within -1..+6%: bench/results/int4_moe_w_tma.json).
    return Int4MoEConfig(block_m=64, gu_block_n=64, gu_block_k=128, dn_block_n=128, dn_block_k=128, dn_warps=8, swap_ab=True,
                         hp_dn_tma=whole_experts)


def _tensor_core_config(r: float, whole_experts: bool) -> Int4MoEConfig:
    """The tensor-core path's config for ``r`` rows per expert (see ``choose_config``)."""
    if r <= 8:
        # Small-M path (decode / tree verify): one 16-row block per active expert, so each expert's
        # weights stream once. Split-K on gate/up multiplies the programs when few experts are
        # active (K2 TP8, H200): M=1 gate/up 8 slices 21.7 us vs 83 us unsplit; M=9 109 vs 132 us;
        # M=72 4 slices 424 vs 442 us; by M=288 (6 rows/expert) splitting no longer pays.
        split = 8 if r < 0.1 and not whole_experts else 4 if r <= 2 else 1
        if whole_experts:
            dn = (256, 64, 8, 3) if r < 0.5 else (64, 128, 4, 3)  # EP8 M=1: 61.7 us; M=9: 229 us vs 262
        else:
            dn = (256, 64, 8, 3) if r < 0.1 else (128, 64, 4, 4)  # TP8 M=1: 12.5 vs 14.1 us; M=72: 235 vs 244
        return Int4MoEConfig(
            block_m=16, gu_block_n=64, gu_block_k=128, gu_warps=4, gu_stages=3, gu_split_k=split,
            dn_block_n=dn[0], dn_block_k=dn[1], dn_warps=dn[2], dn_stages=dn[3], swap_ab=True,
        )
    if r <= 32:
        # K2 TP8 M=1152 (24 rows/expert): 0.92 ms; EP8 M=72 (12 rows): 0.73 ms. Gate/up 64 x 128 tiles
        # since the K slices are 16-byte aligned (the sweep at a48951c: 501 vs 546 us for 64 x 64 at
        # TP8 M=1152, 464 vs 544 for 128 x 64 on 8 warps at EP8 M=72); block_m 64: 1.5x slower.
        if whole_experts:
            return Int4MoEConfig(block_m=32, gu_block_n=64, gu_block_k=128, gu_warps=4, dn_block_n=128, dn_block_k=128, dn_warps=8, swap_ab=True)
        return Int4MoEConfig(block_m=32, gu_block_n=64, gu_block_k=128, dn_block_n=128, dn_block_k=64, dn_stages=4, swap_ab=True)
    # Large-M path (prefill): regular tiles, tokens on the MMA's M side. K2 EP8 M=288: 1.17 ms,
    # M=1152: 3.7 ms (219 TFLOP/s: dequantising every 64-row block's weights costs more than the MMA).
    return Int4MoEConfig(block_m=64, gu_block_n=64, gu_block_k=64, dn_block_n=128, dn_block_k=64, dn_warps=8, swap_ab=False)


# --------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------


@dataclass
class MoEAlignment:
    """Token-expert alignment: assignments sorted by expert, padded per expert to ``block_m``."""

    sorted_ids: Tensor  # [P] int32 flat assignment (token * top_k + slot) per padded row; A = padding
    block_expert: Tensor  # [P / block_m] int32 expert of each block of rows; -1 = unused block
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


ALIGN_PROGRAMS = 8  # programs sharing the alignment's stores (the counts' cumsum is done by each)


def _max_padded_rows(num_assign: int, num_experts: int, block_m: int) -> int:
    """Upper bound on padded rows: every used expert adds at most ``block_m - 1`` padding rows."""
    p = num_assign + min(num_experts, num_assign) * (block_m - 1)
    return triton.cdiv(p, block_m) * block_m


@on_input_device
def int4_moe_align(topk_ids: Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the ``[M, top_k]`` expert ids by expert and pad each expert's rows to ``block_m``.

    No host sync. Counting and scattering run a program per chunk of assignments (atomics on
    the experts' counters); in between ``ALIGN_PROGRAMS`` programs lay out the experts' rows and
    write the sentinels. K2 TP8 M = 1152 (9216 assignments, 384 experts): one program doing it
    all took 41 us, one program counting (``tl.histogram``) and laying out 22 us, one program
    laying out 8.9 us. Ids must lie in ``0 .. num_experts - 1``. The counts live in the last
    entries of ``tile_counters`` (zeros between launches: the scatter resets them), so no fill
    launch a call breaks the PDL chain (K2: 60 a step).
    """
    assert topk_ids.dim() == 2, f"topk_ids must be [M, top_k], got {tuple(topk_ids.shape)}"
    assert topk_ids.dtype in (torch.int32, torch.int64), f"topk_ids must be int32/int64, got {topk_ids.dtype}"
    ids = topk_ids.contiguous().view(-1)  # [A]
    A = ids.numel()
    P = _max_padded_rows(A, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(P, dtype=torch.int32, device=dev)  # [P]
    block_expert = torch.empty(P // block_m, dtype=torch.int32, device=dev)  # [P / BM]
    e_pad = triton.next_power_of_2(num_experts)
    assert e_pad <= TILE_COUNTERS, f"{num_experts} experts: at most {TILE_COUNTERS}"
    counts = tile_counters(dev)[TILE_COUNTERS - e_pad:]  # [E_PAD] zeros; the scatter leaves them zero again
    cursor = torch.empty(e_pad, dtype=torch.int32, device=dev)  # [E_PAD]: the align kernel writes every entry
    use_pdl = pdl.enabled(dev)
    if A:  # without assignments nothing is counted, and the counts stay zero
        _int4_moe_count_kernel[(triton.cdiv(A, 256),)](ids, counts, A, CHUNK=256, PDL=use_pdl, num_warps=2, launch_pdl=use_pdl)
    _int4_moe_align_kernel[(ALIGN_PROGRAMS,)](
        counts, cursor, sorted_ids, block_expert, A, num_experts, P, P // block_m,
        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=1024, PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )
    if A:
        _int4_moe_scatter_kernel[(triton.cdiv(A, 256),)](ids, sorted_ids, cursor, counts, A, CHUNK=256, E_PAD=e_pad,
                                                         PDL=use_pdl, num_warps=2, launch_pdl=use_pdl)
    return MoEAlignment(sorted_ids=sorted_ids, block_expert=block_expert, block_m=block_m)


def _check_stack(name: str, w: Int4Weight, out_f: int, in_f: int, group_size: int) -> None:
    E = w.packed.shape[0]
    assert w.packed.dtype == torch.int32, f"{name}.packed must be int32, got {w.packed.dtype}"
    assert tuple(w.packed.shape) == (E, out_f, in_f // 8), f"{name}.packed is {tuple(w.packed.shape)}, want {(E, out_f, in_f // 8)}"
    assert tuple(w.scale.shape) == (E, out_f, in_f // group_size), f"{name}.scale is {tuple(w.scale.shape)}, want {(E, out_f, in_f // group_size)}"
    assert w.packed.stride(-1) == 1 and w.scale.stride(-1) == 1, f"{name}: last dim must be contiguous"


def _check_moe_args(
    hidden: Tensor, w_gate: Int4Weight, w_up: Int4Weight, w_down: Int4Weight, topk_ids: Tensor, topk_weights: Tensor,
    group_size: int,
) -> tuple[int, int, int, int, int]:
    """Shape checks shared by both paths; returns ``(M, E, K, I, top_k)``."""
    assert hidden.dim() == 2 and hidden.stride(-1) == 1, f"hidden must be [M, K] row-contiguous, got {tuple(hidden.shape)}"
    M, K = hidden.shape
    E, I = w_gate.packed.shape[0], w_gate.packed.shape[1]
    assert group_size % 8 == 0 and K % group_size == 0 and I % group_size == 0, (
        f"hidden {K} and intermediate {I} must be multiples of group_size {group_size} (itself a multiple of 8)"
    )
    _check_stack("w_gate", w_gate, I, K, group_size)
    _check_stack("w_up", w_up, I, K, group_size)
    _check_stack("w_down", w_down, K, I, group_size)
    assert w_gate.packed.stride() == w_up.packed.stride() and w_gate.scale.stride() == w_up.scale.stride(), "gate and up stacks must share strides"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == M, (
        f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [M={M}, top_k]"
    )
    assert topk_ids.dtype in (torch.int32, torch.int64), f"topk_ids must be int32/int64, got {topk_ids.dtype}"
    return M, E, K, I, topk_ids.shape[1]


@on_input_device
def fused_int4_moe(
    hidden: Tensor,
    w_gate: Int4Weight,
    w_up: Int4Weight,
    w_down: Int4Weight,
    topk_ids: Tensor,
    topk_weights: Tensor,
    group_size: int = 32,
    config: Int4MoEConfig | None = None,
    routing_groups: int | None = None,
) -> Tensor:
    """Routed-expert output ``sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t)``, ``e = ids[t, j]``.

    Args:
        hidden: [M, K] bf16/fp16 (fp32 works too: the weights are cast to it).
        w_gate, w_up: stacked experts, packed [E, I, K/8] int32, scale [E, I, K/group].
        w_down: packed [E, K, I/8] int32, scale [E, K, I/group].
        topk_ids: [M, top_k] int32/int64 expert ids (distinct per row is not required).
        topk_weights: [M, top_k] routing weights (already normalised and scaled).
        group_size: scale group along the input dim (multiple of 8; 32 in K2).
        config: launch parameters; default ``choose_config`` (``CONFIG_ENV`` pins one).
        routing_groups: independent token groups (requests) for ``choose_config``; None: M.

    Returns:
        [M, K] in hidden's dtype.
    """
    M, E, K, I, top_k = _check_moe_args(hidden, w_gate, w_up, w_down, topk_ids, topk_weights, group_size)
    cfg = config or choose_config(M, E, K, I, top_k, routing_groups)
    if M == 0:
        return hidden.new_zeros(M, K)
    if cfg.gemv:
        h = int4_moe_gemv_gate_up(hidden, w_gate, w_up, topk_ids, cfg, group_size)  # [A, I]
        return int4_moe_gemv_down(h, w_down, topk_ids, topk_weights, cfg, group_size, hidden.dtype)  # [M, K]
    align = int4_moe_align(topk_ids, E, cfg.block_m)
    k_order = _use_hopper(cfg, hidden, w_down, group_size, cfg.dn_block_n)  # the Gluon down reads h as gate/up leaves it
    h = int4_moe_gate_up(hidden, w_gate, w_up, align, top_k, cfg, group_size, k_order=k_order)  # [P, I]
    return int4_moe_down(h, w_down, align, topk_weights, cfg, group_size, hidden.dtype, h_k_order=k_order)  # [M, K]


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _use_hopper(cfg: Int4MoEConfig, act: Tensor, w: Int4Weight, group_size: int, block_n: int) -> bool:
    """The Gluon kernels serve a tensor-core launch on sm_90 where ``hop.supported`` allows."""
    return cfg.hopper and cfg.swap_ab and hop.supported(act, w.packed, w.scale, group_size, block_n)


def _use_asm(cfg: Int4MoEConfig, act_dtype: torch.dtype, w: Int4Weight) -> bool:
    """The bf16x2 PTX dequantisation applies on CUDA to bf16 activations with bf16 scales."""
    return cfg.deq_asm and w.packed.is_cuda and act_dtype == torch.bfloat16 and w.scale.dtype == torch.bfloat16


@on_input_device
def int4_moe_gate_up(
    hidden: Tensor, w_gate: Int4Weight, w_up: Int4Weight, align: MoEAlignment, top_k: int, cfg: Int4MoEConfig,
    group_size: int = 32, k_order: bool = False,
) -> Tensor:
    """``[P, I]`` ``h = silu(gate x) * (up x)`` per padded row of ``align`` (padding rows unwritten).

    With ``cfg.gu_split_k > 1`` the K slices write float32 partial sums (gate | up) to a
    ``[split, P, 2I]`` workspace and the last slice of each tile forms ``h`` from them: many more
    programs when few experts are active (M = 1: 8 experts x 8 N tiles x 8 slices), still one
    launch. It replaced atomic adds into a zeroed buffer and a SiLU launch (three launches, and
    sums in whatever order the slices finished). ``k_order``: h's columns in the Gluon down GEMM's
    K order (``int4_moe_hopper.permute_k(h)``), written so by the Gluon kernel; I must be a
    multiple of 128.
    """
    assert align.block_m == cfg.block_m, f"alignment block_m {align.block_m} != config block_m {cfg.block_m}"
    M, K = hidden.shape
    I = w_gate.packed.shape[1]
    nb = align.num_blocks
    P = nb * cfg.block_m
    hopper = _use_hopper(cfg, hidden, w_gate, group_size, cfg.gu_block_n)
    step = hop.BLOCK_K if hopper else cfg.gu_block_k  # K slices are whole steps of the kernel's loop
    k_split = triton.cdiv(triton.cdiv(K, cfg.gu_split_k), step) * step
    split = triton.cdiv(K, k_split)  # the slices there are: the last one's counter must reach them all
    h = torch.empty(P, I, dtype=hidden.dtype, device=hidden.device)  # [P, I]
    assert not k_order or I % hop.BLOCK_K == 0, f"k_order needs the intermediate size {I} to be a multiple of {hop.BLOCK_K}"
    ws, counters = h, h  # unused unless split
    if split > 1:
        ws = torch.empty(split, P, 2 * I, dtype=torch.float32, device=hidden.device)  # [split, P, 2I] gate | up sums
        counters = tile_counters(hidden.device)
        tiles = nb * triton.cdiv(I, cfg.gu_block_n)
        assert tiles <= TILE_COUNTERS, f"{tiles} gate/up tiles split over K; {TILE_COUNTERS} counters"
    if hopper:
        hop.gemm(hop.permute_k(hidden), w_gate, w_up, h, align.sorted_ids, align.block_expert, align.sorted_ids,
                 I, K, M * top_k, top_k, k_split, gated=True, atomic=False, block_m=cfg.block_m,
                 block_n=cfg.gu_block_n, split_k=split, stages=cfg.hp_stages, k_order_out=k_order, max_regs=cfg.hp_gu_regs or None,
                 w_tma=cfg.hp_gu_tma and hop.tma_words_ok(w_gate.packed) and hop.tma_words_ok(w_up.packed),
                 ws=ws, counters=counters)
        return h
    _gate_up_triton(hidden, w_gate, w_up, h, ws, counters, align, top_k, cfg, group_size, k_split)
    return hop.permute_k(h) if k_order else h


def _gate_up_triton(
    hidden: Tensor, w_gate: Int4Weight, w_up: Int4Weight, out: Tensor, ws: Tensor, counters: Tensor, align: MoEAlignment,
    top_k: int, cfg: Int4MoEConfig, group_size: int, k_split: int,
) -> None:
    M, K = hidden.shape
    I = w_gate.packed.shape[1]
    nb = align.num_blocks
    split = triton.cdiv(K, k_split)
    grid = (nb * triton.cdiv(I, cfg.gu_block_n) * split,)
    _int4_moe_gemm_kernel[grid](
        hidden, w_gate.packed, w_gate.scale, w_up.packed, w_up.scale, out, ws, counters,
        align.sorted_ids, align.block_expert, align.sorted_ids,
        I, K, M * top_k, top_k, nb, k_split,
        hidden.stride(0), w_gate.packed.stride(0), w_gate.packed.stride(1), w_gate.scale.stride(0), w_gate.scale.stride(1), out.stride(0),
        ws.stride(0) if split > 1 else 0,
        GATED=True, ATOMIC=False, SWAP_AB=cfg.swap_ab, GROUP=group_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.gu_block_n, BLOCK_K=cfg.gu_block_k, SPLIT_K=split,
        EVEN_K=K % cfg.gu_block_k == 0, DEQ_ASM=_use_asm(cfg, hidden.dtype, w_gate), DOT_F32=hidden.is_cpu,
        DTYPE=_TL_DTYPE[hidden.dtype], num_warps=cfg.gu_warps, num_stages=cfg.gu_stages,
    )


@on_input_device
def int4_moe_down(
    h: Tensor, w_down: Int4Weight, align: MoEAlignment, topk_weights: Tensor, cfg: Int4MoEConfig,
    group_size: int = 32, out_dtype: torch.dtype | None = None, h_k_order: bool = False,
) -> Tensor:
    """``[M, K]``: ``h`` (``int4_moe_gate_up``'s ``[P, I]``) through each row's expert's down
    projection, weighted and summed over top-k; in ``out_dtype`` (default h's dtype).
    ``h_k_order``: h came from ``int4_moe_gate_up(k_order=True)``; only the Gluon kernel reads that."""
    assert align.block_m == cfg.block_m, f"alignment block_m {align.block_m} != config block_m {cfg.block_m}"
    M, top_k = topk_weights.shape
    K, I = w_down.packed.shape[1], w_down.packed.shape[2] * 8
    assert h.shape[1] == I, f"h has {h.shape[1]} columns, want {I}"
    act_dtype = out_dtype or h.dtype
    A = M * top_k
    nb = align.num_blocks
    weights = topk_weights.contiguous().view(-1)  # [A]
    atomic = cfg.reduce == "atomic"
    if atomic:
        out = torch.zeros(M, K, dtype=torch.float32, device=h.device)  # [M, K]
    else:
        out = torch.empty(A, K, dtype=act_dtype, device=h.device)  # [A, K] one row per assignment
    use_hopper = _use_hopper(cfg, h, w_down, group_size, cfg.dn_block_n)
    if h_k_order and not use_hopper:
        raise ValueError("h in the Gluon kernel's K order (h_k_order) needs the Gluon down GEMM (sm_90, bf16, swap_ab)")
    if use_hopper:
        hop.gemm(h if h_k_order else hop.permute_k(h), w_down, w_down, out, align.sorted_ids, align.block_expert, weights,
                 K, I, A, top_k, I, gated=False, atomic=atomic, block_m=cfg.block_m, block_n=cfg.dn_block_n,
                 split_k=1, stages=cfg.hp_stages, n_tiles=cfg.hp_dn_tiles,
                 w_tma=cfg.hp_dn_tma and hop.tma_words_ok(w_down.packed))
        return _finish_down(out, atomic, act_dtype, M, top_k, K)
    grid = (nb * triton.cdiv(K, cfg.dn_block_n),)
    _int4_moe_gemm_kernel[grid](
        h, w_down.packed, w_down.scale, w_down.packed, w_down.scale, out, out, out,
        align.sorted_ids, align.block_expert, weights,
        K, I, A, top_k, nb, I,
        h.stride(0), w_down.packed.stride(0), w_down.packed.stride(1), w_down.scale.stride(0), w_down.scale.stride(1), out.stride(0), 0,
        GATED=False, ATOMIC=atomic, SWAP_AB=cfg.swap_ab, GROUP=group_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.dn_block_n, BLOCK_K=cfg.dn_block_k, SPLIT_K=1,
        EVEN_K=I % cfg.dn_block_k == 0, DEQ_ASM=_use_asm(cfg, act_dtype, w_down),
        DOT_F32=h.is_cpu, DTYPE=_TL_DTYPE[act_dtype], num_warps=cfg.dn_warps, num_stages=cfg.dn_stages,
    )
    return _finish_down(out, atomic, act_dtype, M, top_k, K)


def _finish_down(out: Tensor, atomic: bool, act_dtype: torch.dtype, M: int, top_k: int, K: int) -> Tensor:
    """``[M, K]`` from the down GEMM's fp32 token sums (atomic) or per-assignment rows (sum)."""
    if atomic:
        return out.to(act_dtype)
    if top_k == 1:
        return out
    summed = torch.empty(M, K, dtype=out.dtype, device=out.device)  # [M, K]
    block = 1024
    use_pdl = pdl.enabled(out.device)
    _int4_moe_topk_sum_kernel[(M, triton.cdiv(K, block))](out, summed, K, TOP_K=top_k, BLOCK=block, PDL=use_pdl, num_warps=4,
                                                         launch_pdl=use_pdl)
    return summed


@on_input_device
def int4_moe_gemv(
    hidden: Tensor,
    w_gate: Int4Weight,
    w_up: Int4Weight,
    w_down: Int4Weight,
    topk_ids: Tensor,
    topk_weights: Tensor,
    group_size: int = 32,
    config: Int4MoEConfig | None = None,
) -> Tensor:
    """``fused_int4_moe`` on the GEMV path whatever ``config.gemv`` says (its ``gv_*`` / ``gvd_*``
    fields apply; default ``Int4MoEConfig()``'s). Same arguments and result."""
    cfg = dataclasses.replace(config or Int4MoEConfig(), gemv=True)
    return fused_int4_moe(hidden, w_gate, w_up, w_down, topk_ids, topk_weights, group_size, cfg)


@on_input_device
def int4_moe_gemv_gate_up(
    hidden: Tensor, w_gate: Int4Weight, w_up: Int4Weight, topk_ids: Tensor, cfg: Int4MoEConfig, group_size: int = 32
) -> Tensor:
    """``[A, I]`` ``h = silu(gate_e x_t) * (up_e x_t)`` per flat assignment ``a = t * top_k + j``.

    One program per (assignment, ``cfg.gv_block_n`` rows): every assignment streams its expert's
    rows itself (no alignment, no padding rows, no atomics); experts shared by several tokens are
    re-read from L2. Every element of the result is written.
    """
    M, K = hidden.shape
    I = w_gate.packed.shape[1]
    top_k = topk_ids.shape[1]
    A = M * top_k
    ids = topk_ids.contiguous().view(-1)  # [A]
    h = torch.empty(A, I, dtype=hidden.dtype, device=hidden.device)  # [A, I]
    if A == 0:
        return h
    grid = (A, triton.cdiv(I, cfg.gv_block_n))
    use_pdl = pdl.enabled(hidden.device)
    _int4_moe_gemv_gate_up_kernel[grid](
        hidden, ids, w_gate.packed, w_gate.scale, w_up.packed, w_up.scale, h,
        I, K, top_k,
        hidden.stride(0), w_gate.packed.stride(0), w_gate.packed.stride(1), w_gate.scale.stride(0), w_gate.scale.stride(1), h.stride(0),
        GROUP=group_size, BLOCK_N=cfg.gv_block_n, BLOCK_K=cfg.gv_block_k, STAGES=cfg.gv_stages,
        EVEN_K=K % cfg.gv_block_k == 0, DEQ_ASM=_use_asm(cfg, hidden.dtype, w_gate), DTYPE=_TL_DTYPE[hidden.dtype],
        PDL=use_pdl, num_warps=cfg.gv_warps, launch_pdl=use_pdl,
    )
    return h


@on_input_device
def int4_moe_gemv_down(
    h: Tensor, w_down: Int4Weight, topk_ids: Tensor, topk_weights: Tensor, cfg: Int4MoEConfig,
    group_size: int = 32, out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``[M, K]``: ``sum_j w[t, j] * down_e(h[t * top_k + j])`` with ``h`` from ``int4_moe_gemv_gate_up``,
    in ``out_dtype`` (default h's dtype).

    One program per (token, ``cfg.gvd_block_n`` rows of K) sums the token's top-k slots in a fixed
    order: deterministic, and no per-assignment rows or separate sum. A duplicate expert id in a
    row is summed twice, as in the reference.
    """
    M, top_k = topk_ids.shape
    K, I = w_down.packed.shape[1], w_down.packed.shape[2] * 8
    assert h.shape == (M * top_k, I) and h.stride(-1) == 1, f"h is {tuple(h.shape)}, want {(M * top_k, I)} row-contiguous"
    act_dtype = out_dtype or h.dtype
    out = torch.empty(M, K, dtype=act_dtype, device=h.device)  # [M, K]
    if M == 0:
        return out
    ids = topk_ids.contiguous().view(-1)  # [A]
    weights = topk_weights.contiguous().view(-1)  # [A]
    grid = (M, triton.cdiv(K, cfg.gvd_block_n))
    use_pdl = pdl.enabled(h.device)
    _int4_moe_gemv_down_kernel[grid](
        h, ids, weights, w_down.packed, w_down.scale, out,
        K, I, top_k,
        h.stride(0), w_down.packed.stride(0), w_down.packed.stride(1), w_down.scale.stride(0), w_down.scale.stride(1), out.stride(0),
        GROUP=group_size, BLOCK_N=cfg.gvd_block_n, BLOCK_K=cfg.gvd_block_k, STAGES=cfg.gvd_stages,
        EVEN_K=I % cfg.gvd_block_k == 0, DEQ_ASM=_use_asm(cfg, act_dtype, w_down), DTYPE=_TL_DTYPE[act_dtype],
        PDL=use_pdl, num_warps=cfg.gvd_warps, launch_pdl=use_pdl,
    )
    return out


def int4_moe_reference(
    hidden: Tensor,
    w_gate: Int4Weight,
    w_up: Int4Weight,
    w_down: Int4Weight,
    topk_ids: Tensor,
    topk_weights: Tensor,
    group_size: int = 32,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """Plain torch, one touched expert at a time: dequantise it, then matmul (the kernel's ground truth).

    ``compute_dtype`` (default hidden's dtype) is the dtype of the matmuls; the dequantised weights
    are rounded to hidden's dtype first either way, as the kernel's are. Syncs with the host.
    """
    M, K = hidden.shape
    top_k = topk_ids.shape[1]
    cd = compute_dtype or hidden.dtype
    x = hidden.to(cd)
    flat_ids = topk_ids.reshape(-1).long()  # [A]
    flat_w = topk_weights.reshape(-1).to(cd)  # [A]
    out = torch.zeros(M, K, dtype=cd, device=hidden.device)  # [M, K]
    for e in torch.unique(flat_ids).tolist():  # host sync
        sel = (flat_ids == e).nonzero().squeeze(-1)  # [c] flat assignments of expert e
        tok = sel // top_k  # [c]
        wg, wu, wd = (
            unpack_int4(w.packed[e], w.scale[e], None, group_size, dtype=hidden.dtype).to(cd)  # [out, in]
            for w in (w_gate, w_up, w_down)
        )
        xe = x[tok]  # [c, K]
        h = torch.nn.functional.silu(xe @ wg.T) * (xe @ wu.T)  # [c, I]
        out.index_add_(0, tok, (h @ wd.T) * flat_w[sel].unsqueeze(-1))  # [c, K]
    return out.to(hidden.dtype)


