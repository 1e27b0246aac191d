"""Posterior tokens: what the target model would emit at every tree node.

Speculative acceptance compares each node's children against the target's own choice at that
node. At temperature 0 the choice is the argmax (exact greedy decoding). At T > 0 it is one
independent draw per node from the filtered target distribution; following children that match
those draws reproduces ordinary sampling exactly, so the output distribution is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.common.settings import TEMPERATURE_RANGE, temperature_ok

__all__ = ["Sampling", "posterior_tokens", "request_generator"]


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling parameters, validated on construction so bad requests fail early.

    temperature: 0 means greedy; > 0 scales logits before softmax.
    top_p: nucleus mass in (0, 1]; 1 disables it.
    top_k: keep the k most likely tokens; 0 disables it.
    seed: seeds the request's generator (None: nondeterministic); used by the caller.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        lo, hi = TEMPERATURE_RANGE
        if not temperature_ok(self.temperature):  # also NaN
            raise ValueError(f"temperature must be 0 (greedy) or in [{lo:g}, {hi:g}], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _filter_top_k(logits: Tensor, top_k: int) -> Tensor:
    """Mask everything below the k-th largest logit (ties at the boundary are kept)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = logits.topk(top_k, dim=-1).values[..., -1:]  # [n, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p(logits: Tensor, top_p: float) -> Tensor:
    """Keep the smallest most-likely set whose mass reaches top_p (the top token always stays)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # [n, V]
    probs = torch.softmax(sorted_logits, dim=-1)  # [n, V]
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [n, V]
    drop_sorted = mass_before >= top_p  # [n, V]
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # [n, V]
    return logits.masked_fill(drop, float("-inf"))


def request_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's generator from its 64-bit seed.

    CUDA's generator (Philox) takes all 64 bits; the CPU's (a Mersenne Twister) only the low 32, so
    there seeds that differed only above bit 32 drew the same tokens. On the CPU the high half is
    now mixed into the low one (a seed below 2**32 is used as it is, so its outputs do not change);
    2**64 seeds onto 2**32 states still collide, but not along so plain a pattern.
    """
    gen = torch.Generator(device=device)
    high = seed >> 32
    if gen.device.type == "cpu" and high:
        seed = (seed ^ (high * 0x9E3779B97F4A7C15 >> 32)) & 0xFFFFFFFF
    return gen.manual_seed(seed)


def posterior_tokens(logits: Tensor, sampling: Sampling, generator: torch.Generator | None) -> Tensor:
    """The target's token at each node.

    Args:
        logits: [n, V] target logits at the tree nodes (any float dtype; math in float32).
        sampling: the request's parameters.
        generator: the request's seeded generator (same device as ``logits``), or None for the
            global RNG. Ignored when greedy.

    Returns:
        [n] int64 token ids: argmax at T=0, else one independent draw per node from
        softmax(logits / T) after top-k then top-p filtering.
    """
    if sampling.greedy:
        return logits.argmax(dim=-1)  # [n]
    scaled = logits.float() / sampling.temperature  # [n, V]
    scaled = _filter_top_k(scaled, sampling.top_k)
    scaled = _filter_top_p(scaled, sampling.top_p)
    probs = torch.softmax(scaled, dim=-1)  # [n, V]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [n]
