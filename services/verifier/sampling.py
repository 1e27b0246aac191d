"""Posterior tokens: what the target model would emit at every tree node.

Speculative acceptance compares each node's children against the target's own choice at that
node. At temperature 0 the choice is the argmax (exact greedy decoding). At T > 0 it is a draw
from the filtered target distribution by the Gumbel-max rule, argmax(logits * (1/T) + G), with noise
G keyed to the request's seed, the index in the sequence of the token drawn, and each token id:
every node at one depth of a tree shares it. The accepted path visits one node per depth, so its
tokens are exactly what ordinary sampling with that noise draws one token at a time: lossless,
and a seeded request's tokens depend on its seed, prompt and parameters only, not on its trees
(their budget, shape, the drafter), nor on whether it speculates at all. (Draws from a generator,
one per node, made them depend on the number of nodes drawn before: the same seed gave other
text at another budget.) A token's noise is its own, so logits that move by a rounding (another
batch, another tree size) change the draw only where two tokens nearly tie; an inverse CDF in
vocabulary order, tried first, moved with every earlier token's rounding and parted at the first
sampled token on the GPU in bfloat16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kernels.gumbel_sample import gumbel_sample, gumbel_sample_runs
from services.common.settings import TEMPERATURE_RANGE, temperature_ok

__all__ = ["Sampling", "draw_seed", "draw_tokens", "gumbel_noise", "inverse_temperature", "posterior_tokens",
           "token_keys"]


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling parameters, validated on construction so bad requests fail early.

    temperature: 0 means greedy; > 0 scales logits before softmax.
    top_p: nucleus mass in (0, 1]; 1 disables it. Kept as its float32 (the wire's, and what the
        GPU kernel compares with), so every path filters alike.
    top_k: keep the k most likely tokens; 0 disables it.
    seed: keys the request's draws (None: one drawn at admission); used by the caller.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        lo, hi = TEMPERATURE_RANGE
        if not temperature_ok(self.temperature):  # also NaN
            raise ValueError(f"temperature must be 0 (greedy) or in [{lo:g}, {hi:g}], got {self.temperature}")
        top_p = float(np.float32(self.top_p))
        if not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] as a float32, got {self.top_p}")
        object.__setattr__(self, "top_p", top_p)
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
    """Keep the smallest most-likely set whose mass reaches top_p (the top token always stays), and
    every token tied with its least likely member: a threshold on the logits, as the GPU kernel's."""
    if top_p >= 1.0:
        return logits
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # [n, V]
    # In float64: a float32 running sum over K2's 163840 tokens drifts by ~2e-5 of the mass, which
    # moved the boundary by a few tokens in every row (the GPU kernel's float32 sums, blockwise, part
    # from the float64 set in a few rows of 129: bench/results/sampling-check-acb5f4b.json).
    probs = torch.softmax(sorted_logits.double(), dim=-1)  # [n, V]
    mass_before = torch.cumsum(probs, dim=-1)[..., :-1]  # [n, V - 1]: nondecreasing (a running sum on the CPU)
    kept = 1 + (mass_before < top_p).sum(dim=-1, keepdim=True)  # [n, 1] a prefix of the sorted row
    return logits.masked_fill(logits < sorted_logits.gather(-1, kept - 1), float("-inf"))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M64 = 0xFFFFFFFFFFFFFFFF


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of 64-bit words whose outputs pass as independent."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def token_keys(seeds: int | np.ndarray | list[int], indices: np.ndarray | list[int]) -> np.ndarray:
    """The 64-bit key (as int64) that draws the token at each sequence index of a request seeded
    ``seeds`` (one 64-bit value, or one per index: a step's requests at once, a uint64 array
    taken as it is): splitmix64 of the mixed seed advanced by the index. Counter-based, so a tree's
    nodes, a prompt's first token and an autoregressive step all key the same index alike, and
    every tensor-parallel rank computes the same ones on its host."""
    if not (isinstance(seeds, np.ndarray) and seeds.dtype == np.uint64):
        seeds = np.array([int(x) & _M64 for x in np.atleast_1d(np.asarray(seeds, dtype=object))], dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = _mix64(seeds)
        z = _mix64(key + (np.asarray(indices, dtype=np.int64).astype(np.uint64) + np.uint64(1)) * _GOLDEN)
    return z.view(np.int64)


_M32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of int64 tensors holding 32-bit words. The
    products may pass 2**63 and wrap, as torch's integer arithmetic does on the CPU and the GPU;
    the mask keeps their low 32 bits, which wrapping leaves exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def gumbel_noise(keys: Tensor, vocab: int) -> Tensor:
    """[n, vocab] float64 standard Gumbel noise, a function of each row's key and each token id
    alone: -log(-log(u)) with u from two rounds of ``_mix32`` (the key's low word mixed with the
    token id, then its high word), at 32-bit resolution, (h + 0.5) / 2**32."""
    tokens = torch.arange(vocab, dtype=torch.int64, device=keys.device)  # [V]
    low, high = (keys & _M32)[:, None], ((keys >> 32) & _M32)[:, None]  # [n, 1] each
    h = _mix32(_mix32((tokens * 0x9E3779B9 + low) & _M32) ^ high)  # [n, V]
    u = (h.to(torch.float64) + 0.5) * 2.0 ** -32  # [n, V] in (0, 1)
    return -torch.log(-torch.log(u))


def inverse_temperature(temperature: float) -> float:
    """1 / T rounded to the float32 every path scales logits by: a product, the same bits on the
    CPU, in torch on the GPU and in the kernel (a division there would be approximate or a libdevice
    call). A Python float holding a float32 value: torch multiplies a float32 tensor by it exactly so."""
    return float(np.float32(1.0 / temperature))


def draw_seed() -> int:
    """A seed for a request that set none: its tokens are random, and still drawn by index."""
    return int.from_bytes(np.random.default_rng().bytes(8), "little")


def posterior_tokens(logits: Tensor, sampling: Sampling, keys: Tensor | None) -> Tensor:
    """The target's token at each node.

    Args:
        logits: [n, V] target logits at the tree nodes (any float dtype; math in float32, the
            noise added in float64).
        sampling: the request's parameters.
        keys: [n] int64 on ``logits``' device, each row's (``token_keys`` of the index it draws).
            Ignored when greedy.

    Returns:
        [n] int64 token ids: argmax at T=0, else argmax(logits * (1 / T) - max + G) after top-k then top-p
        filtering (a filtered token is -inf, never drawn), G = ``gumbel_noise(keys)``: a draw
        from softmax(logits / T) over the kept tokens.
    """
    if sampling.greedy:
        return logits.argmax(dim=-1)  # [n]
    if keys is None or keys.shape != logits.shape[:1]:
        raise ValueError(f"sampling needs one key a row: {logits.shape[0]} rows, "
                         f"{None if keys is None else tuple(keys.shape)} keys")
    scaled = logits.float() * inverse_temperature(sampling.temperature)  # [n, V]
    scaled = _filter_top_k(scaled, sampling.top_k)
    scaled = _filter_top_p(scaled, sampling.top_p)
    if not bool(torch.isfinite(scaled.amax(dim=-1)).all()):   # NaN propagates through amax, as +inf does
        raise ValueError("sampling: the target's logits hold NaN or inf")
    # less the row's maximum: beside logits of 1e16 and more, float64 would round the noise away
    centred = scaled.to(torch.float64) - scaled.amax(dim=-1, keepdim=True).to(torch.float64)  # [n, V] <= 0
    return (centred + gumbel_noise(keys, scaled.shape[-1])).argmax(dim=-1)  # [n]


def draw_tokens(logits: Tensor, samplings: Sequence[Sampling], counts: Sequence[int], keys: Tensor) -> Tensor:
    """The posterior tokens of a step's sampled requests at once.

    Args:
        logits: [N, V] the requests' rows, request i's ``counts[i]`` rows in turn.
        samplings: each request's parameters (temperature > 0).
        keys: [N] int64 on ``logits``' device, each row's (``token_keys``).

    Returns:
        [N] int64, as ``posterior_tokens`` request by request, and -1 for the rows of a request
        whose logits hold NaN or inf (on the GPU that row alone; every row of the request where
        the reference raises): the caller fails that request and goes on with the others. On a
        GPU one launch pair draws every row (``kernels.gumbel_sample``: no vocabulary sort, and
        one launch a step, not ten a request); elsewhere the reference runs a request at a time.
    """
    counts = list(counts)
    if any(s.greedy for s in samplings):
        raise ValueError("draw_tokens: greedy requests take the argmax, not a draw")
    if sum(counts) != logits.shape[0] or keys.shape != logits.shape[:1] or len(counts) != len(samplings):
        raise ValueError(f"draw_tokens: {logits.shape[0]} rows, {sum(counts)} counted, {tuple(keys.shape)} keys, "
                         f"{len(counts)} counts for {len(samplings)} requests")
    if not gumbel_sample_runs(logits):
        starts = np.concatenate([[0], np.cumsum(counts)])
        parts = []
        for i, s in enumerate(samplings):
            rows = slice(starts[i], starts[i + 1])
            try:
                parts.append(posterior_tokens(logits[rows], s, keys[rows]))
            except ValueError:   # NaN / inf: every row of the request -1, its request fails alone
                parts.append(torch.full((counts[i],), -1, dtype=torch.int64, device=logits.device))
        return torch.cat(parts) if parts else keys.new_empty(0)
    if not counts:
        return keys.new_empty(0)
    vocab = logits.shape[-1]
    params = [(inverse_temperature(s.temperature), s.top_k if 0 < s.top_k < vocab else 0, s.top_p)
              for s in samplings]
    inv_t, top_k, top_p = (np.repeat(np.array(col, dtype=dtype), counts)
                           for col, dtype in zip(zip(*params), (np.float32, np.int32, np.float32)))
    dev = logits.device
    pin = (lambda t: t.pin_memory()) if logits.is_cuda else (lambda t: t)  # noqa: E731
    return gumbel_sample(logits.contiguous(), *(pin(torch.from_numpy(a)).to(dev, non_blocking=True)
                                                for a in (inv_t, top_k, top_p)), keys)
