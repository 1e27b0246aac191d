"""kernels/moe_routing.py: the one-launch expert selection (interpreter on the CPU) against
`select_experts`, the torch reference, on random router logits and biases."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_routing import select_experts_triton
from services.verifier.moe import select_experts

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
    ids, weights = select_experts_triton(logits, bias, top_k, groups, topk_group, norm, scale)
    want = select_experts(torch.sigmoid(logits), bias, top_k, groups, topk_group, norm, scale)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want.ids), f"{ids} vs {want.ids}"
    torch.testing.assert_close(weights, want.weights.float(), rtol=2e-6, atol=1e-7)


def test_strided_rows_and_no_tokens():
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 40, generator=g)
    logits, bias = wide[:, 8:24], 0.05 * torch.randn(16, generator=g)   # rows 40 apart
    ids, weights = select_experts_triton(logits, bias, 4, 4, 2, True, 2.5)
    want = select_experts(torch.sigmoid(logits), bias, 4, 4, 2, True, 2.5)
    assert torch.equal(ids, want.ids)
    torch.testing.assert_close(weights, want.weights)
    ids0, w0 = select_experts_triton(torch.empty(0, 16), bias, 4, 4, 2, True, 2.5)
    assert ids0.shape == (0, 4) and w0.shape == (0, 4)


def test_groups_rank_by_their_two_best_and_ties_go_to_the_lower_id():
    # Group 0 holds the single best expert, but group 1's two best sum higher: with one group kept,
    # only group 1's experts may be chosen. Experts 5 and 6 tie: the lower id comes first.
    logits = torch.full((1, 8), -4.0)
    logits[0, 0] = 4.0                    # group 0: 4.0 and -4.0
    logits[0, 5] = logits[0, 6] = 1.0     # group 1 (experts 4..7): 1.0 and 1.0
    ids, _ = select_experts_triton(logits, torch.zeros(8), 2, 2, 1, True, 1.0)
    assert ids.tolist() == [[5, 6]]


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(9), 2, 1, 1), "bias must be"),
    ((torch.zeros(8), 2, 3, 1), "cannot pick"),
    ((torch.zeros(8), 9, 1, 1), "cannot pick"),
    ((torch.zeros(8), 4, 4, 1), "cannot rank by two or hold"),
])
def test_impossible_configs_are_refused(args, match):
    bias, top_k, groups, topk_group = args
    with pytest.raises(ValueError, match=match):
        select_experts_triton(torch.randn(2, 8), bias, top_k, groups, topk_group, True, 1.0)


def test_route_takes_the_float32_upcast_it_is_given():
    # the norm before the MoE hands the router its input upcast already: the same routing
    import json
    from pathlib import Path

    from services.verifier.config import TargetConfig
    from services.verifier.moe import MoEWeights, route

    demo = Path(__file__).resolve().parent.parent / "models" / "demo" / "config.json"
    cfg = TargetConfig.from_hf(json.loads(demo.read_text()))
    g = torch.Generator().manual_seed(8)
    E, hid = cfg.n_routed_experts, cfg.hidden_size
    moe = MoEWeights(gate_weight=torch.randn(E, hid, generator=g) / hid ** 0.5, bias=0.1 * torch.randn(E, generator=g),
                     w_gate=None, w_up=None, w_down=None, shared=None)
    h = torch.randn(5, hid, generator=g).to(torch.bfloat16)
    a, b = route(h, moe, cfg), route(h, moe, cfg, hidden_float32=h.float())
    assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)
    other = route(h, moe, cfg, hidden_float32=-h.float())   # it reads what it is given, not a cast of h
    assert not torch.equal(other.ids, a.ids)
