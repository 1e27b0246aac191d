"""DeepSeek-V3's interleaved rope in one Triton launch, rounding where the torch expression rounds.

Why: `services.verifier.rope.apply_rope_interleaved` is six launches (the de-interleave copy, a
negation and a concatenation for rotate_half, two products, a sum), and an MLA layer applies it
twice (the queries' and the new key's rope part): a dozen launches a layer for a few KB of data,
which at decode batch sizes cost more than the layer's attention. One program per token rotates all
of its rows (every head of q_pe, or the one k_pe row) and can write straight into a slice of a
larger tensor (`out`), so the new latent kv needs no concatenation either.

Exactness: torch computes each product and the sum in float32 and rounds each to the tensor's
dtype; the kernel rounds at the same three places, so its output is the torch expression's bit for
bit (tests/test_rope_kernel.py: the interpreter in fp32 / fp16, and the sm_90 build's PTX). The
products are `mul.rn` on the GPU: left to itself, LLVM narrows a product that is rounded to 16
bits into a 16-bit multiply and fuses it with the following add into one FMA, which skips a
rounding (the interpreter's numpy products are exact already).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import pdl
from kernels.device import interpreted, on_input_device

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - only where triton is not installed
    triton = None
    tl = None

__all__ = ["rope_interleaved_triton"]


if triton is not None:

    @triton.jit
    def _mul(a, b, EXACT: tl.constexpr):
        # mul.rn: LLVM would otherwise narrow a product rounded to 16 bits into a 16-bit multiply
        # and fuse it with the next add into one FMA, skipping a rounding torch does.
        return libdevice.mul_rn(a, b) if EXACT else a * b

    @triton.jit
    def _rope_interleaved_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, rows, stride_xt, stride_xr, stride_ct,
                                 stride_st, stride_ot, stride_or, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                                 BLOCK_H: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        pdl.grid_sync(PDL)
        r = tl.arange(0, BLOCK_R)[:, None]                       # [R, 1] row of this token (a head)
        j = tl.arange(0, BLOCK_H)[None, :]                       # [1, H] rotation pair
        _rope_store(x_ptr + token * stride_xt + r * stride_xr, cos_ptr + token * stride_ct, sin_ptr + token * stride_st,
                    out_ptr + token * stride_ot + r * stride_or, j, (r < rows) & (j < HALF), HALF, EXACT)

    @triton.jit
    def _rope_store(x_row, cos_row, sin_row, out_row, j, ok, HALF: tl.constexpr, EXACT: tl.constexpr):
        """Rotate rows ``x_row`` ([R, 1] pointers; pairs ``j`` [1, H]) by one token's cos / sin into
        ``out_row``; every kernel that ropes calls this, so all of them round alike."""
        even = tl.load(x_row + 2 * j, mask=ok, other=0.0).to(tl.float32)      # de-interleaved first half
        odd = tl.load(x_row + 2 * j + 1, mask=ok, other=0.0).to(tl.float32)   # de-interleaved second half
        dt = out_row.dtype.element_ty
        c_lo = tl.load(cos_row + j, mask=j < HALF, other=0.0).to(tl.float32)
        c_hi = tl.load(cos_row + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        s_lo = tl.load(sin_row + j, mask=j < HALF, other=0.0).to(tl.float32)
        s_hi = tl.load(sin_row + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        # y * cos + rotate_half(y) * sin with y = [even, odd], rotate_half(y) = [-odd, even]; each
        # product and the sum rounded to the dtype, as torch's elementwise ops round them.
        lo = _mul(even, c_lo, EXACT).to(dt).to(tl.float32) + _mul(-odd, s_lo, EXACT).to(dt).to(tl.float32)
        hi = _mul(odd, c_hi, EXACT).to(dt).to(tl.float32) + _mul(even, s_hi, EXACT).to(dt).to(tl.float32)
        tl.store(out_row + j, lo.to(dt), mask=ok)
        tl.store(out_row + HALF + j, hi.to(dt), mask=ok)


@on_input_device
def rope_interleaved_triton(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor | None = None) -> Tensor:
    """`apply_rope_interleaved(x, cos, sin)` for ``x`` [N, d] or [N, R, d] (R rows a token, e.g. heads;
    rows may be strided) and per-token ``cos`` / ``sin`` [N, d]; into ``out`` (same shape, may be a
    strided slice of a larger tensor) when given, else a new tensor."""
    if triton is None:
        raise RuntimeError("rope_interleaved_triton needs triton")
    rows3 = x if x.dim() == 3 else x.unsqueeze(1)                 # [N, R, d]
    N, R, d = rows3.shape
    if d % 2 or cos.shape != (N, d) or sin.shape != (N, d):
        raise ValueError(f"rope needs an even last dim and cos/sin [{N}, {d}]; got x {tuple(x.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if rows3.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope needs the rotated dim contiguous")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(x.shape)} with a contiguous last dim, got {tuple(out.shape)}")
    out3 = out if out.dim() == 3 else out.unsqueeze(1)
    if N:
        use_pdl = pdl.enabled(x.device)
        _rope_interleaved_kernel[(N,)](
            rows3, cos, sin, out3, R, rows3.stride(0), rows3.stride(1), cos.stride(0), sin.stride(0),
            out3.stride(0), out3.stride(1), HALF=d // 2, BLOCK_R=triton.next_power_of_2(R),
            BLOCK_H=triton.next_power_of_2(d // 2), EXACT=not interpreted(), PDL=use_pdl,
            num_warps=1 if R * d <= 1024 else 4, launch_pdl=use_pdl)
    return out
