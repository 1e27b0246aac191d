"""Rotary embeddings as DeepSeek-V3 applies them: yarn scaling and the interleaved layout.

Why a table in float64: the fp32 verifier and the float64 reference share one exact table, so
their comparison measures the attention/MoE code, not rope rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from services.verifier.config import TargetConfig, YarnScaling

__all__ = [
    "yarn_get_mscale",
    "yarn_inv_freq",
    "softmax_scale",
    "RotaryTable",
    "apply_rope_interleaved",
    "apply_rope",
    "rotate_half",
]


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, yarn: YarnScaling | None) -> Tensor:
    """Inverse frequencies ``[dim/2]`` (float64): extrapolated for high, interpolated for low frequencies."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim  # [dim/2]
    freq_extra = 1.0 / (base**exponents)  # [dim/2]
    if yarn is None:
        return freq_extra
    freq_inter = 1.0 / (yarn.factor * base**exponents)  # [dim/2]
    low = max(math.floor(_correction_dim(yarn.beta_fast, dim, base, yarn.original_max_position_embeddings)), 0)
    high = min(math.ceil(_correction_dim(yarn.beta_slow, dim, base, yarn.original_max_position_embeddings)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # [dim/2]
    extra_mask = 1.0 - ramp
    return freq_inter * (1 - extra_mask) + freq_extra * extra_mask


def softmax_scale(config: TargetConfig) -> float:
    """(nope+rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn with mscale_all_dim set."""
    scale = config.qk_head_dim**-0.5
    yarn = config.rope_scaling
    if yarn is not None and yarn.mscale_all_dim:
        m = yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)
        scale *= m * m
    return scale


class RotaryTable:
    """Precomputed cos/sin ``[max_positions, rope_dim]`` in the model dtype, indexed by position."""

    def __init__(self, config: TargetConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        dim = config.qk_rope_head_dim
        inv_freq = yarn_inv_freq(dim, config.rope_theta, config.rope_scaling)  # [dim/2]
        yarn = config.rope_scaling
        mscale = 1.0
        if yarn is not None:
            mscale = yarn_get_mscale(yarn.factor, yarn.mscale) / yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float64)  # [P]
        freqs = torch.outer(t, inv_freq)  # [P, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, dim]
        self.cos = (emb.cos() * mscale).to(dtype=dtype, device=device)  # [P, dim]
        self.sin = (emb.sin() * mscale).to(dtype=dtype, device=device)  # [P, dim]

    def lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin ``[N, dim]`` for int64 positions ``[N]``."""
        return self.cos[positions], self.sin[positions]


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """DeepSeek-V3 rope: de-interleave ``(d/2, 2) -> (2, d/2)`` then standard rotate_half rope.

    ``x`` is ``[..., d]``; ``cos``/``sin`` broadcast against it. The result is in the
    de-interleaved layout, which is what HF caches for k_pe and what the kernels dot with q_pe.
    """
    d = x.shape[-1]
    x = x.unflatten(-1, (d // 2, 2)).transpose(-1, -2).flatten(-2)  # [..., d]
    return x * cos + rotate_half(x) * sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor | None = None) -> Tensor:
    """`apply_rope_interleaved` with per-token ``cos`` / ``sin`` [N, d] for ``x`` [N, d] or [N, heads, d]:
    one Triton launch on CUDA (``kernels.rope``, rounding where the torch expression rounds), the
    torch expression elsewhere. Into ``out`` when given (it may be a slice of a larger tensor)."""
    if x.is_cuda and x.dtype != torch.float64:
        from kernels.rope import rope_interleaved_triton   # here: CPU runs never load triton

        return rope_interleaved_triton(x, cos, sin, out=out)
    per_row = (cos, sin) if x.dim() == 2 else (cos.unsqueeze(1), sin.unsqueeze(1))
    y = apply_rope_interleaved(x, *per_row)
    return y if out is None else out.copy_(y)
