"""kernels/moe_routing.py: the one-launch expert selection (interpreter on the CPU) against
`select_experts`, the torch reference, on random router logits and biases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels.moe_routing import router_gemv, select_experts_triton
from services.verifier.config import TargetConfig
from services.verifier.moe import (MoEWeights, route, router_partial_logits, select_experts, split_bf16,
                                   uses_fused_kernel, uses_router_parts)

# The compiled kernel on a GPU, the interpreter on the CPU: inputs made on the CPU go to DEV, results
# come back (CPU tensors on a GPU machine, where nothing interprets, reached no kernel).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def select(logits: torch.Tensor, bias: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    ids, weights = select_experts_triton(logits.to(DEV), bias.to(DEV), *args, **kwargs)
    return ids.cpu(), weights.cpu()


def demo_config() -> TargetConfig:
    """The demo model's router: 16 experts in 4 groups, 2 groups kept, 4 experts a token."""
    return TargetConfig.from_hf(json.loads((Path(__file__).resolve().parent.parent / "models" / "demo"
                                            / "config.json").read_text()))


# name -> (tokens, experts, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
CASES = {
    "kimi_k2_one_group": (5, 384, 1, 1, 8, True, 2.827),
    "deepseek_v3_groups": (4, 64, 8, 4, 8, True, 2.5),
    "demo_model": (7, 16, 4, 2, 4, True, 2.5),
    "odd_group_width_unnormalised": (3, 20, 4, 3, 3, False, 1.0),
    "top1": (6, 12, 3, 1, 1, True, 1.5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_select_experts(name):
    n, e, groups, topk_group, top_k, norm, scale = CASES[name]
    g = torch.Generator().manual_seed(len(name) * 31 + e)
    logits = 2 * torch.randn(n, e, generator=g)
    bias = 0.1 * torch.randn(e, generator=g)
    ids, weights = select(logits, bias, top_k, groups, topk_group, norm, scale)
    want = select_experts(torch.sigmoid(logits), bias, top_k, groups, topk_group, norm, scale)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want.ids), f"{ids} vs {want.ids}"
    torch.testing.assert_close(weights, want.weights.float(), rtol=2e-6, atol=1e-7)


def test_strided_rows_and_no_tokens():
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 40, generator=g)
    logits, bias = wide[:, 8:24], 0.05 * torch.randn(16, generator=g)   # rows 40 apart
    ids, weights = select(logits, bias, 4, 4, 2, True, 2.5)
    want = select_experts(torch.sigmoid(logits), bias, 4, 4, 2, True, 2.5)
    assert torch.equal(ids, want.ids)
    torch.testing.assert_close(weights, want.weights)
    ids0, w0 = select(torch.empty(0, 16), bias, 4, 4, 2, True, 2.5)
    assert ids0.shape == (0, 4) and w0.shape == (0, 4)


@pytest.mark.parametrize("name", ["kimi_k2_one_group", "demo_model", "top1"])
def test_a_token_of_nan_logits_gets_real_distinct_experts_and_leaves_the_others_alone(name):
    """tl.max skips NaN: nothing equalled a NaN row's maximum and every pick fell back to expert E,
    one past the experts' weights and the MoE's counters (a write out of bounds on the GPU, a
    healthy token's slot overwritten). Partly NaN rows too; the other tokens match the reference."""
    n, e, groups, topk_group, top_k, norm, scale = CASES[name]
    g = torch.Generator().manual_seed(e)
    logits = 2 * torch.randn(n, e, generator=g)
    bias = 0.1 * torch.randn(e, generator=g)
    logits[1] = float("nan")
    logits[2, ::2] = float("nan")
    ids, weights = select(logits, bias, top_k, groups, topk_group, norm, scale)
    for row in (1, 2):
        assert ((ids[row] >= 0) & (ids[row] < e)).all() and len(set(ids[row].tolist())) == top_k, ids[row]
    assert not (ids[2] % 2 == 0).any() or top_k > e // 2   # the half that is a number is chosen first
    healthy = [r for r in range(n) if r not in (1, 2)]
    want = select_experts(torch.sigmoid(logits[healthy]), bias, top_k, groups, topk_group, norm, scale)
    assert torch.equal(ids[healthy], want.ids)
    torch.testing.assert_close(weights[healthy], want.weights.float(), rtol=2e-6, atol=1e-7)


