"""The MLA layer's latent norms and the new key's rope in one Triton launch.

Why: the stacked q / kv projection (``h @ [q_a; kv_a]^T``) is followed by three small launches: the
q LoRA's RMSNorm, the latent kv's RMSNorm into the new-kv row, and the key's rope into the same
row. At decode each is a few microseconds of launch for a few KB. Here one program per (token,
part) does its part: part 0 the q norm, part 1 the kv norm and the key's rope. The norms and the
rope are the very code of ``kernels.rms_norm`` and ``kernels.rope`` (``_norm_store``, ``_rope_store``)
at the same block sizes and warps, so the results are theirs bit for bit, and through them torch's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import pdl
from kernels.device import interpreted, on_input_device
from kernels.rms_norm import norm_warps

try:
    import triton
    import triton.language as tl

    from kernels.rms_norm import _norm_store
    from kernels.rope import _rope_store
except ImportError:  # pragma: no cover - only where triton is not installed
    triton = None
    tl = None

__all__ = ["mla_norm_rope", "fusable"]


if triton is not None:

    @triton.jit
    def _mla_norm_rope_kernel(qkv_ptr, q_w_ptr, kv_w_ptr, cos_ptr, sin_ptr, q_out_ptr, kv_out_ptr,
                              stride_qkv, stride_ct, stride_st, stride_qo, stride_kvo, q_rows, kvr, eps,
                              Q_PARTS: tl.constexpr, Q_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr,
                              HALF: tl.constexpr, BLOCK_H: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        pdl.grid_sync(PDL)
        row = qkv_ptr + token * stride_qkv
        if part < Q_PARTS:   # the q LoRA's norm (names differ per branch: their shapes do)
            q_cols = tl.arange(0, Q_BLOCK)
            q_ok = q_cols < q_rows
            q_x = tl.load(row + q_cols, mask=q_ok, other=0.0)
            _norm_store(q_x, q_w_ptr, q_out_ptr + token * stride_qo, q_cols, q_ok, q_rows, eps)
        else:                # the latent kv's norm, then the key's rope, into the new-kv row
            kv_cols = tl.arange(0, KV_BLOCK)
            kv_ok = kv_cols < kvr
            kv_x = tl.load(row + q_rows + kv_cols, mask=kv_ok, other=0.0)
            out = kv_out_ptr + token * stride_kvo
            _norm_store(kv_x, kv_w_ptr, out, kv_cols, kv_ok, kvr, eps)
            r = tl.arange(0, 1)[:, None]
            j = tl.arange(0, BLOCK_H)[None, :]
            _rope_store(row + q_rows + kvr + r, cos_ptr + token * stride_ct, sin_ptr + token * stride_st,
                        out + kvr + r, j, (r < 1) & (j < HALF), HALF, EXACT)


def fusable(q_rows: int, kvr: int) -> bool:
    """Whether the separate launches' warps agree for both norms (so one launch reduces as they do)."""
    return norm_warps(triton.next_power_of_2(q_rows)) == norm_warps(triton.next_power_of_2(kvr))


@on_input_device
def mla_norm_rope(q_kv: Tensor, q_rows: int, q_norm: Tensor | None, kv_norm: Tensor, cos: Tensor, sin: Tensor,
                  eps: float, new_kv: Tensor) -> Tensor | None:
    """From ``q_kv [N, q_rows + kvr + rope]``: the normed q LoRA part (returned, ``[N, q_rows]``; None
    without a q LoRA, ``q_norm`` None, where ``q_rows`` only places the kv part), and ``new_kv
    [N, kvr + rope]`` filled with the normed latent and the roped key (per-token ``cos`` / ``sin``
    ``[N, rope]``)."""
    if triton is None:
        raise RuntimeError("mla_norm_rope needs triton")
    N = q_kv.shape[0]
    kvr, rope = kv_norm.shape[0], cos.shape[-1]
    has_q = q_norm is not None
    assert q_kv.dim() == 2 and q_kv.shape[1] == q_rows + kvr + rope and q_kv.stride(1) == 1, (
        f"q_kv must be [N, {q_rows} + {kvr} + {rope}] with a contiguous last dim, got {tuple(q_kv.shape)}")
    assert new_kv.shape == (N, kvr + rope) and new_kv.stride(1) == 1 and new_kv.dtype == q_kv.dtype
    assert cos.shape == sin.shape == (N, rope) and cos.stride(1) == sin.stride(1) == 1 and rope % 2 == 0
    assert not has_q or fusable(q_rows, kvr), "the two norms would take different warps: launch them apart"
    q_out = torch.empty(N, q_rows, dtype=torch.promote_types(q_norm.dtype, q_kv.dtype), device=q_kv.device) \
        if has_q else None
    if N:
        kv_block = triton.next_power_of_2(kvr)
        q_block = triton.next_power_of_2(q_rows) if has_q else kv_block
        use_pdl = pdl.enabled(q_kv.device)
        _mla_norm_rope_kernel[(N, 2 if has_q else 1)](
            q_kv, q_norm if has_q else kv_norm, kv_norm, cos, sin, q_out if has_q else new_kv, new_kv,
            q_kv.stride(0), cos.stride(0), sin.stride(0), q_out.stride(0) if has_q else 0, new_kv.stride(0),
            q_rows, kvr, eps, Q_PARTS=1 if has_q else 0, Q_BLOCK=q_block, KV_BLOCK=kv_block, HALF=rope // 2,
            BLOCK_H=triton.next_power_of_2(rope // 2), EXACT=not interpreted(), PDL=use_pdl, num_warps=norm_warps(kv_block),
            launch_pdl=use_pdl)
    return q_out
