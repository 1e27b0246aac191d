"""DeepSeek-V3 expert selection (noaux_tc) in one Triton launch, from the router's logits.

Why: the torch expression (`services.verifier.moe.select_experts` after a sigmoid) is 8 launches a
MoE layer with one expert group (Kimi-K2) and about 15 with several (DeepSeek-V3, the demo model):
sigmoid, bias, the group pass (top-2 sums, group top-k, mask), top-k, gather, normalise, scale. At
decode and verify batch sizes each of them is a few microseconds of launch for a few hundred bytes
of work, repeated in all 60 MoE layers. One program per token does all of it in registers: it reads
the token's E logits once and writes its top_k ids and weights.

Semantics are `select_experts`'s: scores = sigmoid(logits); choice = scores + bias; groups ranked by
the sum of their two best choices, the best `topk_group` kept; the `top_k` best choices among the
kept groups' experts, best first; weights = their unbiased scores, divided by their sum (plus 1e-20)
when `norm_topk_prob`, times `routed_scaling_factor`. Equal choices go to the lower expert id (torch's
top-k leaves their order open; random logits make them vanishingly rare).

Partial logits: the bf16 router (`services.verifier.moe.router_partial_logits`) computes the float32
logits on the tensor cores as partial sums, ``[chunks, N, parts * E]``: per chunk of the hidden
dims, one column block per bf16 part of the weight (part p in columns ``[p * E, (p + 1) * E)``).
This kernel adds them as it loads them, last part first and chunk by chunk within a part (for three
parts, lo then mid then hi): no launch of its own, and one order on every GPU.

Numerics: the scores are torch's float32 sigmoid bit for bit (IEEE exp and division; the fast
approximations changed a weight's last bit, and through a near-tie a greedy path), so the same
experts are chosen. The weights' sum adds the top_k values in another order than torch's reduction
may; on every point of bench/results/moe_routing.json the weights were still torch's bit for bit.
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

__all__ = ["select_experts_triton", "router_gemv", "ROUTER_GEMV_SPLITS"]


if triton is not None:

    @triton.jit
    def _select_experts_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, stride_c, stride_l, scale,
                               E: tl.constexpr, CHUNKS: tl.constexpr, PARTS: tl.constexpr, GROUP_E: tl.constexpr,
                               TOP_K: tl.constexpr,
                               TOPK_GROUP: tl.constexpr, USE_GROUPS: tl.constexpr, NORM: tl.constexpr,
                               BLOCK_G: tl.constexpr, BLOCK_GE: tl.constexpr, BLOCK_K: tl.constexpr,
                               LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        pdl.grid_sync(PDL)
        g = tl.arange(0, BLOCK_G)[:, None]                         # [G, 1] group
        j = tl.arange(0, BLOCK_GE)[None, :]                        # [1, GE] expert within the group
        e = g * GROUP_E + j                                        # [G, GE] expert id
        valid = (j < GROUP_E) & (e < E)
        x = tl.zeros([BLOCK_G, BLOCK_GE], dtype=tl.float32)
        for p in tl.static_range(1, PARTS + 1):   # smallest part first (module docstring)
            for c in tl.static_range(CHUNKS):
                x += tl.load(logits_ptr + c * stride_c + row * stride_l + (PARTS - p) * E + e, mask=valid,
                             other=0.0).to(tl.float32)
        # torch's sigmoid bit for bit: IEEE exp and divide (the interpreter's numpy exp already is)
        scores = tl.math.div_rn(1.0, 1.0 + (libdevice.exp(-x) if LIBDEVICE else tl.exp(-x)))
        choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        # A NaN (a NaN hidden state) is no choice: tl.max skips it, nothing equalled the maximum, and
        # the pick fell back to expert E, one past every expert's weights and counters.
        choice = tl.where(valid & (choice == choice), choice, float("-inf"))
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
        free = valid   # experts not picked yet: a row of -inf choices still gets TOP_K distinct, real ids
        for t in tl.static_range(TOP_K):
            top = tl.max(tl.max(tl.where(free, choice, float("-inf")), 1), 0)
            pick = tl.min(tl.min(tl.where(free & (choice == top), e, E), 1), 0)
            w = tl.sum(tl.sum(tl.where(valid & (e == pick), scores, 0.0), 1), 0)   # padding aliases ids
            ids = tl.where(slot == t, pick.to(tl.int64), ids)
            weights = tl.where(slot == t, w, weights)
            free = free & (e != pick)
        if NORM:
            weights = tl.math.div_rn(weights, tl.sum(weights, 0) + 1e-20)
        out = row * TOP_K + slot
        tl.store(ids_ptr + out, ids, mask=slot < TOP_K)
        tl.store(weights_ptr + out, weights * scale, mask=slot < TOP_K)


@on_input_device
def select_experts_triton(logits: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int,
                          norm_topk_prob: bool, routed_scaling_factor: float, parts: int = 1) -> tuple[Tensor, Tensor]:
    """Router logits ``[N, E]`` (float32) -> expert ids ``[N, top_k]`` int64 and weights float32.
    Partial logits ``[chunks, N, parts * E]`` (or ``[N, parts * E]``) are added here (module docstring)."""
    if triton is None:
        raise RuntimeError("select_experts_triton needs triton")
    chunked = logits if logits.dim() == 3 else logits.unsqueeze(0)
    if parts < 1 or chunked.dim() != 3 or chunked.shape[2] % parts:
        raise ValueError(f"logits must be [N, {parts} * E] or [chunks, N, {parts} * E], got {tuple(logits.shape)}")
    N, E = chunked.shape[1], chunked.shape[2] // parts
    if bias.shape != (E,):
        raise ValueError(f"bias must be [{E}], got {tuple(bias.shape)}")
    if E % n_group or not 1 <= top_k <= E or not 1 <= topk_group <= n_group:
        raise ValueError(f"cannot pick {top_k} of {E} experts from {topk_group} of {n_group} groups")
    use_groups = topk_group < n_group          # every group kept (Kimi-K2): the group pass selects nothing
    if use_groups and (E // n_group < 2 or topk_group * (E // n_group) < top_k):
        raise ValueError(f"{topk_group} groups of {E // n_group} experts cannot rank by two or hold {top_k}")
    groups, per_group = (n_group, E // n_group) if use_groups else (1, E)
    chunked = chunked if chunked.stride(-1) == 1 else chunked.contiguous()
    ids = torch.empty(N, top_k, dtype=torch.int64, device=chunked.device)
    weights = torch.empty(N, top_k, dtype=torch.float32, device=chunked.device)
    if N:
        block = triton.next_power_of_2(groups) * triton.next_power_of_2(per_group)
        use_pdl = pdl.enabled(chunked.device)
        _select_experts_kernel[(N,)](
            chunked, bias.contiguous(), ids, weights, chunked.stride(0), chunked.stride(1), float(routed_scaling_factor),
            E=E, CHUNKS=chunked.shape[0], PARTS=parts, GROUP_E=per_group, TOP_K=top_k, TOPK_GROUP=topk_group, USE_GROUPS=use_groups,
            NORM=bool(norm_topk_prob and top_k > 1), BLOCK_G=triton.next_power_of_2(groups),
            BLOCK_GE=triton.next_power_of_2(per_group), BLOCK_K=triton.next_power_of_2(top_k),
            LIBDEVICE=not interpreted(), PDL=use_pdl, num_warps=4 if block <= 512 else 8, launch_pdl=use_pdl)
    return ids, weights


if triton is not None:

    @triton.jit
    def _router_gemv_kernel(x_ptr, w_ptr, out_ptr, K, E, stride_we,
                            K_SPLIT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """One token's float32 logits over one slice of the hidden dims: ``out[split, 0, e]``."""
        pdl.grid_sync(PDL)
        pe = tl.program_id(0)
        ps = tl.program_id(1)
        offs_e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
        acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(ps * K_SPLIT, (ps + 1) * K_SPLIT, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs_e[:, None] * stride_we + offs_k[None, :],
                        mask=(offs_e[:, None] < E) & (offs_k[None, :] < K), other=0.0)
            acc += w * x[None, :]
        tl.store(out_ptr + ps * E + offs_e, tl.sum(acc, 1), mask=offs_e < E)


