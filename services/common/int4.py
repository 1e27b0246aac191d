"""INT4 weights in the compressed-tensors ``pack-quantized`` layout.

Why this layout: it is what Kimi-K2 / DeepSeek INT4 checkpoints ship, so the loader, the torch
reference MoE and the future fused Triton kernel all agree on one bit order:
element ``8j + i`` of a row sits in bits ``4i .. 4i+3`` of int32 word ``j`` and decodes to
``(nibble - 8) * scale[row, col // group_size]`` (symmetric, group-wise scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Int4Weight", "pack_int4", "unpack_int4", "NIBBLES_PER_WORD"]

NIBBLES_PER_WORD = 8


@dataclass(frozen=True)
class Int4Weight:
    """One packed linear weight (leading batch dims, e.g. stacked experts, are allowed)."""

    packed: Tensor  # [..., out, in/8] int32
    scale: Tensor  # [..., out, in/group] float
    shape: tuple[int, int]  # (out, in) of the dense weight


def pack_int4(w: Tensor, group_size: int = 32, scale_dtype: torch.dtype | None = None) -> Int4Weight:
    """Quantise ``w`` symmetrically per group (scale = absmax / 7, nibbles 1..15).

    Used to write test/demo checkpoints; the scale is rounded to ``scale_dtype`` *before*
    quantising so the stored (scale, nibble) pair reproduces the weight within scale / 2.
    """
    assert w.dim() == 2, f"pack_int4 expects a 2-D weight, got shape {tuple(w.shape)}"
    out_f, in_f = w.shape
    assert in_f % group_size == 0, f"in_features {in_f} must be a multiple of group_size {group_size}"
    assert group_size % NIBBLES_PER_WORD == 0, f"group_size {group_size} must be a multiple of 8"
    scale_dtype = scale_dtype or w.dtype
    groups = w.float().reshape(out_f, in_f // group_size, group_size)  # [out, G, group]
    scale = (groups.abs().amax(dim=-1) / 7.0).clamp_min(1e-12).to(scale_dtype)  # [out, G]
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-7, 7).to(torch.int64) + 8  # [out, G, group]
    nibbles = q.reshape(out_f, in_f // NIBBLES_PER_WORD, NIBBLES_PER_WORD)  # [out, in/8, 8]
    shifts = torch.arange(NIBBLES_PER_WORD, dtype=torch.int64, device=w.device) * 4  # [8]
    words = (nibbles << shifts).sum(dim=-1)  # [out, in/8] int64 in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement wrap
    return Int4Weight(packed=words, scale=scale, shape=(out_f, in_f))


def unpack_int4(
    packed: Tensor,
    scale: Tensor,
    shape: tuple[int, int] | Tensor | None = None,
    group_size: int = 32,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Dequantise packed INT4 words to a dense weight ``[..., out, in]``.

    ``dtype`` defaults to the scale's dtype (the spec); the product is formed in float32 (float64
    when asked for) so a bf16 scale times a nibble is not rounded twice.
    """
    assert packed.dtype == torch.int32, f"weight_packed must be int32, got {packed.dtype}"
    out_dtype = dtype or scale.dtype
    math_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    shifts = torch.arange(NIBBLES_PER_WORD, dtype=torch.int32, device=packed.device) * 4  # [8]
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., out, in/8, 8]; & drops sign extension
    q = nibbles.flatten(-2).to(math_dtype) - 8.0  # [..., out, in]
    in_f = q.shape[-1]
    if shape is not None:
        out_s, in_s = (int(v) for v in (shape.tolist() if isinstance(shape, Tensor) else shape))
        assert out_s == q.shape[-2] and in_s <= in_f, f"weight_shape {(out_s, in_s)} does not fit packed {tuple(packed.shape)}"
        q = q[..., :in_s]
        in_f = in_s
    n_groups = scale.shape[-1]
    assert n_groups * group_size >= in_f, f"scale has {n_groups} groups of {group_size}, too few for {in_f} columns"
    s = scale.to(math_dtype).repeat_interleave(group_size, dim=-1)[..., :in_f]  # [..., out, in]
    return (q * s).to(out_dtype)
