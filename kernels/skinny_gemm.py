"""``x @ weight^T`` for a few rows of x (decode and small verify steps), in one Triton launch.

Why: at one to a few dozen tokens a dense projection only streams its weight, and at Kimi-K2's
per-rank shapes cuBLAS spends 4-8 us on matrices of 1-7 MB (0.3-1.7 us of HBM time) and a second
launch for its split-K reduction (BENCHMARKS.md). This kernel cuts the weight into ``BLOCK_N``-row
tiles and, where that leaves the GPU short of programs, the K dimension into ``split_k`` slices.
Each program multiplies its weight tile by all of x's rows (``tl.dot``, rows padded to 16). The
slices of one tile write float32 partials; the last to finish (an atomic counter a tile) adds them
in slice order, so the result does not depend on which finished last, and resets the counter for
the next call. One launch, deterministic, CUDA-graph safe.

``skinny_linear`` takes ``x [M, K]`` or ``[B, M, K]`` and ``weight [N, K]`` or ``[B, N, K]`` at
any strides (``w_uk`` is read through a transposed view), an optional ``out`` view to write (the
attention's ``[H, N, v]`` view of an ``[N, H, v]`` tensor) and an optional ``add_to [M, N]`` that
the product is added into in place, rounded once, as ``addmm_`` does. ``skinny_linear_reference``
is the torch expression; off CUDA, and above ``MAX_ROWS`` rows, ``skinny_linear`` is that.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import pdl
from kernels.device import TILE_COUNTERS, interpreted, on_input_device, tile_counters

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - only where triton is not installed
    triton = None
    tl = None

__all__ = ["MAX_ROWS", "KERNEL_ROWS", "skinny_linear", "skinny_linear_reference", "skinny_linear_triton", "skinny_plan"]

MAX_ROWS = 32  # rows of x up to which skinny_linear takes the kernel on CUDA (above: cuBLAS, see skinny_linear)
KERNEL_ROWS = 64  # rows of x the kernel takes
SERVED = True  # skinny_linear takes the kernel where it applies (a switch for A/Bs: bench/k2_ab.py)
_STAGE_BUDGET = 192 << 10  # shared memory the pipelined loads may take (an H100 / H200 CTA: 227 KB)


def skinny_linear_reference(x: Tensor, weight: Tensor, *, out: Tensor | None = None,
                            add_to: Tensor | None = None) -> Tensor:
    """The torch expression: ``x @ weight^T`` (batched where x is 3-d), into ``out`` / added into
    ``add_to`` (in place, as ``addmm_``)."""
    if add_to is not None:
        return add_to.addmm_(x, weight.T)
    if x.dim() == 3:
        return torch.bmm(x, weight.transpose(1, 2), out=out)
    return x @ weight.T if out is None else torch.mm(x, weight.T, out=out)


def skinny_plan(n: int, k: int, batch: int, sm_count: int) -> tuple[int, int, int, int, int]:
    """``(block_n, block_k, split_k, num_stages, num_warps)``: 64-row weight tiles (16 where the
    tiles would be few and K too short to split), K slices of at least 384 (at most 8) until the
    grid has about 96 programs, 256-wide K steps (128 at K <= 256), four stages, four warps. From
    the sweep at Kimi-K2's per-rank projections on an H200 (``bench/results/skinny_gemm_sweep-4ad5b2d.json``):
    this is the best plan, or within 3% of it, at 1 and 17 tokens for every projection but one
    (``w_uv`` at one token: 3.19 us against 3.12)."""
    del sm_count  # the sweep's grids are far below a wave; kept for other GPUs' plans
    block_n = 64 if batch * -(-n // 64) >= 32 or k >= 1024 else 16
    tiles = batch * -(-n // block_n)
    split_k = 1
    while tiles * split_k < 96 and k // (2 * split_k) >= 384 and split_k < 8:
        split_k *= 2
    return block_n, 128 if k <= 256 else 256, split_k, 4, 4


if triton is not None:

    @triton.jit
    def _skinny_kernel(
        x_ptr, w_ptr, out_ptr, add_ptr, part_ptr, count_ptr,
        M, N, K, k_slice,
        stride_xb, stride_xm, stride_xk, stride_wb, stride_wn, stride_wk,
        stride_ob, stride_om, stride_on, stride_am, stride_an,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        HAS_ADD: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
    ):
        """One ``BLOCK_N``-row weight tile x one K slice x one batch entry; all of x's rows.
        ``DOT_F32``: the products in float32 (the interpreter's 16-bit ``tl.dot`` is wrong for bf16
        in some Triton releases; bf16 x bf16 products are exact in float32 either way).
        ``PDL``: launched with programmatic dependent launch (``kernels.pdl``)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_ok = offs_n < N
        m_ok = offs_m < M
        k_lo = pid_k * k_slice
        w_rows = w_ptr + b * stride_wb + offs_n.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
        x_cols = x_ptr + b * stride_xb + offs_m.to(tl.int64)[None, :] * stride_xm  # [1, BM]
        pdl.grid_sync(PDL)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, k_slice, BLOCK_K):
            offs_k = k_lo + k0 + tl.arange(0, BLOCK_K)
            k_ok = (offs_k < K) & (k0 + tl.arange(0, BLOCK_K) < k_slice)
            w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
            xt = tl.load(x_cols + offs_k[:, None] * stride_xk, mask=k_ok[:, None] & m_ok[None, :], other=0.0)  # [BK, BM]
            if DOT_F32:
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
            else:
                acc = tl.dot(w, xt, acc)  # [BN, BM]
        tile_ok = n_ok[:, None] & m_ok[None, :]
        if SPLIT_K > 1:
            tile = tl.program_id(2) * tl.num_programs(0) + pid_n
            part = part_ptr + (tile * SPLIT_K).to(tl.int64) * (BLOCK_N * BLOCK_M)
            offs_t = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
            tl.store(part + pid_k * (BLOCK_N * BLOCK_M) + offs_t, acc)
            tl.debug_barrier()  # every thread's partial is written before the count says so
            done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT_K - 1:  # the last slice adds all of them, in slice order
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for s in range(SPLIT_K):
                    acc += tl.load(part + s * (BLOCK_N * BLOCK_M) + offs_t, cache_modifier=".cg")
                tl.store(count_ptr + tile, 0)  # ready for the next call (and graph replay)
                _skinny_store(acc, out_ptr + b * stride_ob, add_ptr, offs_m, offs_n, tile_ok, stride_om, stride_on,
                              stride_am, stride_an, HAS_ADD)
        else:
            _skinny_store(acc, out_ptr + b * stride_ob, add_ptr, offs_m, offs_n, tile_ok, stride_om, stride_on,
                          stride_am, stride_an, HAS_ADD)

    @triton.jit
    def _skinny_store(acc, out_ptr, add_ptr, offs_m, offs_n, tile_ok, stride_om, stride_on, stride_am, stride_an,
                      HAS_ADD: tl.constexpr):
        """The tile's ``[BLOCK_N, BLOCK_M]`` sums, plus ``add_to``'s elements where given, rounded once
        into ``out[m, n]``."""
        if HAS_ADD:
            acc += tl.load(add_ptr + offs_m[None, :] * stride_am + offs_n[:, None] * stride_an, mask=tile_ok,
                           other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on, acc.to(out_ptr.dtype.element_ty),
                 mask=tile_ok)


