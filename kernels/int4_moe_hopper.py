"""Fused INT4 MoE GEMMs for Hopper (sm_90) in Gluon: weights dequantised straight into wgmma registers.

Why: the Triton kernel (``kernels/int4_moe.py``) dequantises a ``[BLOCK_N, BLOCK_K]`` weight tile
in whatever register layout its loads had, and Triton converts that to the MMA operand layout
through shared memory: per K step 16 KB of bf16 stored and re-read a matrix, four times the bytes
of the INT4 words it came from. At the K2 shapes that round trip uses about as much of an SM's
shared-memory bandwidth as the HBM stream feeds it, and the kernel sits at 29-42% of copy
bandwidth. Gluon lets this kernel pick the layouts:

* Each thread loads (from a ring of shared buffers, 16-byte reads) exactly the int32
  words whose nibbles are its elements of the wgmma A operand (weights on the MMA's M side,
  tokens on N, as the Triton kernel's ``SWAP_AB``). That holds for one order of K inside each
  128-wide step: logical column ``32j + 8q + 2t + i0`` is physical column ``32t + 8j + 4i0 + q``
  (t: the thread's lane in its quad, j: which of its four consecutive words, nibble ``q + 4i0``).
  The operand's register pairs (i0 = 0, 1) are then nibbles (q, q + 4) of one word, which one
  mask-and-magic op turns into a bf16x2 register: no unpacking or re-pairing instructions.
  The layout conversion to the operand is then a register relabelling (``assert_trivial``).
* The activations are read in that same order: ``permute_k`` reorders the columns of ``hidden``
  once per call, a copy of ``M x K`` bf16, and the gate/up epilogue stores h's columns in that
  order already (``k_order_out``), so the down GEMM reads h as it is.
* Both K orders cover the same columns, so the products are the same sums in another order.
  A 32-wide scale group is one t: each thread needs one scale a row a step.
* The ring is filled by ``cp.async`` from every thread (activation rows gathered by token, and
  the scales: 8 bytes a row a step), and with ``w_tma`` the weight words by one TMA copy a matrix
  a step, on an mbarrier a slot. Timing ablations showed the copies alone taking as long as the
  whole loop at K2 TP8, with DRAM half busy (``bench/results/int4_moe_loop_ablations.json``):
  per-thread 16-byte copies of 64-byte row pieces were the limit, and TMA words made gate/up
  1.07-1.38x faster at K2 M = 72-1152 (``int4_moe_w_tma.json``).

Same contract as ``_int4_moe_gemm_kernel`` (alignment rows, split-K partial sums, per-assignment
or atomic down outputs), restricted to what the K2 path runs: bf16 activations and scales, group
32, K and N multiples of the tiles. ``int4_moe`` routes a launch here where ``supported`` says so.
The CPU has no Gluon: CPU tests cover ``permute_k`` and the routing, the GPU check is
``bench/int4_moe_bench.py`` (every served config against the reference).

Where it stands on an H200 (BENCHMARKS.md): 1.1-1.4x the Triton kernel at the same configs
(cp.async weights); with TMA weights the whole MoE call at 55-72% of copy bandwidth at K2 EP8 M =
1-72, 52-74% at TP8 M = 9-1152 and 40% at EP8 M = 288. Before TMA, Nsight Compute (``bench/results/int4_moe_ncu.json``):
DRAM 32-49% busy in every GEMM there; the gate/up warps spend 18-20% of their cycles at the two
CTA barriers a step and 9-22% on fixed-latency dependencies (the dequantisation's chains), at TP8
M = 72 22% waiting for copies; 38-67% of issue slots used; 2-5 CTAs an SM (95-199 registers a
thread). A warp-specialised prototype (a cp.async producer partition, an mbarrier ring, one consumer
warpgroup) was correct and 1.04-1.20x slower (``int4_moe_ws_probe.json``): fewer warps hid the
dequantisation chains worse than the CTA barriers cost. What is left needs more warps on the chains
per SM than the register file holds at these operand sizes, or fewer instructions in them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import pdl
from kernels.device import is_hopper
from kernels.int4_ptx import DEQUANT_PAIRS, DEQUANT_PAIRS_CONSTRAINTS
from services.common.int4 import Int4Weight

try:  # Gluon ships with Triton >= 3.5; absent or incompatible: the Triton kernel serves
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # pragma: no cover - depends on the installed Triton
    gluon = None

__all__ = [
    "BLOCK_K", "OPERAND_ORDER", "available", "gemm", "permute_k", "permute_k_reference", "planes_to_operand", "stream_plan",
    "supported", "tma_words_ok",
]

BLOCK_K = 128  # K per step: one 32-column block per lane of a quad, four words a thread a row
# Dims of the joined nibble pairs [rows, t, j, i0, q0, q1] -> [rows, j, q1, q0, t, i0]: the
# operand's column order. ``planes_to_operand`` replays it in torch for the CPU test.
OPERAND_ORDER = (0, 2, 5, 4, 1, 3)
RESIDENT_BYTES = 32768  # most activation bytes a CTA keeps resident (K2 TP8 down: 2 steps x 32 rows = 16 KB)


def available(device: torch.device) -> bool:
    """Gluon importable and a CUDA device of compute capability 9.x."""
    return gluon is not None and is_hopper(device)


def permute_k_reference(x: Tensor) -> Tensor:
    """``[M, K]`` with each 128-column block in the kernel's K order (a contiguous copy).

    Physical column ``32t + 8j + 4i0 + q`` of a block goes to logical column ``32j + 8q + 2t + i0``.
    """
    M, K = x.shape
    assert K % BLOCK_K == 0, f"K = {K} must be a multiple of {BLOCK_K}"
    return x.reshape(M, K // BLOCK_K, 4, 4, 2, 4).permute(0, 1, 3, 5, 2, 4).reshape(M, K)


@triton.jit
def _permute_k_kernel(x_ptr, y_ptr, M, stride_xm, stride_ym, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """One ``[BLOCK_R, 128]`` block of ``permute_k``: contiguous loads and stores, the reorder in
    registers (physical digits t, j, i0, q -> logical j, q, t, i0)."""
    pdl.grid_sync(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    c = tl.program_id(1) * 128 + tl.arange(0, 128)  # [128]
    ok = (r < M)[:, None]
    v = tl.load(x_ptr + r[:, None].to(tl.int64) * stride_xm + c[None, :], mask=ok)  # [BR, 128] physical 32t + 8j + 4i0 + q
    v = tl.reshape(tl.permute(tl.reshape(v, [BLOCK_R, 4, 4, 2, 4]), (0, 2, 4, 1, 3)), [BLOCK_R, 128])  # logical 32j + 8q + 2t + i0
    tl.store(y_ptr + r[:, None].to(tl.int64) * stride_ym + c[None, :], v, mask=ok)


def permute_k(x: Tensor) -> Tensor:
    """``permute_k_reference`` as one Triton launch: torch's strided copy of its 8-byte runs moves
    about a third of copy bandwidth (K2 M = 1152: 26 us for 16.5 MB)."""
    M, K = x.shape
    assert K % BLOCK_K == 0, f"K = {K} must be a multiple of {BLOCK_K}"
    assert x.stride(1) == 1, "x must be row-contiguous"
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if M:
        block_r = 32
        use_pdl = pdl.enabled(x.device)
        _permute_k_kernel[(triton.cdiv(M, block_r), K // BLOCK_K)](x, y, M, x.stride(0), y.stride(0), BLOCK_R=block_r,
                                                                  PDL=use_pdl, num_warps=4, launch_pdl=use_pdl)
    return y


def planes_to_operand(planes: list[Tensor]) -> Tensor:
    """``_weight_operand``'s pairing / join / permute / reshape on torch tensors: 8 nibble planes
    ``[rows, 16 words]`` of one K step -> ``[rows, 128]`` in the operand's column order."""
    rows = planes[0].shape[0]
    v = [torch.stack([planes[q], planes[q + 4]], -1).reshape(rows, 4, 4, 2) for q in range(4)]  # [rows, t, j, i0]
    c = torch.stack([torch.stack([v[0], v[1]], -1), torch.stack([v[2], v[3]], -1)], -1)  # [rows, t, j, i0, q0, q1]
    return c.permute(*OPERAND_ORDER).reshape(rows, BLOCK_K)