ROUTER_GEMV_SPLITS = 14  # slices of the hidden dims (K2: 7168 = 14 x 512): 12 x 14 = 168 programs
_GEMV_BLOCK_E, _GEMV_BLOCK_K = 32, 256


@on_input_device
def router_gemv(hidden: Tensor, weight: Tensor, splits: int = ROUTER_GEMV_SPLITS) -> Tensor:
    """One token's float32 router logits as ``[splits, 1, E]`` partial sums over slices of the hidden
    dims, for ``select_experts_triton`` to add (``parts=1``): ``hidden [1, H]`` (any float dtype)
    times the float32 ``weight [E, H]``, each product and sum in float32.

    Why: at one token the router is a GEMV that should stream its 11 MB (Kimi-K2) at HBM speed;
    cuBLAS's float32 GEMV and the bf16 parts' GEMM (``services.verifier.moe.router_partial_logits``,
    1.5x the bytes) take 7-9 us a layer for about 3 us of bytes."""
    if triton is None:
        raise RuntimeError("router_gemv needs triton")
    if hidden.dim() != 2 or hidden.shape[0] != 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"router_gemv takes hidden [1, H] and weight [E, H]; got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if weight.dtype != torch.float32 or weight.stride(-1) != 1:
        raise ValueError("router_gemv takes a float32 weight with contiguous rows")
    E, K = weight.shape
    k_split = triton.cdiv(triton.cdiv(K, splits), _GEMV_BLOCK_K) * _GEMV_BLOCK_K
    splits = triton.cdiv(K, k_split)
    out = torch.empty(splits, 1, E, dtype=torch.float32, device=hidden.device)
    x = hidden.contiguous().view(-1)
    use_pdl = pdl.enabled(x.device)
    _router_gemv_kernel[(triton.cdiv(E, _GEMV_BLOCK_E), splits)](
        x, weight, out, K, E, weight.stride(0), K_SPLIT=k_split, BLOCK_E=_GEMV_BLOCK_E, BLOCK_K=_GEMV_BLOCK_K,
        PDL=use_pdl, num_warps=8, launch_pdl=use_pdl)
    return out