def test_a_token_whose_chosen_scores_underflow_to_zero_gets_zero_weights_not_nan():
    """Sigmoid scores that underflow to 0 (router logits below about -104 in float32) normalise to
    zero weights, not 0/0 = NaN, which would poison that token's hidden state."""
    scores = torch.sigmoid(torch.tensor([[-200.0] * 8, [0.5, -1.0, 2.0, 0.0, 1.0, -2.0, 0.3, 0.1]]))
    assert (scores[0] == 0).all()
    r = select_experts(scores, torch.zeros(8), top_k=2, n_group=4, topk_group=2, norm_topk_prob=True,
                       routed_scaling_factor=2.5)
    assert torch.isfinite(r.weights).all() and (r.weights[0] == 0).all()
    assert r.weights[1].sum().item() == pytest.approx(2.5)


def test_groups_rank_by_their_two_best_and_ties_go_to_the_lower_id():
    # Group 0 holds the single best expert, but group 1's two best sum higher: with one group kept,
    # only group 1's experts may be chosen. Experts 5 and 6 tie: the lower id comes first.
    logits = torch.full((1, 8), -4.0)
    logits[0, 0] = 4.0                    # group 0: 4.0 and -4.0
    logits[0, 5] = logits[0, 6] = 1.0     # group 1 (experts 4..7): 1.0 and 1.0
    ids, _ = select(logits, torch.zeros(8), 2, 2, 1, True, 1.0)
    assert ids.tolist() == [[5, 6]]
    # Groups 1 and 2 (of 3) tie on their two best, one group kept: the lower group, as for experts.
    tied = torch.full((1, 12), -4.0)
    tied[0, 4:6] = tied[0, 8:10] = 1.0
    assert select(tied, torch.zeros(12), 2, 3, 1, True, 1.0)[0].tolist() == [[4, 5]]


@pytest.mark.parametrize("e,groups,topk_group,top_k", [
    (8, 4, 2, 4),     # groups of two, the kept groups hold exactly top_k experts
    (8, 8, 8, 3),     # one expert a group, every group kept: no group pass
])
def test_configs_at_the_edge_of_the_checks_are_served(e, groups, topk_group, top_k):
    """The checks refuse what cannot be picked, and nothing more: these configs just pass them."""
    g = torch.Generator().manual_seed(e * groups + top_k)
    logits = 2 * torch.randn(5, e, generator=g)
    bias = 0.1 * torch.randn(e, generator=g)
    ids, weights = select(logits, bias, top_k, groups, topk_group, True, 1.5)
    want = select_experts(torch.sigmoid(logits), bias, top_k, groups, topk_group, True, 1.5)
    assert torch.equal(ids, want.ids)
    torch.testing.assert_close(weights, want.weights.float(), rtol=2e-6, atol=1e-7)


def test_logits_and_bias_of_any_strides_are_read_as_values():
    """Logits with a non-unit expert stride (a transposed view) and a strided bias."""
    g = torch.Generator().manual_seed(11)
    for n, e, groups, topk_group, top_k in ((6, 16, 4, 2, 4), (4, 20, 4, 3, 3)):
        logits = 2 * torch.randn(e, n, generator=g).t()        # [N, E], strides (1, N)
        bias = torch.randn(2 * e, generator=g)[::2]            # [E], stride 2
        ids, weights = select(logits, bias, top_k, groups, topk_group, True, 2.5)
        want = select_experts(torch.sigmoid(logits), bias, top_k, groups, topk_group, True, 2.5)
        assert torch.equal(ids, want.ids)
        torch.testing.assert_close(weights, want.weights.float(), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(9), 2, 1, 1), "bias must be"),
    ((torch.zeros(8), 2, 3, 1), "cannot pick"),
    ((torch.zeros(8), 9, 1, 1), "cannot pick"),
    ((torch.zeros(8), 2, 2, 3), "cannot pick"),   # more groups kept than there are
    ((torch.zeros(8), 2, 2, 0), "cannot pick"),
    ((torch.zeros(8), 4, 4, 1), "cannot rank by two or hold"),
])
def test_impossible_configs_are_refused(args, match):
    bias, top_k, groups, topk_group = args
    with pytest.raises(ValueError, match=match):
        select(torch.randn(2, 8), bias, top_k, groups, topk_group, True, 1.0)


