"""RMSNorm in one Triton launch (DeepSeek-V3 / HF semantics), and its torch reference.

Why: the torch expression is about eight kernels (cast, square, mean, add, rsqrt, multiply, cast,
scale); a K2 layer runs four norms, so at decode those tiny launches cost more than the norm's
bytes. One program per row reads the row once and writes it once. ``add_rms_norm`` also takes the
decoder's residual add that precedes every norm but the first, one launch fewer each.

Semantics (HF ``DeepseekV3RMSNorm``): statistics in float32, the normalised row rounded to the
input dtype, then multiplied by the weight (rounded once more to the result dtype).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import pdl
from kernels.device import on_input_device

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - only where triton is not installed
    triton = None
    tl = None

__all__ = ["rms_norm", "rms_norm_reference", "rms_norm_triton", "add_rms_norm", "add_rms_norm_reference", "add_rms_norm_triton"]


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF DeepSeek RMSNorm: statistics in at least float32, scale applied in the input dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                           float32_copy: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The decoder's residual step: ``x + residual`` (in ``x``'s dtype) and that sum normalised;
    ``float32_copy`` (optional, ``[N, n]`` float32) receives the normalised rows upcast."""
    total = x + residual
    normed = rms_norm_reference(total, weight, eps)
    if float32_copy is not None:
        float32_copy.copy_(normed)
    return total, normed


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, out_ptr, f32_ptr, stride_x, stride_res, stride_sum,
                         stride_out, stride_f32, n_cols, eps, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
                         F32_COPY: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        pdl.grid_sync(PDL)
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if RESIDUAL:  # x + residual rounded to x's dtype, as torch's add is; the norm reads that
            r = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
        y = _norm_store(x, w_ptr, out_ptr + row * stride_out, cols, ok, n_cols, eps)
        if F32_COPY:  # the rows upcast exactly, for a float32 consumer (the MoE router): no cast launch
            tl.store(f32_ptr + row * stride_f32 + cols, y.to(tl.float32), mask=ok)

    @triton.jit
    def _norm_store(x, w_ptr, out_row, cols, ok, n_cols, eps):
        """Normalise one loaded row ``x`` (masked past ``n_cols``), store it at ``out_row`` and return it;
        every kernel that norms a row calls this, so all of them round and reduce alike."""
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
        normed = (xf * rstd).to(x.dtype).to(tl.float32)   # rounded to the input dtype, as HF does
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        y = (normed * w).to(out_row.dtype.element_ty)
        tl.store(out_row + cols, y, mask=ok)
        return y


@on_input_device
def rms_norm_triton(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """:func:`rms_norm_reference` over the last dim of ``x`` [..., n] (rows may be strided); into
    ``out`` when given (2-D rows, e.g. a column slice of a larger tensor), else a new tensor."""
    if triton is None:
        raise RuntimeError("rms_norm_triton needs triton")
    n = x.shape[-1]
    assert weight.shape == (n,), f"weight must be [{n}], got {tuple(weight.shape)}"
    assert x.stride(-1) == 1 and weight.stride(0) == 1, "the normalised dim must be contiguous"
    rows = x.reshape(-1, n) if x.dim() != 2 else x   # a view where the layout allows
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        dst = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    else:
        assert out.shape == rows.shape and out.dtype == out_dtype and out.stride(-1) == 1, (
            f"out must be {tuple(rows.shape)} {out_dtype} with a contiguous last dim")
        dst = out
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        use_pdl = pdl.enabled(x.device)
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, rows, weight, dst, dst, rows.stride(0), 0, 0, dst.stride(0), 0,
                                           n, eps, BLOCK=block, RESIDUAL=False, F32_COPY=False, PDL=use_pdl,
                                           num_warps=norm_warps(block), launch_pdl=use_pdl)
    return dst if out is not None else dst.view(*x.shape[:-1], n)


def norm_warps(block: int) -> int:
    """Warps of a norm launch over ``block`` columns (the reduction's layout, so its order, follows)."""
    return 4 if block <= 2048 else 8


@on_input_device
def add_rms_norm_triton(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                        float32_copy: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`add_rms_norm_reference` in one launch over 2-D rows ``[N, n]``: a new sum tensor (``x`` is
    left alone: a caller may hold it, e.g. as a layer's features) and the normalised rows (and their
    float32 upcast into ``float32_copy`` when given)."""
    if triton is None:
        raise RuntimeError("add_rms_norm_triton needs triton")
    n = x.shape[-1]
    assert x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype, (
        f"x and residual must be one [N, n] shape and dtype, got {tuple(x.shape)} {x.dtype} / "
        f"{tuple(residual.shape)} {residual.dtype}")
    assert weight.shape == (n,), f"weight must be [{n}], got {tuple(weight.shape)}"
    assert x.stride(-1) == residual.stride(-1) == weight.stride(0) == 1, "the normalised dim must be contiguous"
    assert float32_copy is None or (float32_copy.shape == x.shape and float32_copy.dtype == torch.float32
                                    and float32_copy.stride(-1) == 1), "float32_copy must be float32 [N, n], rows contiguous"
    total = torch.empty_like(x, memory_format=torch.contiguous_format)
    dst = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    f32 = dst if float32_copy is None else float32_copy
    if x.shape[0]:
        block = triton.next_power_of_2(n)
        use_pdl = pdl.enabled(x.device)
        _rms_norm_kernel[(x.shape[0],)](x, residual, total, weight, dst, f32, x.stride(0), residual.stride(0),
                                        total.stride(0), dst.stride(0), f32.stride(0), n, eps,
                                        BLOCK=block, RESIDUAL=True, F32_COPY=float32_copy is not None, PDL=use_pdl,
                                        num_warps=norm_warps(block), launch_pdl=use_pdl)
    return total, dst


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """One Triton launch on CUDA (float16/bfloat16/float32); the torch expression elsewhere. With
    ``out`` (2-D ``x`` only) the result is written there and returned."""
    if x.is_cuda and triton is not None and x.stride(-1) == 1 and x.dtype != torch.float64:
        return rms_norm_triton(x, weight, eps, out=out)
    ref = rms_norm_reference(x, weight, eps)
    return ref if out is None else out.copy_(ref)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                 float32_copy: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(x + residual, rms_norm(x + residual))``: one Triton launch on CUDA, bit for bit the two torch
    steps it replaces (the add rounds to the dtype before the norm reads it); torch elsewhere. With
    ``float32_copy`` the normed rows are also written there as float32 (exact: an upcast)."""
    if (x.is_cuda and triton is not None and x.dim() == 2 and x.dtype != torch.float64
            and x.stride(-1) == residual.stride(-1) == 1):
        return add_rms_norm_triton(x, residual, weight, eps, float32_copy)
    return add_rms_norm_reference(x, residual, weight, eps, float32_copy)