def _sm_count(device: torch.device) -> int:
    from kernels.tree_mla import _sm_count as sms

    return sms(device)


@on_input_device
def skinny_linear_triton(x: Tensor, weight: Tensor, *, out: Tensor | None = None, add_to: Tensor | None = None,
                         plan: tuple[int, ...] | None = None) -> Tensor:
    """The kernel (see the module docstring); ``plan`` overrides ``skinny_plan``'s
    ``(block_n, block_k, split_k[, num_stages, num_warps])``. x has at most ``KERNEL_ROWS`` rows.
    Where ``kernels.pdl`` is enabled it launches with PDL."""
    batched = x.dim() == 3
    xb = x if batched else x.unsqueeze(0)
    wb = weight if weight.dim() == 3 else weight.unsqueeze(0)
    B, M, K = xb.shape
    N = wb.shape[1]
    assert wb.shape == (B, N, K), f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}"
    assert 1 <= M <= KERNEL_ROWS, f"the kernel takes 1..{KERNEL_ROWS} rows of x, got {M}"
    assert x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16), f"16-bit x and weight, got {x.dtype} / {weight.dtype}"
    assert add_to is None or (not batched and add_to.shape == (M, N)), "add_to is [M, N], x 2-d"
    if add_to is not None:
        out = add_to
    elif out is None:
        out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    ob = out if out.dim() == 3 else out.unsqueeze(0)
    assert ob.shape == (B, M, N), f"out {tuple(out.shape)}, want {(B, M, N) if batched else (M, N)}"
    block_n, block_k, split_k, *launch = plan or skinny_plan(N, K, B, _sm_count(x.device))
    num_stages, num_warps = (list(launch) + [3, 4][len(launch):])[:2]
    n_tiles = -(-N // block_n)
    block_m = max(16, triton.next_power_of_2(M))
    stage_bytes = (block_n + block_m) * block_k * x.element_size()  # a weight tile and an x tile
    num_stages = max(1, min(num_stages, _STAGE_BUDGET // stage_bytes))
    k_slice = -(-(-(-K // split_k)) // block_k) * block_k
    split_k = -(-K // k_slice)  # slices past K would be empty
    part = counters = out
    if split_k > 1:
        assert B * n_tiles <= TILE_COUNTERS, f"{B * n_tiles} tiles split over K; {TILE_COUNTERS} counters"
        part = torch.empty(B * n_tiles * split_k * block_n * block_m, dtype=torch.float32, device=x.device)
        counters = tile_counters(x.device)
    add = add_to if add_to is not None else out
    use_pdl = pdl.enabled(x.device)
    _skinny_kernel[(n_tiles, split_k, B)](
        xb, wb, ob, add, part, counters, M, N, K, k_slice,
        xb.stride(0), xb.stride(1), xb.stride(2), wb.stride(0), wb.stride(1), wb.stride(2),
        ob.stride(0), ob.stride(1), ob.stride(2), add.stride(-2), add.stride(-1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, HAS_ADD=add_to is not None,
        DOT_F32=interpreted(), PDL=use_pdl,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=use_pdl,
    )
    return out


def skinny_linear(x: Tensor, weight: Tensor, *, out: Tensor | None = None, add_to: Tensor | None = None) -> Tensor:
    """``x @ weight^T``: the kernel on CUDA up to ``MAX_ROWS`` rows of 16-bit x, torch elsewhere. On an
    H200 at Kimi-K2's per-rank projections (``bench/results/skinny_gemm-d0887b6.json``) the kernel
    took 0.93-1.53x cuBLAS's time at 1-17 tokens (1.07-1.53x but for the shared expert's down
    GEMM, 0.93-1.01x), and lost at 33 and 64 tokens on five of the eight (0.85-0.99x)."""
    if (SERVED and x.is_cuda and triton is not None and 0 < x.shape[-2] <= MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype):
        return skinny_linear_triton(x, weight, out=out, add_to=add_to)
    return skinny_linear_reference(x, weight, out=out, add_to=add_to)