def test_route_takes_the_float32_upcast_it_is_given():
    # the norm before the MoE hands the router its input upcast already: the same routing
    cfg = demo_config()
    g = torch.Generator().manual_seed(8)
    E, hid = cfg.n_routed_experts, cfg.hidden_size
    moe = MoEWeights(gate_weight=torch.randn(E, hid, generator=g) / hid ** 0.5, bias=0.1 * torch.randn(E, generator=g),
                     w_gate=None, w_up=None, w_down=None, shared=None)
    h = torch.randn(5, hid, generator=g).to(torch.bfloat16)
    a, b = route(h, moe, cfg), route(h, moe, cfg, hidden_float32=h.float())
    assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)
    other = route(h, moe, cfg, hidden_float32=-h.float())   # it reads what it is given, not a cast of h
    assert not torch.equal(other.ids, a.ids)


def _float64_routing(h: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor,
                     cfg: TargetConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing in float64, written apart from `route`: sigmoid scores, the biased grouped
    top-k choice (a group ranked by its two best), unbiased weights normalised and scaled."""
    scores = torch.sigmoid(h.double() @ gate.double().T)
    choice = scores + bias.double()
    n, e = choice.shape
    groups = cfg.n_group
    group_scores = choice.view(n, groups, e // groups).topk(2, dim=-1).values.sum(-1)
    keep = group_scores.topk(cfg.topk_group, dim=-1).indices
    mask = torch.zeros(n, groups, dtype=torch.bool).scatter_(1, keep, True).repeat_interleave(e // groups, dim=1)
    ids = choice.masked_fill(~mask, float("-inf")).topk(cfg.num_experts_per_tok, dim=-1).indices
    w = scores.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor


def test_a_bf16_models_router_logits_are_float32_and_match_a_float64_reference():
    """A bf16 model's hidden states route through float32 logits over the float32 router weight:
    the experts chosen and their weights are the float64 reference's (logits in bf16 pick other
    experts on many tokens)."""
    cfg = demo_config()
    g = torch.Generator().manual_seed(5)
    E, hid = cfg.n_routed_experts, cfg.hidden_size
    gate = torch.randn(E, hid, generator=g) / hid ** 0.5
    bias = 0.01 * torch.randn(E, generator=g)
    moe = MoEWeights(gate_weight=gate, bias=bias, w_gate=None, w_up=None, w_down=None, shared=None)
    h = torch.randn(256, hid, generator=g).to(torch.bfloat16)
    r = route(h, moe, cfg)
    want_ids, want_w = _float64_routing(h, gate, bias, cfg)
    assert torch.equal(r.ids.sort(-1).values, want_ids.sort(-1).values)
    got_w = r.weights.double().gather(1, r.ids.argsort(-1))   # in the order of the sorted ids
    torch.testing.assert_close(got_w, want_w.gather(1, want_ids.argsort(-1)), rtol=1e-5, atol=1e-6)


def test_split_bf16_sums_to_the_float32_weight_exactly():
    g = torch.Generator().manual_seed(21)
    w = torch.cat([torch.randn(64, 96, generator=g) * s for s in (1e-12, 1e-3, 1.0, 1e20)])
    parts = split_bf16(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, *w.shape)
    assert torch.equal(parts.double().sum(0), w.double())          # float32's 24 bits in three parts
    assert torch.equal(parts[0], w.to(torch.bfloat16))             # the first part is the plain rounding
    two = split_bf16(w, parts=2)
    assert not torch.equal(two.double().sum(0), w.double())        # two parts hold 16 bits, not 24


@pytest.mark.parametrize("name", ["kimi_k2_one_group", "demo_model"])
def test_partial_logits_are_added_smallest_part_first(name):
    # select_experts_triton(parts=3) reads [N, 3E] partial logits (hi, mid, lo) and adds (lo + mid) + hi

    n, e, groups, topk_group, top_k, norm, scale = CASES[name]
    g = torch.Generator().manual_seed(e)
    hid = 64
    w = torch.randn(e, hid, generator=g) / hid ** 0.5
    x = torch.randn(n, hid, generator=g).to(torch.bfloat16)
    partial = torch.cat([x.float() @ part.float().T for part in split_bf16(w)], dim=1)   # [N, 3E]
    bias = 0.1 * torch.randn(e, generator=g)
    ids, weights = select(partial, bias, top_k, groups, topk_group, norm, scale, parts=3)
    summed = (partial[:, 2 * e:] + partial[:, e:2 * e]) + partial[:, :e]
    want = select_experts(torch.sigmoid(summed), bias, top_k, groups, topk_group, norm, scale)
    assert torch.equal(ids, want.ids)
    torch.testing.assert_close(weights, want.weights.float(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(summed, x.float() @ w.T, rtol=1e-5, atol=1e-5)   # the float32 logits
    with pytest.raises(ValueError, match="logits must be"):
        select(partial[:, 1:], bias, top_k, groups, topk_group, norm, scale, parts=3)


def test_partials_are_added_lo_part_first_then_chunk_by_chunk():
    """The hi part's two chunks cancel (+-1e4): the order the kernel documents (lo, mid, then hi;
    chunk 0 then 1 within a part) rounds the small parts onto hi's grid, where another order would
    keep them exact; the torch sum in that order is the reference."""
    g = torch.Generator().manual_seed(3)
    n, e = 5, 16
    partial = torch.randn(2, n, 3 * e, generator=g)
    big = 1e4 * (1 + torch.rand(n, e, generator=g))
    partial[0, :, :e], partial[1, :, :e] = big, -big
    bias = 0.1 * torch.randn(e, generator=g)
    summed = torch.zeros(n, e)
    for p in (2, 1, 0):
        for c in range(2):
            summed = summed + partial[c, :, p * e:(p + 1) * e]
    for cfg in ((4, 4, 2, True, 2.5), (3, 1, 1, False, 1.0)):
        ids, weights = select(partial, bias, *cfg, parts=3)
        want = select_experts(torch.sigmoid(summed), bias, *cfg)
        assert torch.equal(ids, want.ids)
        torch.testing.assert_close(weights, want.weights.float(), rtol=2e-6, atol=1e-7)


def test_chunked_partial_logits_and_route_with_parts():
    # router_partial_logits: [chunks, N, 3E] over chunks of the hidden dims (float32 bmm off CUDA);
    # the kernel adds part by part (smallest first), chunk by chunk; route uses them for bf16 input
    cfg = demo_config()
    g = torch.Generator().manual_seed(9)
    E, hid = cfg.n_routed_experts, cfg.hidden_size
    w = torch.randn(E, hid, generator=g) / hid ** 0.5
    parts = split_bf16(w).flatten(0, 1)
    x = torch.randn(6, hid, generator=g).to(torch.bfloat16)
    partial = router_partial_logits(x, parts, chunks=4)
    assert partial.shape == (4, 6, 3 * E) and partial.dtype == torch.float32
    c = hid // 4
    for k in range(4):   # chunk k = hidden dims [k c, (k + 1) c) times each part
        torch.testing.assert_close(partial[k], x[:, k * c:(k + 1) * c].float() @ parts[:, k * c:(k + 1) * c].float().T)
    summed = torch.zeros(6, E)
    for p in (2, 1, 0):
        for k in range(4):
            summed = summed + partial[k, :, p * E:(p + 1) * E]
    torch.testing.assert_close(summed, x.float() @ w.T, rtol=1e-5, atol=1e-5)
    bias = 0.1 * torch.randn(E, generator=g)
    sel = (cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    ids, weights = select(partial, bias, *sel, parts=3)
    want = select_experts(torch.sigmoid(summed), bias, *sel)
    assert torch.equal(ids, want.ids)
    torch.testing.assert_close(weights, want.weights.float(), rtol=2e-6, atol=1e-7)
    moe = MoEWeights(gate_weight=w.to(DEV), bias=bias.to(DEV), w_gate=None, w_up=None, w_down=None, shared=None,
                     gate_parts=parts.to(DEV))
    r = route(x.to(DEV), moe, cfg)
    if DEV == "cpu":   # the same float32 products; a GPU's GEMM may sum them in another order
        assert torch.equal(r.ids, ids) and torch.equal(r.weights, weights)
    else:
        assert torch.equal(r.ids.cpu(), ids)
        torch.testing.assert_close(r.weights.cpu(), weights, rtol=1e-5, atol=1e-6)
    odd = router_partial_logits(x[:, :248], parts[:, :248].contiguous(), chunks=4)   # 62 dims a chunk: not 16-byte aligned
    assert odd.shape == (1, 6, 3 * E)


def test_router_parts_only_on_cuda_for_bf16_models():
    assert uses_router_parts(torch.device("cuda"), torch.bfloat16)
    assert not uses_router_parts(torch.device("cuda"), torch.float16)    # fp16 parts lack the range
    assert not uses_router_parts(torch.device("cpu"), torch.bfloat16)    # bf16 GEMM -> float32: CUDA only


def test_the_fused_int4_moe_only_for_packed_experts_of_a_half_precision_cuda_model():
    """A bf16 CUDA model with dense (unquantised) experts runs the torch expert loop: the fused INT4
    kernel would find no packed experts to read."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert uses_fused_kernel(cuda, torch.bfloat16, True) and uses_fused_kernel(cuda, torch.float16, True)
    assert not uses_fused_kernel(cuda, torch.bfloat16, False) and not uses_fused_kernel(cuda, torch.float16, False)
    assert not uses_fused_kernel(cuda, torch.float32, True) and not uses_fused_kernel(cpu, torch.bfloat16, True)


