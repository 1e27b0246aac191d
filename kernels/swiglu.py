"""SwiGLU's activation, ``silu(gate) * up``, in one Triton launch from the fused gate/up product.

Why: the dense MLP and the shared expert compute gate and up with one GEMM over their stacked
weights (``[gate; up]``, one launch and one weight stream instead of two), so the activation
reads the two halves of one ``[N, 2I]`` product. The torch expression is two launches (``silu``,
then the product) that each write a tensor the next reads; this is one. Rounding is torch's:
``silu`` in float32 (IEEE ``exp`` and division, as torch's CUDA kernel computes it) rounded to the
dtype, then the product rounded once more, so greedy tokens do not move.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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

__all__ = ["silu_mul", "silu_mul_reference", "silu_mul_triton"]


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[N, 2I]`` -> ``[N, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, inter, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
                         PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        pdl.grid_sync(PDL)
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0)
        u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        e = libdevice.exp(-gf) if LIBDEVICE else tl.exp(-gf)
        s = tl.math.div_rn(gf, 1.0 + e).to(g.dtype)   # torch's silu: x / (1 + exp(-x)), rounded
        tl.store(out_ptr + row * stride_out + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


@on_input_device
def silu_mul_triton(gate_up: Tensor) -> Tensor:
    """:func:`silu_mul_reference` in one launch over 2-D rows ``[N, 2I]`` (rows may be strided)."""
    if triton is None:
        raise RuntimeError("silu_mul_triton needs triton")
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1, (
        f"gate_up must be [N, 2I] with a contiguous last dim, got {tuple(gate_up.shape)}")
    N, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(N, inter, dtype=gate_up.dtype, device=gate_up.device)
    if N:
        block = min(1024, triton.next_power_of_2(inter))
        use_pdl = pdl.enabled(gate_up.device)
        _silu_mul_kernel[(N, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                         BLOCK=block, LIBDEVICE=not interpreted(), PDL=use_pdl,
                                                         num_warps=4 if block >= 512 else 1, launch_pdl=use_pdl)
    return out


def silu_mul(gate_up: Tensor) -> Tensor:
    """One Triton launch on CUDA (float16 / bfloat16 / float32), the torch expression elsewhere."""
    if gate_up.is_cuda and triton is not None and gate_up.dim() == 2 and gate_up.dtype != torch.float64 \
            and gate_up.stride(-1) == 1:
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)
