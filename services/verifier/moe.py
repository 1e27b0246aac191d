"""DeepSeek-V3 MoE: sigmoid router with grouped top-k, and a torch reference expert compute.

Why a torch reference: it is the CPU path and the ground truth for the fused INT4 Triton MoE
kernel (``kernels/int4_moe.py``), which ``moe_forward`` uses on CUDA. Where that
kernel will run (CUDA, bf16/fp16, INT4 experts) the experts stay packed: a dense copy would take
four times the packed bytes (about 250 GB for one K2 rank); elsewhere they are dequantised once at
load, and the torch path dequantises a packed expert on use when no dense copy exists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.skinny_gemm import skinny_linear  # x @ w^T: one Triton launch for a few rows on CUDA, torch elsewhere
from kernels.swiglu import silu_mul  # one Triton launch on CUDA, torch elsewhere
from services.common.int4 import Int4Weight, unpack_int4
from services.verifier.config import TargetConfig

__all__ = [
    "Routing",
    "MLPWeights",
    "MoEWeights",
    "select_experts",
    "route",
    "split_bf16",
    "router_partial_logits",
    "ROUTER_K_CHUNKS",
    "uses_router_parts",
    "ROUTER_PARTS",
    "ROUTER_GEMV",
    "mlp_forward",
    "moe_forward",
    "uses_fused_kernel",
]

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
ROUTER_PARTS = 3  # bf16 matrices that sum to a float32 router weight exactly (``split_bf16``)
ROUTER_K_CHUNKS = 4  # the router GEMM's hidden dims in chunks, their sums added in float32 (``router_partial_logits``)
ROUTER_GEMV = True  # CUDA, one token: the float32 router as a GEMV at HBM speed (``kernels.moe_routing.router_gemv``)


@dataclass
class Routing:
    """Per token: the chosen experts and their (normalised, scaled) weights."""

    ids: Tensor  # [N, top_k] int64
    weights: Tensor  # [N, top_k] float32 (float64 for a float64 model)


@dataclass
class MLPWeights:
    """SwiGLU MLP (dense layers and shared experts). Gate and up are stacked, ``[gate; up]``, so one
    GEMM computes both (one launch and one weight stream instead of two); ``gate`` / ``up`` are
    views of the halves."""

    gate_up: Tensor  # [2I, hidden]
    down: Tensor  # [hidden, I]

    @classmethod
    def stack(cls, gate: Tensor, up: Tensor, down: Tensor) -> "MLPWeights":
        """From the checkpoint's three projections (gate and up are copied into one tensor)."""
        return cls(torch.cat([gate, up]), down)

    @property
    def gate(self) -> Tensor:
        return self.gate_up[: self.down.shape[1]]

    @property
    def up(self) -> Tensor:
        return self.gate_up[self.down.shape[1]:]