def supported(act: Tensor, packed: Tensor, scale: Tensor, group_size: int, block_n: int) -> bool:
    """Whether a launch fits this kernel: sm_90, bf16 activations and scales, group 32, K a
    multiple of 128, the expert's rows a multiple of ``block_n`` (64 or 128), and weight rows
    the 16-byte copies can read (the activations are read from ``permute_k``'s fresh copy)."""
    out_f, k_words = packed.shape[-2], packed.shape[-1]
    return (
        available(act.device) and act.dtype == torch.bfloat16 and scale.dtype == torch.bfloat16
        and group_size == 32 and (k_words * 8) % BLOCK_K == 0 and block_n in (64, 128) and out_f % block_n == 0
        and packed.stride(-1) == 1 and scale.stride(-1) == 1 and packed.data_ptr() % 16 == 0 and scale.data_ptr() % 16 == 0
        and all(st % 4 == 0 for st in (*packed.stride()[:-1], *scale.stride()[:-1]))
    )


if gluon is not None:
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed after Triton 3.6
    _cp_async = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _OPERAND_ORDER = gl.constexpr(list(OPERAND_ORDER))
    _DEQ_PAIRS_PTX = gl.constexpr(DEQUANT_PAIRS)
    _DEQ_PAIRS_CONSTRAINTS = gl.constexpr(DEQUANT_PAIRS_CONSTRAINTS)

    @gluon.jit
    def _dequant_pairs(p2, s2):
        """``(n - 8) * scale`` in bf16 for nibble pairs (q, q + 4) of each word (``kernels/int4_ptx.py``):
        ``p2`` / ``s2`` are the words / scales joined with themselves, so each asm call sees one word
        and one bf16x2 scale pair and returns four bf16x2 registers, output q = nibbles (q, q + 4)."""
        return gl.inline_asm_elementwise(
            asm=_DEQ_PAIRS_PTX,
            constraints=_DEQ_PAIRS_CONSTRAINTS,
            args=[p2, s2],
            dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
            is_pure=True,
            pack=2,
        )

    @gluon.jit
    def _weight_operand(w_buf, s_buf, BLOCK_N: gl.constexpr, WORDS: gl.constexpr, SCALES: gl.constexpr, A_OP: gl.constexpr):
        """The resident step's words and scales -> the wgmma A operand ``[BLOCK_N, 128]`` bf16."""
        p = w_buf.load(WORDS)  # [BN, 16] int32: words 4t .. 4t+3 of the thread's quad lane t
        s = s_buf.load(SCALES)  # [BN, 4] bf16: group t
        s = gl.reshape(gl.join(gl.join(s, s), gl.join(s, s)), [BLOCK_N, 16])  # group of word 4t + j is t
        s = gl.convert_layout(s, WORDS, assert_trivial=True)
        v0, v1, v2, v3 = _dequant_pairs(gl.join(p, p), gl.join(s, s))  # [BN, 16, 2]: nibble q + 4 i0
        r: gl.constexpr = [BLOCK_N, 4, 4, 2]  # [rows, t, j, i0]
        c = gl.join(gl.join(gl.reshape(v0, r), gl.reshape(v1, r)), gl.join(gl.reshape(v2, r), gl.reshape(v3, r)))
        w = gl.reshape(gl.permute(c, _OPERAND_ORDER.value), [BLOCK_N, 128])  # [rows, t, j, i0, q0, q1] -> column 32j + 8q + 2t + i0
        return gl.convert_layout(w, A_OP, assert_trivial=True)

    @gluon.jit
    def _scale_ptrs(rows, sk):
        """A step's 4 scales a row: 8-byte aligned runs (rows hold K/32, a multiple of 4, scales),
        which the launch cannot tell the compiler when K/32 is not a multiple of 16 (K2 TP8 down: 8)."""
        return gl.max_contiguous(gl.multiple_of(rows + sk[None, :], [1, 4]), [1, 4])

    @gluon.jit
    def _issue_weights(w0_buf, s0_buf, w1_buf, s1_buf, ok, k0, w0_rows, s0_rows, w1_rows, s1_rows,
                       GATED: gl.constexpr, W_LD: gl.constexpr, S_LD: gl.constexpr):
        """cp.async one K step's words ``[BN, 16]`` and scales ``[BN, 4]`` (of both matrices if GATED)."""
        wk = k0 // 8 + gl.arange(0, 16, layout=gl.SliceLayout(0, W_LD))
        sk = k0 // 32 + gl.arange(0, 4, layout=gl.SliceLayout(0, S_LD))
        _cp_async(w0_buf, w0_rows + wk[None, :], mask=ok)
        _cp_async(s0_buf, _scale_ptrs(s0_rows, sk), mask=ok)
        if GATED:
            _cp_async(w1_buf, w1_rows + wk[None, :], mask=ok)
            _cp_async(s1_buf, _scale_ptrs(s1_rows, sk), mask=ok)

    @gluon.jit
    def _issue_acts(x_buf, a_rows, row_ok, ok, k0, a_ptr, stride_am, X_LD: gl.constexpr):
        """cp.async one K step's activations ``[BM, 128]``."""
        xk = k0 + gl.arange(0, 128, layout=gl.SliceLayout(0, X_LD))
        _cp_async(x_buf, a_ptr + a_rows[:, None] * stride_am + xk[None, :], mask=(row_ok & ok)[:, None])

    @gluon.jit
    def _issue_step(u, n_k, n_tiles, k_lo, x_smem, w0_smem, s0_smem, w1_smem, s1_smem, a_rows, row_ok, a_ptr, stride_am,
                    w0_rows, s0_rows, w1_rows, s1_rows, tile_w, tile_s,
                    GATED: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr, N_TILES: gl.constexpr,
                    K_RESIDENT: gl.constexpr, X_LD: gl.constexpr, W_LD: gl.constexpr, S_LD: gl.constexpr,
                    W_TMA: gl.constexpr, w_bar, w0_desc, w1_desc, w_row0, BLOCK_N: gl.constexpr):
        """Ring step ``u`` (tile ``u // n_k`` of the CTA's tiles, K step ``u % n_k``, SUB x 128 wide) into
        slot ``u % STAGES``: one cp.async commit group, and with ``W_TMA`` the words by TMA on the
        slot's mbarrier (armed here for both matrices); past the CTA's last step it copies nothing.
        The row pointers are the first tile's; a later tile adds ``tile_w`` / ``tile_s`` elements each."""
        sl = u % STAGES
        if N_TILES == 1:
            ok = u < n_k
            k0 = k_lo + u * (128 * SUB)
            w_off = 0
            s_off = 0
        else:
            ok = u < n_k * n_tiles
            k0 = k_lo + (u % n_k) * (128 * SUB)
            w_off = (u // n_k) * tile_w
            s_off = (u // n_k) * tile_s
        for j in gl.static_range(SUB):  # a row's SUB x 64 bytes of words are adjacent: one burst
            b = sl * SUB + j
            if K_RESIDENT == 0:
                _issue_acts(x_smem.index(b), a_rows, row_ok, ok, k0 + j * 128, a_ptr, stride_am, X_LD)
            if W_TMA:  # the words by TMA on the slot's barrier, the scales (8 bytes a row) by cp.async
                if j == 0:
                    if ok:
                        mbarrier.expect(w_bar.index(sl), SUB * BLOCK_N * 64 * (GATED + 1))  # one or two matrices
                if ok:
                    if N_TILES > 1:
                        row = w_row0 + (u // n_k) * BLOCK_N
                    else:
                        row = w_row0
                    _tma_load(w0_desc, [row, (k0 + j * 128) // 8], w_bar.index(sl), w0_smem.index(b))
                    if GATED:
                        _tma_load(w1_desc, [row, (k0 + j * 128) // 8], w_bar.index(sl), w1_smem.index(b))
                sk = (k0 + j * 128) // 32 + gl.arange(0, 4, layout=gl.SliceLayout(0, S_LD))
                _cp_async(s0_smem.index(b), _scale_ptrs(s0_rows + s_off, sk), mask=ok)
                if GATED:
                    _cp_async(s1_smem.index(b), _scale_ptrs(s1_rows + s_off, sk), mask=ok)
            else:
                _issue_weights(w0_smem.index(b), s0_smem.index(b), w1_smem.index(b), s1_smem.index(b), ok, k0 + j * 128,
                               w0_rows + w_off, s0_rows + s_off, w1_rows + w_off, s1_rows + s_off, GATED, W_LD, S_LD)
        cp.commit_group()

    @gluon.jit
    def _epilogue(acc0, acc1, pid_m, n0, out_ptr, sorted_ids_ptr, topk_w_ptr, N, A, top_k, stride_om,
                  pid_k, ws_ptr, count_ptr, stride_ws,
                  GATED: gl.constexpr, ATOMIC: gl.constexpr, SPLIT_K: gl.constexpr, K_ORDER: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, EPI: gl.constexpr):
        """One finished ``[BLOCK_N, BLOCK_M]`` tile out: ``silu(gate) * up``, or the down rows times
        their routing weights (per assignment, or atomically per token). Split over K, gate/up
        writes its partial sums to ``ws`` and the last slice of the tile to finish (a counter a
        tile) adds them in slice order, then forms h. The tile is first put in ``EPI``: for the
        down GEMM a layout whose threads hold consecutive output columns (16-byte stores, 4-wide
        fp32 atomics; the MMA's own layout gives 2-byte stores and scalar atomics); for gate/up the
        MMA's (a no-op). ``K_ORDER``: h's columns go where ``permute_k`` would put them, so the
        down GEMM reads h as it is."""
        acc0 = gl.convert_layout(acc0, EPI)
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, EPI))
        flat = gl.load(sorted_ids_ptr + offs_m)
        row_ok = flat < A
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, EPI))
        if GATED:
            rows = offs_m.to(gl.int64)
        else:
            wt = gl.load(topk_w_ptr + flat, mask=row_ok, other=0).to(gl.float32)
            acc0 = acc0 * wt[None, :]
            if ATOMIC:
                rows = (flat // top_k).to(gl.int64)
            else:
                rows = flat.to(gl.int64)
        o_mask = row_ok[None, :] & (offs_n < N)[:, None]
        cols = offs_n
        if K_ORDER:  # logical column 32t + 8j + 4i0 + q of a 128-block is stored at 32j + 8q + 2t + i0
            c = offs_n % 128
            cols = offs_n - c + 32 * ((c // 8) % 4) + 8 * (c % 4) + 2 * (c // 32) + (c // 4) % 2
        o_ptrs = out_ptr + rows[None, :] * stride_om + cols[:, None]  # [BN, BM]
        if GATED:
            acc1 = gl.convert_layout(acc1, EPI)
            if SPLIT_K > 1:
                part = ws_ptr + rows[None, :] * (2 * N) + offs_n[:, None]  # [BN, BM] gate sums of split 0
                gl.store(part + pid_k * stride_ws, acc0, mask=o_mask)
                gl.store(part + pid_k * stride_ws + N, acc1, mask=o_mask)  # up sums
                _cta_barrier()  # every thread's partials are written before the count says so
                tile = pid_m * (N // BLOCK_N) + n0 // BLOCK_N
                last = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
                if last:  # add every slice's sums in slice order: the result does not depend on which finished last
                    acc0 = gl.zeros_like(acc0)
                    acc1 = gl.zeros_like(acc1)
                    for sl in gl.static_range(SPLIT_K):
                        acc0 += gl.load(part + sl * stride_ws, mask=o_mask, other=0.0, cache_modifier=".cg")
                        acc1 += gl.load(part + sl * stride_ws + N, mask=o_mask, other=0.0, cache_modifier=".cg")
                    gl.store(count_ptr + tile, 0)  # ready for the next launch (and graph replay)
                    h = acc0 / (1.0 + gl.exp(-acc0)) * acc1  # silu(gate) * up
                    gl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=o_mask)
            else:
                h = acc0 / (1.0 + gl.exp(-acc0)) * acc1  # silu(gate) * up
                gl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=o_mask)
        elif ATOMIC:
            gl.atomic_add(o_ptrs, acc0, mask=o_mask, sem="relaxed")
        else:
            gl.store(o_ptrs, acc0.to(out_ptr.dtype.element_ty), mask=o_mask)

    @gluon.jit(do_not_specialize=["A", "top_k", "num_m_blocks"])
    def _moe_gemm_hopper_kernel(
        a_ptr,  # GATED: permute_k(hidden) [M, K]; else permute_k(h) [P, K] (K = intermediate)
        w0_desc, w1_desc,  # W_TMA: TMA descriptors of w0 / w1 as [E * N, K/8] words, boxes [BLOCK_N, 16]
        w0_ptr,  # [E, N, K/8] int32: gate (GATED) or down
        s0_ptr,  # [E, N, K/32] bf16 scales of w0
        w1_ptr,  # [E, N, K/8] int32: up (GATED only)
        s1_ptr,  # [E, N, K/32]
        out_ptr,  # GATED: h [P, N]; reduce sum: [A, N]; atomic: [M, N] fp32
        ws_ptr,  # GATED, SPLIT_K > 1: [SPLIT_K, P, 2N] fp32 partial sums, gate | up (else unused)
        count_ptr,  # GATED, SPLIT_K > 1: int32 counters, one an output tile, zero between launches
        sorted_ids_ptr,  # [P] int32 flat assignment per padded row (A = padding)
        block_expert_ptr,  # [P / BLOCK_M] int32
        topk_w_ptr,  # [A] routing weights (not GATED)
        N, K, A, top_k, num_m_blocks,
        k_split,  # K range of one split (a multiple of 128)
        stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
        stride_ws,  # elements from one split's partials to the next's (P * 2N)
        GATED: gl.constexpr, ATOMIC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        SPLIT_K: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr, N_TILES: gl.constexpr, K_RESIDENT: gl.constexpr,
        K_ORDER: gl.constexpr, W_TMA: gl.constexpr, ACC: gl.constexpr, EPI: gl.constexpr, A_OP: gl.constexpr, WORDS: gl.constexpr, SCALES: gl.constexpr,
        X_LD: gl.constexpr, W_LD: gl.constexpr, S_LD: gl.constexpr,
        X_SMEM: gl.constexpr, W_SMEM: gl.constexpr, S_SMEM: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
    ):
        # out_ptr's columns: GATED, K_ORDER: h in the down GEMM's K order (see _epilogue).
        # A CTA: one block of BLOCK_M rows (one expert), N_TILES consecutive BLOCK_N-row weight tiles,
        # one K slice. Its (tile, K step) pairs stream through one cp.async ring, so a short K (K2 TP8
        # down: two steps) still keeps STAGES - 1 steps in flight. K_RESIDENT > 0: the activations
        # (K_RESIDENT steps, the whole K) are copied once and stay in shared memory for every tile.
        pdl.grid_sync_gluon(PDL)
        pid = gl.program_id(0)
        n_groups = gl.cdiv(N // BLOCK_N, N_TILES)
        pid_m = pid % num_m_blocks
        pid_g = (pid // num_m_blocks) % n_groups
        pid_k = pid // (num_m_blocks * n_groups)
        expert = gl.load(block_expert_ptr + pid_m)
        if expert >= 0:
            e64 = expert.to(gl.int64)
            # token rows of the activation tile, in the copy layout's row slice
            offs_mx = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_LD))
            flat_x = gl.load(sorted_ids_ptr + offs_mx)
            row_ok_x = flat_x < A
            if GATED:
                a_rows = flat_x // top_k
            else:
                a_rows = offs_mx
            a_rows = gl.where(row_ok_x, a_rows, 0).to(gl.int64)
            n_tile0 = pid_g * N_TILES
            n_tiles = gl.minimum(N // BLOCK_N - n_tile0, N_TILES)
            offs_nw = n_tile0 * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, W_LD))
            offs_ns = n_tile0 * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S_LD))
            w0_rows = w0_ptr + e64 * stride_we + offs_nw.to(gl.int64)[:, None] * stride_wn
            w1_rows = w1_ptr + e64 * stride_we + offs_nw.to(gl.int64)[:, None] * stride_wn
            s_off = e64 * stride_se + offs_ns.to(gl.int64)[:, None] * stride_sn
            s0_rows = s0_ptr + s_off
            s1_rows = s1_ptr + s_off
            tile_w = BLOCK_N * stride_wn.to(gl.int64)  # elements from one tile's rows to the next's
            tile_s = BLOCK_N * stride_sn.to(gl.int64)

            if K_RESIDENT > 0:
                x_smem = gl.allocate_shared_memory(gl.bfloat16, [K_RESIDENT, BLOCK_M, 128], X_SMEM)
            else:
                x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * SUB, BLOCK_M, 128], X_SMEM)
            w0_smem = gl.allocate_shared_memory(gl.int32, [STAGES * SUB, BLOCK_N, 16], W_SMEM)
            s0_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * SUB, BLOCK_N, 4], S_SMEM)
            if GATED:
                w1_smem = gl.allocate_shared_memory(gl.int32, [STAGES * SUB, BLOCK_N, 16], W_SMEM)
                s1_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * SUB, BLOCK_N, 4], S_SMEM)
            else:  # never read: the down GEMM has one matrix
                w1_smem = w0_smem
                s1_smem = s0_smem
            if W_TMA:
                w_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
                for i in gl.static_range(STAGES):
                    mbarrier.init(w_bar.index(i), count=1)
            else:
                w_bar = s0_smem  # never used
            w_row0 = expert * N + n_tile0 * BLOCK_N  # the CTA's first weight row in the [E * N, K/8] view

            k_lo = gl.multiple_of(pid_k * k_split, 128)  # k_split is a multiple of 128: aligned copies
            if K_RESIDENT > 0:  # one K slice, the whole K; its own commit group, older than every ring step
                n_k: gl.constexpr = K_RESIDENT // SUB
                for j in gl.static_range(K_RESIDENT):
                    _issue_acts(x_smem.index(j), a_rows, row_ok_x, True, k_lo + j * 128, a_ptr, stride_am, X_LD)
                cp.commit_group()
            else:
                n_k = (gl.minimum(k_lo + k_split, K) - k_lo) // (128 * SUB)  # the launch makes it exact
            for u in gl.static_range(STAGES - 1):  # prologue
                _issue_step(u, n_k, n_tiles, k_lo, x_smem, w0_smem, s0_smem, w1_smem, s1_smem, a_rows, row_ok_x, a_ptr,
                            stride_am, w0_rows, s0_rows, w1_rows, s1_rows, tile_w, tile_s,
                            GATED, STAGES, SUB, N_TILES, K_RESIDENT, X_LD, W_LD, S_LD,
                            W_TMA, w_bar, w0_desc, w1_desc, w_row0, BLOCK_N)
            acc0 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC)
            acc1 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC)
            if N_TILES == 1:
                n_steps = n_k
            else:
                n_steps = n_k * n_tiles
            for t in range(n_steps):
                _cta_barrier()  # every warp is done with step t-1's buffers
                _issue_step(t + STAGES - 1, n_k, n_tiles, k_lo, x_smem, w0_smem, s0_smem, w1_smem, s1_smem, a_rows,
                            row_ok_x, a_ptr, stride_am, w0_rows, s0_rows, w1_rows, s1_rows, tile_w, tile_s,
                            GATED, STAGES, SUB, N_TILES, K_RESIDENT, X_LD, W_LD, S_LD,
                            W_TMA, w_bar, w0_desc, w1_desc, w_row0, BLOCK_N)
                cp.wait_group(STAGES - 1)  # step t (and the resident activations) landed
                if W_TMA:
                    mbarrier.wait(w_bar.index(t % STAGES), (t // STAGES) & 1)
                _cta_barrier()
                cur = t % STAGES
                if N_TILES == 1:
                    kk = t
                    keep = True  # the sums start from the zeros above
                else:
                    kk = t % n_k
                    keep = kk != 0  # a tile's first K step starts its sums from zero
                for j in gl.static_range(SUB):
                    if K_RESIDENT > 0:
                        xb = x_smem.index(kk * SUB + j).permute((1, 0))  # [128, BM]: K-major B operand
                    else:
                        xb = x_smem.index(cur * SUB + j).permute((1, 0))
                    if j == 0:
                        use = keep
                    else:
                        use = True
                    w0 = _weight_operand(w0_smem.index(cur * SUB + j), s0_smem.index(cur * SUB + j), BLOCK_N, WORDS, SCALES, A_OP)
                    acc0 = warpgroup_mma(w0, xb, acc0, use_acc=use, is_async=True)
                    if GATED:
                        w1 = _weight_operand(w1_smem.index(cur * SUB + j), s1_smem.index(cur * SUB + j), BLOCK_N, WORDS, SCALES, A_OP)
                        acc1 = warpgroup_mma(w1, xb, acc1, use_acc=use, is_async=True)
                        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
                    else:
                        acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0,))
                if N_TILES > 1:
                    if kk == n_k - 1:
                        _epilogue(acc0, acc1, pid_m, (n_tile0 + t // n_k) * BLOCK_N, out_ptr, sorted_ids_ptr, topk_w_ptr,
                                  N, A, top_k, stride_om, pid_k, ws_ptr, count_ptr, stride_ws,
                                  GATED, ATOMIC, SPLIT_K, K_ORDER, BLOCK_M, BLOCK_N, EPI)
            cp.wait_group(0)
            if N_TILES == 1:
                _epilogue(acc0, acc1, pid_m, n_tile0 * BLOCK_N, out_ptr, sorted_ids_ptr, topk_w_ptr,
                          N, A, top_k, stride_om, pid_k, ws_ptr, count_ptr, stride_ws,
                          GATED, ATOMIC, SPLIT_K, K_ORDER, BLOCK_M, BLOCK_N, EPI)


def _layouts(block_m: int, block_n: int, num_warps: int, gated: bool, w_tma: bool = False) -> dict[str, object]:
    """The kernel's layouts for one (BLOCK_M, BLOCK_N, warps): A operand rows are 16 a warp. The
    down epilogue's ``EPI``: 8 consecutive output columns a thread, lanes and warps over [BN, 16]
    exactly (no element held twice, which atomics would add twice)."""
    assert block_n == 16 * num_warps, "one 16-row wgmma slice a warp"
    warp_rows = [[16 << i, 0] for i in range(num_warps.bit_length() - 1)]
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16])
    lanes_n = block_n // 8  # 8 (BN 64) or 16 (BN 128): the [BN, 16] cover is 32 // lanes_n * num_warps = 16 tokens
    return dict(
        ACC=acc,
        EPI=acc if gated else gl.BlockedLayout([8, 1], [lanes_n, 32 // lanes_n], [1, num_warps], [0, 1]),
        A_OP=gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2),
        WORDS=gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=warp_rows, block_bases=[], shape=[block_n, 16]),
        SCALES=gl.DistributedLinearLayout(
            reg_bases=[[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
            warp_bases=warp_rows, block_bases=[], shape=[block_n, 4]),
        X_LD=gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0]),
        W_LD=gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0]),
        S_LD=gl.BlockedLayout([1, 2], [16, 2], [num_warps, 1], [1, 0]),
        X_SMEM=gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], gl.bfloat16),
        W_SMEM=_WORD_SMEM if w_tma else gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]),
        S_SMEM=gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]),
    )


