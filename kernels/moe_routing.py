"""DeepSeek-V3 routing in two Triton launches: the router's logits, then expert selection (noaux_tc).

Why: the torch expression (`services.verifier.moe.select_experts` after a sigmoid) is 8 launches a
MoE layer with one expert group (Kimi-K2) and about 15 with several (DeepSeek-V3, the demo model):
sigmoid, bias, the group pass (top-2 sums, group top-k, mask), top-k, gather, normalise, scale. At
decode and verify batch sizes each of them is a few microseconds of launch for a few hundred bytes
of work, repeated in all 60 MoE layers. One program per token does all of it in registers: it reads
the token's E logits once and writes its top_k ids and weights.

The logits themselves (float32: the hidden state cast up, times the float32 router weight) were a
cast and a cuBLAS float32 GEMM, whose small-M kernels are slow on Hopper (Kimi-K2 rank: 7.4 us at
one token and 13.8 us at a 17-node tree for an 11 MB weight, about 3 us of HBM time).
``router_logits_partials`` reads the bf16 hidden state directly and streams the weight once over
split K ranges; ``select_experts_triton`` adds the splits' partial logits in a fixed order, so the
result is deterministic (no atomics) and one launch covers the cast, the GEMM and its reduction.
Those logits are float32 sums in another order than cuBLAS's: equal to about 1e-6 relative, so the
same experts win except at ties that close.

Semantics are `select_experts`'s: scores = sigmoid(logits); choice = scores + bias; groups ranked by
the sum of their two best choices, the best `topk_group` kept; the `top_k` best choices among the
kept groups' experts, best first; weights = their unbiased scores, divided by their sum (plus 1e-20)
when `norm_topk_prob`, times `routed_scaling_factor`. Equal choices go to the lower expert id (torch's
top-k leaves their order open; random logits make them vanishingly rare).

Numerics: the scores are torch's float32 sigmoid bit for bit (IEEE exp and division; the fast
approximations changed a weight's last bit, and through a near-tie a greedy path), so the same
experts are chosen. The weights' sum adds the top_k values in another order than torch's reduction
may; on every point of bench/results/moe_routing.json the weights were still torch's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.device import interpreted, on_input_device

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - only where triton is not installed
    triton = None
    tl = None

__all__ = ["select_experts_triton", "router_logits_partials", "router_logits_config", "RouterLogitsConfig",
           "ROUTER_PARTIALS_MAX_TOKENS"]

ROUTER_PARTIALS_MAX_TOKENS = 64  # above this the logits take cuBLAS (a GEMM's tiles beat the FMA dot)


if triton is not None:

    @triton.jit
    def _router_logits_kernel(h_ptr, w_ptr, part_ptr, n_tokens, k_dim, k_chunk, stride_h, stride_w, stride_ps,
                              stride_pn, E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        """Partial logits of one K range: ``part[split, tokens, experts] = h[:, range] . w[:, range]``
        in float32 (the IEEE dot: no TF32)."""
        pid_e, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ex = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
        k_lo = split * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, k_dim)
        for k in range(k_lo, k_hi, BLOCK_K):
            kk = k + offs_k
            k_ok = kk < k_hi
            h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + kk[None, :],
                        mask=(rows < n_tokens)[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + ex[:, None].to(tl.int64) * stride_w + kk[None, :],
                        mask=(ex < E)[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
        out = part_ptr + split.to(tl.int64) * stride_ps + rows[:, None].to(tl.int64) * stride_pn + ex[None, :]
        tl.store(out, acc, mask=(rows < n_tokens)[:, None] & (ex < E)[None, :])

    @triton.jit
    def _select_experts_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, stride_s, stride_l, scale,
                               SPLITS: tl.constexpr, E: tl.constexpr, GROUP_E: tl.constexpr, TOP_K: tl.constexpr,
                               TOPK_GROUP: tl.constexpr, USE_GROUPS: tl.constexpr, NORM: tl.constexpr,
                               BLOCK_G: tl.constexpr, BLOCK_GE: tl.constexpr, BLOCK_K: tl.constexpr,
                               LIBDEVICE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, BLOCK_G)[:, None]                         # [G, 1] group
        j = tl.arange(0, BLOCK_GE)[None, :]                        # [1, GE] expert within the group
        e = g * GROUP_E + j                                        # [G, GE] expert id
        valid = (j < GROUP_E) & (e < E)
        x = tl.load(logits_ptr + row * stride_l + e, mask=valid, other=0.0).to(tl.float32)
        for s in tl.static_range(1, SPLITS):  # the partial logits of K ranges, added in order
            x += tl.load(logits_ptr + s * stride_s + row * stride_l + e, mask=valid, other=0.0).to(tl.float32)
        # torch's sigmoid bit for bit: IEEE exp and divide (the interpreter's numpy exp already is)
        scores = tl.math.div_rn(1.0, 1.0 + (libdevice.exp(-x) if LIBDEVICE else tl.exp(-x)))
        choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, choice, float("-inf"))
        if USE_GROUPS:
            # A group's rank is the sum of its two best choices (the best one taken out once).
            best = tl.max(choice, 1)                                                   # [G]
            first = tl.min(tl.where(choice == best[:, None], j, BLOCK_GE), 1)          # [G]
            second = tl.max(tl.where(j == first[:, None], float("-inf"), choice), 1)   # [G]
            gid = tl.arange(0, BLOCK_G)
            rank = tl.where(gid < E // GROUP_E, best + second, float("-inf"))          # [G]
            kept = gid < 0                                                             # [G] all False
            for _ in tl.static_range(TOPK_GROUP):
                top = tl.max(rank, 0)
                pick = tl.min(tl.where(rank == top, gid, BLOCK_G), 0)
                kept = kept | (gid == pick)
                rank = tl.where(gid == pick, float("-inf"), rank)
            choice = tl.where(kept[:, None], choice, float("-inf"))
        slot = tl.arange(0, BLOCK_K)
        ids = tl.zeros([BLOCK_K], dtype=tl.int64)
        weights = tl.zeros([BLOCK_K], dtype=tl.float32)
        for t in tl.static_range(TOP_K):
            top = tl.max(tl.max(choice, 1), 0)
            pick = tl.min(tl.min(tl.where(valid & (choice == top), e, E), 1), 0)
            w = tl.sum(tl.sum(tl.where(valid & (e == pick), scores, 0.0), 1), 0)   # padding aliases ids
            ids = tl.where(slot == t, pick.to(tl.int64), ids)
            weights = tl.where(slot == t, w, weights)
            choice = tl.where(e == pick, float("-inf"), choice)
        if NORM:
            weights = tl.math.div_rn(weights, tl.sum(weights, 0) + 1e-20)
        out = row * TOP_K + slot
        tl.store(ids_ptr + out, ids, mask=slot < TOP_K)
        tl.store(weights_ptr + out, weights * scale, mask=slot < TOP_K)


@on_input_device
def select_experts_triton(logits: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int,
                          norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
    """Router logits ``[N, E]`` (float32), or ``[S, N, E]`` partial logits that add up to them
    (``router_logits_partials``), -> expert ids ``[N, top_k]`` int64 and weights float32."""
    if triton is None:
        raise RuntimeError("select_experts_triton needs triton")
    parts = logits if logits.dim() == 3 else logits.unsqueeze(0)
    S, N, E = parts.shape
    if bias.shape != (E,):
        raise ValueError(f"bias must be [{E}], got {tuple(bias.shape)}")
    if E % n_group or not 1 <= top_k <= E or not 1 <= topk_group <= n_group:
        raise ValueError(f"cannot pick {top_k} of {E} experts from {topk_group} of {n_group} groups")
    use_groups = topk_group < n_group          # every group kept (Kimi-K2): the group pass selects nothing
    if use_groups and (E // n_group < 2 or topk_group * (E // n_group) < top_k):
        raise ValueError(f"{topk_group} groups of {E // n_group} experts cannot rank by two or hold {top_k}")
    groups, per_group = (n_group, E // n_group) if use_groups else (1, E)
    parts = parts if parts.stride(-1) == 1 else parts.contiguous()
    ids = torch.empty(N, top_k, dtype=torch.int64, device=parts.device)
    weights = torch.empty(N, top_k, dtype=torch.float32, device=parts.device)
    if N:
        block = triton.next_power_of_2(groups) * triton.next_power_of_2(per_group)
        _select_experts_kernel[(N,)](
            parts, bias.contiguous(), ids, weights, parts.stride(0), parts.stride(1), float(routed_scaling_factor),
            SPLITS=S, E=E, GROUP_E=per_group, TOP_K=top_k, TOPK_GROUP=topk_group, USE_GROUPS=use_groups,
            NORM=bool(norm_topk_prob and top_k > 1), BLOCK_G=triton.next_power_of_2(groups),
            BLOCK_GE=triton.next_power_of_2(per_group), BLOCK_K=triton.next_power_of_2(top_k),
            LIBDEVICE=not interpreted(), num_warps=4 if block <= 512 else 8)
    return ids, weights


@dataclass(frozen=True)
class RouterLogitsConfig:
    """Launch shape of the partial-logits kernel: a program owns ``block_e`` experts x one K range of
    ``k_chunk`` columns (so ``ceil(K / k_chunk)`` partials), read ``block_k`` columns a step."""

    k_chunk: int = 512
    block_k: int = 256
    block_e: int = 16
    num_warps: int = 4


def router_logits_config(n_tokens: int) -> RouterLogitsConfig:
    """Short K ranges, so that each program makes one or two steps of one wide load and hundreds of
    programs run side by side: at these sizes the loop's load latency, not the bytes, sets the time
    (an 11 MB Kimi-K2 router weight in 1195-wide ranges of 64-wide steps took 47 us at one token)."""
    return RouterLogitsConfig(num_warps=4 if n_tokens <= 16 else 8)


@on_input_device
def router_logits_partials(hidden: Tensor, weight: Tensor, config: RouterLogitsConfig | None = None) -> Tensor:
    """``hidden [N, K] @ weight[E, K]^T`` in float32 as ``[S, N, E]`` partial sums over ``S`` ranges
    of K (``select_experts_triton`` adds them). ``hidden`` in any float dtype (read and cast in
    registers), ``weight`` float32; for ``N <= ROUTER_PARTIALS_MAX_TOKENS``."""
    if triton is None:
        raise RuntimeError("router_logits_partials needs triton")
    N, K = hidden.shape
    E = weight.shape[0]
    if weight.shape != (E, K) or weight.dtype != torch.float32:
        raise ValueError(f"weight must be float32 [E, {K}], got {weight.dtype} {tuple(weight.shape)}")
    if N > ROUTER_PARTIALS_MAX_TOKENS:
        raise ValueError(f"router_logits_partials takes at most {ROUTER_PARTIALS_MAX_TOKENS} tokens, got {N}")
    if hidden.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("hidden and weight need a contiguous last dim")
    cfg = config or router_logits_config(N)
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(K)))
    k_chunk = max(block_k, triton.cdiv(min(cfg.k_chunk, K), block_k) * block_k)
    splits = triton.cdiv(K, k_chunk)
    parts = torch.empty(splits, N, E, dtype=torch.float32, device=hidden.device)
    if N:
        _router_logits_kernel[(triton.cdiv(E, cfg.block_e), splits, 1)](
            hidden, weight, parts, N, K, k_chunk, hidden.stride(0), weight.stride(0), parts.stride(0), parts.stride(1),
            E=E, BLOCK_M=max(16, triton.next_power_of_2(N)), BLOCK_E=cfg.block_e, BLOCK_K=block_k,
            num_warps=cfg.num_warps)
    return parts