@pytest.mark.parametrize("experts,hidden", [(384, 7168), (20, 300)])
def test_router_gemv_one_token(experts, hidden):
    # one token's float32 logits as partial sums over slices of the hidden dims; the selection adds them

    g = torch.Generator().manual_seed(experts)
    w = torch.randn(experts, hidden, generator=g) / hidden ** 0.5
    x = torch.randn(1, hidden, generator=g).to(torch.bfloat16)
    partial = router_gemv(x.to(DEV), w.to(DEV)).cpu()
    assert partial.dim() == 3 and partial.shape[1:] == (1, experts) and partial.dtype == torch.float32
    exact = x.double() @ w.double().T
    assert ((partial.double().sum(0) - exact).abs().max() / exact.abs().max()).item() < 1e-6
    top_k = 4
    bias = 0.1 * torch.randn(experts, generator=g)
    ids, weights = select(partial, bias, top_k, 1, 1, True, 2.5)
    summed = torch.zeros(1, experts)
    for c in range(partial.shape[0]):
        summed = summed + partial[c]
    want = select_experts(torch.sigmoid(summed), bias, top_k, 1, 1, True, 2.5)
    assert torch.equal(ids, want.ids)
    torch.testing.assert_close(weights, want.weights.float(), rtol=2e-6, atol=1e-7)
    with pytest.raises(ValueError, match="hidden \\[1, H\\]"):
        router_gemv(x.expand(2, hidden), w)
    with pytest.raises(ValueError, match="float32 weight"):
        router_gemv(x, w.half())


def test_router_gemv_reads_only_its_hidden_and_makes_no_empty_slices():
    """hidden [1, 300] as a view of a wider row whose tail is NaN: nothing past H is read (the last
    slice's block runs past it); and 300 dims make two slices of 256, not 14 of which 12 are empty."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(1, 600, generator=g)
    wide[:, 300:] = float("nan")
    hidden = wide.to(DEV)[:, :300]
    w = torch.randn(20, 300, generator=g) / 300 ** 0.5
    partial = router_gemv(hidden, w.to(DEV)).cpu()
    assert torch.isfinite(partial).all()
    exact = wide[:, :300].double() @ w.double().T
    assert ((partial.double().sum(0) - exact).abs().max() / exact.abs().max()).item() < 1e-6
    assert partial.shape[0] == 2 and bool((partial != 0).any(-1).all())