_WORD_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2) if gluon is not None else None


def tma_words_ok(packed: Tensor) -> bool:
    """Whether TMA can read these words as rows ``[E * N, K/8]``: experts and rows back to back."""
    return packed.is_contiguous() and packed.data_ptr() % 16 == 0 and (packed.shape[-1] * 4) % 16 == 0


def _word_desc(w: Int4Weight, block_n: int) -> "TensorDescriptor":
    """A TMA descriptor of ``w``'s words as rows ``[E * N, K/8]``, one box a K step of ``block_n`` rows."""
    assert tma_words_ok(w.packed), "TMA weights need the experts' word rows back to back (tma_words_ok)"
    return TensorDescriptor.from_tensor(w.packed.view(-1, w.packed.shape[-1]), [block_n, 16], _WORD_SMEM)


def stream_plan(
    K: int, k_split: int, block_m: int, n_tiles: int, element_size: int, resident: bool | None = None, sub: int | None = None,
) -> tuple[int, int]:
    """``(K_RESIDENT, SUB)`` of a launch: the 128-wide K steps its activations keep resident (0: they
    go through the ring) and the steps a ring slot holds; ``gemm``'s ``resident`` / ``sub`` rules."""
    k_steps = K // BLOCK_K if k_split >= K else 0  # one K slice: the steps resident activations take
    fits = k_steps > 0 and k_steps * block_m * BLOCK_K * element_size <= RESIDENT_BYTES
    if resident is None:
        resident = n_tiles > 1 and fits
    assert not resident or fits, f"resident activations need one K slice of at most {RESIDENT_BYTES} bytes"
    if sub is None:
        sub = 2 if resident and k_steps % 2 == 0 else 1
    assert sub in (1, 2), f"sub must be 1 or 2, got {sub}"
    assert k_split % (BLOCK_K * sub) == 0 and K % (BLOCK_K * sub) == 0, f"K slices must be multiples of {BLOCK_K * sub}"
    return (k_steps if resident else 0), sub