@dataclass
class MoEWeights:
    """Router + stacked routed experts (dense and/or packed INT4) + shared experts."""

    gate_weight: Tensor  # [E, hidden]
    bias: Tensor  # [E] e_score_correction_bias
    w_gate: Tensor | None  # [E, I, hidden]; None when only the packed experts are kept
    w_up: Tensor | None  # [E, I, hidden]
    w_down: Tensor | None  # [E, hidden, I]
    shared: MLPWeights | None
    int4: dict[str, Int4Weight] | None = None  # packed "gate_proj"/"up_proj"/"down_proj", stacked [E, ...]
    group_size: int = 32
    dtype: torch.dtype = torch.float32  # compute dtype of a dense expert
    # [ROUTER_PARTS * E, hidden] bf16, ``split_bf16(gate_weight)``: on CUDA for bf16 models, where
    # ``route`` computes the float32 logits on the tensor cores from them (16.5 MB more a K2 layer).
    gate_parts: Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_weight.shape[0]

    def expert(self, proj: str, e: int) -> Tensor:
        """Dense ``[out, in]`` weight of one expert: the stacked copy, or dequantised from INT4 now."""
        dense = {"gate_proj": self.w_gate, "up_proj": self.w_up, "down_proj": self.w_down}[proj]
        if dense is not None:
            return dense[e]
        assert self.int4 is not None, "an MoE layer needs dense or packed experts"
        w = self.int4[proj]
        return unpack_int4(w.packed[e], w.scale[e], w.shape, self.group_size, dtype=self.dtype)  # [out, in]

    @classmethod
    def from_checkpoint(
        cls,
        weights: dict[str, Tensor],
        prefix: str,
        config: TargetConfig,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "MoEWeights":
        """Gather ``{prefix}gate``, ``{prefix}experts.{j}.*`` and ``{prefix}shared_experts.*``.

        INT4 experts stay packed; they are also dequantised here, once, into ``dtype`` unless the
        fused kernel will serve them (``uses_fused_kernel``).
        """
        E = config.n_routed_experts or 0
        keep_dense = not uses_fused_kernel(torch.device(device), dtype, config.int4_experts)

        def dense(name: str) -> Tensor:
            return weights[name].to(device=device, dtype=dtype)

        stacked: dict[str, Tensor] = {}
        packed: dict[str, Int4Weight] | None = {} if config.int4_experts else None
        for proj in EXPERT_PROJS:
            names = [f"{prefix}experts.{j}.{proj}" for j in range(E)]
            if config.int4_experts:
                assert config.quantization is not None
                p = torch.stack([weights[f"{n}.weight_packed"] for n in names]).to(device)  # [E, out, in/8]
                s = torch.stack([weights[f"{n}.weight_scale"] for n in names]).to(device)  # [E, out, in/g]
                shape = tuple(int(v) for v in weights[f"{names[0]}.weight_shape"].tolist())
                packed[proj] = Int4Weight(packed=p, scale=s, shape=shape)  # type: ignore[index]
                if keep_dense:
                    stacked[proj] = unpack_int4(p, s, shape, config.quantization.group_size, dtype=dtype)  # [E, out, in]
            else:
                stacked[proj] = torch.stack([dense(f"{n}.weight") for n in names])  # [E, out, in]
        shared = None
        if config.n_shared_experts:
            sp = f"{prefix}shared_experts."
            shared = MLPWeights.stack(dense(f"{sp}gate_proj.weight"), dense(f"{sp}up_proj.weight"),
                                      dense(f"{sp}down_proj.weight"))
        gate_weight = weights[f"{prefix}gate.weight"].to(device=device, dtype=torch.promote_types(dtype, torch.float32))
        return cls(
            gate_weight=gate_weight,
            bias=weights[f"{prefix}gate.e_score_correction_bias"].to(device=device, dtype=torch.promote_types(dtype, torch.float32)),
            w_gate=stacked.get("gate_proj"),
            w_up=stacked.get("up_proj"),
            w_down=stacked.get("down_proj"),
            shared=shared,
            int4=packed,
            group_size=config.quantization.group_size if config.quantization is not None else 32,
            dtype=dtype,
            gate_parts=split_bf16(gate_weight).flatten(0, 1) if uses_router_parts(torch.device(device), dtype) else None,
        )


def uses_router_parts(device: torch.device, dtype: torch.dtype) -> bool:
    """Where ``route`` takes the float32 logits from ``split_bf16`` parts: CUDA (a bf16 GEMM with a
    float32 output is CUDA-only in torch) and a bf16 model (bf16 hidden states are the GEMM's other
    operand as they are)."""
    return device.type == "cuda" and dtype == torch.bfloat16


def split_bf16(w: Tensor, parts: int = ROUTER_PARTS) -> Tensor:
    """``[parts, *w.shape]`` bf16 matrices whose sum is the float32 ``w``: each part is the rest of
    the ones before it, rounded to bf16. Three 8-bit significands hold float32's 24 bits, so for
    three parts the sum is exact (barring parts below bf16's smallest normal, ~1e-38).

    Why: the router's logits must be float32 (a routing decision turns on a near-tie), and cuBLAS
    computes a float32 GEMM on the CUDA cores: 27.6 us a K2 layer at a 17-node tree (two launches),
    82 us at batch 32 (15% of that verify step). A bf16 hidden state times a bf16 part is exact in float32, so
    one tensor-core GEMM over the stacked parts with float32 accumulation gives the float32 logits
    as partial sums (``router_partial_logits``)."""
    rest = w.float()
    out = []
    for _ in range(parts):
        part = rest.to(torch.bfloat16)
        out.append(part)
        rest = rest - part.float()  # exact: the rounding error of a float32 to bf16
    return torch.stack(out)


def router_partial_logits(hidden: Tensor, gate_parts: Tensor, chunks: int = ROUTER_K_CHUNKS) -> Tensor:
    """``[chunks, N, parts * E]`` float32: ``hidden [N, H]`` (bf16) times each bf16 part of the router
    weight (``gate_parts [parts * E, H]``), over each of ``chunks`` slices of the hidden dims: one
    batched GEMM, no copies (strided views). ``select_experts_triton(parts=...)`` adds them up.

    Why chunks: the tensor cores' float32 accumulation over all 7168 dims of a K2 router drifts about
    ten times as far from the float64 logits as cuBLAS's float32 GEMM (1e-5 against 1e-6 of the
    largest logit), and the experts chosen differed from the float64 choice on 23 of 131072 tokens
    against 4. Four chunks, their sums added in float32, bring both back to the float32 GEMM's: 2e-6
    and 5 of 131072 (H200, ``bench/results/router_parts.json``). Off CUDA (tests) the same views run
    a float32 ``bmm``: torch's bf16 GEMM with a float32 output is CUDA-only."""
    N, H = hidden.shape
    if H % (8 * chunks):   # each chunk 16-byte aligned for cuBLAS
        chunks = 1
    x = hidden.contiguous().view(N, chunks, H // chunks).transpose(0, 1)  # [chunks, N, H/chunks]
    w = gate_parts.view(-1, chunks, H // chunks).permute(1, 2, 0)  # [chunks, H/chunks, parts * E]
    if hidden.is_cuda:
        return torch.bmm(x, w, out_dtype=torch.float32)
    return torch.bmm(x.float(), w.float())


def uses_fused_kernel(device: torch.device, dtype: torch.dtype, int4_experts: bool) -> bool:
    """Where ``moe_forward`` runs the fused INT4 kernel by default: CUDA, bf16/fp16, packed experts."""
    return device.type == "cuda" and int4_experts and dtype in (torch.bfloat16, torch.float16)


def fused_config(tokens: int, moe: MoEWeights, config: TargetConfig, routing_groups: int | None) -> Hashable | None:
    """The fused kernel's launch config for ``tokens`` in ``routing_groups`` requests (what
    ``_routed_fused`` launches; Triton compiles a kernel set per config), or None where this MoE
    runs the torch loop, which compiles nothing."""
    if moe.int4 is None or not uses_fused_kernel(moe.int4["gate_proj"].packed.device, moe.dtype, True):
        return None
    from kernels.int4_moe import choose_config

    packed = moe.int4["gate_proj"].packed
    experts, intermediate, _ = packed.shape
    # the table is for the weights' GPU, where fused_int4_moe runs (not the current one)
    with torch.cuda.device(packed.device) if packed.is_cuda else contextlib.nullcontext():
        return choose_config(tokens, experts, moe.int4["gate_proj"].shape[1], intermediate,
                             config.num_experts_per_tok, routing_groups)


def select_experts(
    scores: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> Routing:
    """noaux_tc selection from sigmoid ``scores [N, E]``.

    The bias only steers *which* experts are chosen (load balancing); the weights are the
    unbiased scores. Groups are ranked by the sum of their top-2 biased scores and only the best
    ``topk_group`` groups may contribute experts.
    """
    N, E = scores.shape
    choice = scores + bias.to(scores.dtype)  # [N, E]
    if topk_group >= n_group:   # every group kept (Kimi-K2: one group): the group pass selects nothing
        masked = choice
    else:
        grouped = choice.view(N, n_group, E // n_group)  # [N, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        keep_groups = group_scores.topk(topk_group, dim=-1).indices  # [N, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)  # [N, G]
        expert_mask = group_mask.unsqueeze(-1).expand(N, n_group, E // n_group).reshape(N, E)  # [N, E]
        masked = choice.masked_fill(~expert_mask, float("-inf"))  # [N, E]
    ids = masked.topk(top_k, dim=-1).indices  # [N, k]
    w = scores.gather(1, ids)  # [N, k]
    if top_k > 1 and norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(ids=ids, weights=w * routed_scaling_factor)


def route(hidden: Tensor, moe: MoEWeights, config: TargetConfig, hidden_float32: Tensor | None = None) -> Routing:
    """Router logits in at least float32 (``hidden [N, hidden]``; ``hidden_float32``, when the caller
    has it, is that upcast already), then ``select_experts``: on CUDA in one Triton launch
    (``kernels.moe_routing``), elsewhere the torch expression. With ``moe.gate_parts`` (CUDA, bf16)
    the logits come from one batched bf16 GEMM with a float32 output (``router_partial_logits``); a
    single token on CUDA takes ``router_gemv`` over the float32 weight (``ROUTER_GEMV``)."""
    gemv = ROUTER_GEMV and hidden.is_cuda and hidden.shape[0] == 1 and moe.gate_weight.dtype == torch.float32
    if gemv or (moe.gate_parts is not None and hidden.dtype == torch.bfloat16):
        from kernels.moe_routing import router_gemv, select_experts_triton   # here: CPU runs never load triton

        if gemv:
            partial, parts = router_gemv(hidden, moe.gate_weight), 1  # [splits, 1, E]
        else:
            partial, parts = router_partial_logits(hidden, moe.gate_parts), ROUTER_PARTS  # [chunks, N, parts * E]
        ids, weights = select_experts_triton(partial, moe.bias, config.num_experts_per_tok, config.n_group,
                                             config.topk_group, config.norm_topk_prob,
                                             config.routed_scaling_factor, parts=parts)
        return Routing(ids=ids, weights=weights)
    rdtype = torch.promote_types(hidden.dtype, torch.float32)
    wide = hidden_float32 if hidden_float32 is not None and rdtype == torch.float32 else hidden.to(rdtype)
    logits = wide @ moe.gate_weight.to(rdtype).T  # [N, E]
    if logits.is_cuda and rdtype == torch.float32:
        from kernels.moe_routing import select_experts_triton   # here: CPU runs never load triton

        ids, weights = select_experts_triton(logits, moe.bias, config.num_experts_per_tok, config.n_group,
                                             config.topk_group, config.norm_topk_prob,
                                             config.routed_scaling_factor)
        return Routing(ids=ids, weights=weights)
    return select_experts(
        torch.sigmoid(logits),
        moe.bias,
        config.num_experts_per_tok,
        config.n_group,
        config.topk_group,
        config.norm_topk_prob,
        config.routed_scaling_factor,
    )


def mlp_forward(x: Tensor, w: MLPWeights, add_to: Tensor | None = None) -> Tensor:
    """SwiGLU: down(silu(gate x) * up x); ``x [N, hidden]`` -> ``[N, hidden]``. ``add_to`` (e.g. the
    routed experts' output) is added by the down GEMM itself, in place (``addmm_``: one launch, one
    rounding; ``addmm`` would first copy it into a new tensor) and returned."""
    return _mlp_down(_mlp_act(x, w), w, add_to)


def _mlp_act(x: Tensor, w: MLPWeights) -> Tensor:
    return silu_mul(skinny_linear(x, w.gate_up))  # [N, I]


def _mlp_down(h: Tensor, w: MLPWeights, add_to: Tensor | None) -> Tensor:
    return skinny_linear(h, w.down, add_to=add_to)


SHARED_ON_SIDE_STREAM = True  # CUDA: the shared expert's gate/up and SiLU run beside the routing (``moe_forward``)
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def moe_forward(
    x: Tensor, moe: MoEWeights, config: TargetConfig, fused: bool | None = None, routing_groups: int | None = None,
    x_float32: Tensor | None = None,
) -> Tensor:
    """Shared experts + routed experts.

    Routed experts run in the fused INT4 Triton kernel (``kernels.int4_moe``: each activated
    expert's packed weights read once per step, no host sync, graph-capturable) when ``fused`` is
    true; ``None`` picks it on CUDA for bf16/fp16 models with packed experts. Otherwise the torch
    loop below runs: the CPU path and the reference. ``routing_groups`` (the step's requests)
    steers the kernel's launch choice: a tree's nodes share experts (``choose_config``).
    ``x_float32``: ``x`` upcast, for the float32 router (the norm before it writes one: no cast launch).

    On CUDA the shared expert's gate/up GEMM and SiLU do not wait for the routing: they run on a
    second stream (``SHARED_ON_SIDE_STREAM``; in a CUDA graph, a parallel branch) while the router,
    the selection and the routed experts run on this one, whose small launches at decode sizes
    leave most SMs idle. The shared down GEMM then adds into the routed output, as without it:
    the same kernels on the same inputs, so the same bits. Memory: every side-stream segment
    starts by waiting for this stream, so a block freed by one (the activation, read here after
    the join) is reused by the next only after this stream is done with it.
    """
    N = x.shape[0]
    side = _side_stream(x.device) if moe.shared is not None and x.is_cuda and SHARED_ON_SIDE_STREAM else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            h_shared = _mlp_act(x, moe.shared)
    routing = route(x, moe, config, x_float32)
    if fused is None:
        fused = uses_fused_kernel(x.device, x.dtype, moe.int4 is not None)
    out = _routed_fused(x, moe, config, routing, routing_groups) if fused else _routed_torch(x, moe, routing)
    if side is not None:
        torch.cuda.current_stream(x.device).wait_stream(side)
        out = _mlp_down(h_shared, moe.shared, add_to=out)
    elif moe.shared is not None:
        out = mlp_forward(x, moe.shared, add_to=out)
    assert out.shape[0] == N
    return out


def _routed_fused(
    x: Tensor, moe: MoEWeights, config: TargetConfig, routing: Routing, routing_groups: int | None = None
) -> Tensor:
    """Routed experts through the fused INT4 kernel (imported here: CPU runs never load triton)."""
    from kernels.int4_moe import fused_int4_moe

    assert moe.int4 is not None and config.quantization is not None, "the fused MoE needs packed INT4 experts"
    return fused_int4_moe(
        x.contiguous(),
        moe.int4["gate_proj"],
        moe.int4["up_proj"],
        moe.int4["down_proj"],
        routing.ids,
        routing.weights.float(),
        group_size=config.quantization.group_size,
        routing_groups=routing_groups,
    )


def _routed_torch(x: Tensor, moe: MoEWeights, routing: Routing) -> Tensor:
    """Loop over experts, tokens grouped per expert (host sync: the CPU path and the reference)."""
    k = routing.ids.shape[1]
    flat_ids = routing.ids.flatten()  # [N*k]
    flat_w = routing.weights.flatten().to(x.dtype)  # [N*k]
    order = torch.argsort(flat_ids, stable=True)  # [N*k]
    counts = torch.bincount(flat_ids, minlength=moe.num_experts).tolist()
    out = torch.zeros_like(x)  # [N, hidden]
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start : start + c]  # [c] flat (token, slot) indices
        start += c
        tok = sel // k  # [c]
        xe = x[tok]  # [c, hidden]
        h = F.silu(xe @ moe.expert("gate_proj", e).T) * (xe @ moe.expert("up_proj", e).T)  # [c, I]
        out.index_add_(0, tok, (h @ moe.expert("down_proj", e).T) * flat_w[sel].unsqueeze(-1))  # [c, hidden]
    return out