def gemm(
    a: Tensor, w0: Int4Weight, w1: Int4Weight, out: Tensor, sorted_ids: Tensor, block_expert: Tensor, topk_w: Tensor,
    N: int, K: int, A: int, top_k: int, k_split: int, *, gated: bool, atomic: bool, block_m: int,
    block_n: int, split_k: int, stages: int, n_tiles: int = 1, resident: bool | None = None, sub: int | None = None,
    max_regs: int | None = None, k_order_out: bool = False, w_tma: bool = False, ws: Tensor | None = None,
    counters: Tensor | None = None,
) -> None:
    """Launch one GEMM (``a`` already ``permute_k``'d); arguments as ``_int4_moe_gemm_kernel``'s.

    ``n_tiles``: weight tiles a CTA streams one after another (a short K's ring stays full).
    ``resident``: the CTA's activations stay in shared memory across its tiles; default where
    there are several tiles, one K slice and the whole K fits ``RESIDENT_BYTES``.
    ``sub``: 128-wide K steps a ring slot holds (one barrier pair and commit group for them all);
    default 2 with resident activations and an even number of steps, else 1. K2 TP8 down, 8 tiles:
    M=72 116 us vs 119, M=1152 266 vs 275; the gate/up GEMM lost with 2 (TP8 M=288 374 vs 339;
    ``bench/results/int4_moe_tiles_ab.json``), and one MMA wait a slot instead of one a step did
    not help (``int4_moe_tiles_ab_overlap.json``).
    ``max_regs``: registers a thread may use (``maxnreg``), so that more CTAs fit an SM; None: ptxas's choice.
    ``k_order_out``: the gate/up GEMM (unsplit) writes h's columns in ``permute_k``'s order, which
    the down GEMM reads as they are: one ``[P, I]`` copy less (K2 EP8 M = 288: 34 us).
    ``w_tma``: the weight words by TMA, one ``[block_n, 16]`` box a matrix a K step, instead of
    every thread's cp.async (``tma_words_ok`` must hold): gate/up 1.07-1.38x at K2 M = 72-1152.
    ``ws`` / ``counters``: gate/up split over K (``split_k > 1``) writes its partial sums to ``ws``
    ``[split_k, P, 2N]`` float32 and counts finished slices in ``counters`` (a zeroed int32 each
    output tile, ``kernels.device.tile_counters``); ``out`` is h either way.
    """
    assert not k_order_out or (gated and N % BLOCK_K == 0), "k_order_out: gate/up, N % 128 == 0"
    assert not gated or split_k == -(-K // k_split), f"split_k {split_k}: the K slices of {k_split} there are"
    split = gated and split_k > 1
    assert not split or (ws is not None and counters is not None and ws.shape[0] == split_k and ws.stride(2) == 1
                         and ws.stride(1) == 2 * N), "gate/up split over K needs ws [split_k, P, 2N] and counters"
    nb = block_expert.numel()
    warps = block_n // 16
    k_resident, sub = stream_plan(K, k_split, block_m, n_tiles, a.element_size(), resident, sub)
    n_groups = -(-(N // block_n) // n_tiles)
    grid = (nb * n_groups * (-(-K // k_split)),)
    descs = [_word_desc(w, block_n) for w in (w0, w1)] if w_tma else [w0.packed, w1.packed]
    use_pdl = pdl.enabled(a.device)
    _moe_gemm_hopper_kernel[grid](
        a, *descs, w0.packed, w0.scale, w1.packed, w1.scale, out, ws if split else out, counters if split else out,
        sorted_ids, block_expert, topk_w,
        N, K, A, top_k, nb, k_split,
        a.stride(0), w0.packed.stride(0), w0.packed.stride(1), w0.scale.stride(0), w0.scale.stride(1), out.stride(0),
        ws.stride(0) if split else 0,
        GATED=gated, ATOMIC=atomic, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split_k, STAGES=stages, SUB=sub,
        N_TILES=n_tiles, K_RESIDENT=k_resident, K_ORDER=k_order_out, W_TMA=w_tma,
        **_layouts(block_m, block_n, warps, gated, w_tma), PDL=use_pdl, num_warps=warps, launch_pdl=use_pdl,
        **({} if max_regs is None else {"maxnreg": max_regs}),
    )
