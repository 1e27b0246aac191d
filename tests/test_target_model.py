"""TargetModel (absorbed MLA, paged cache, tree masks, sparse MoE) against the float64 reference."""

import copy
import dataclasses
import math
import re
import types
from dataclasses import dataclass

import pytest
import torch

import services.verifier.model as model_mod
from kernels.tree_mla import TreeAttentionMetadata
from services.common.checkpoint import CheckpointError
from services.common.int4 import pack_int4
from services.verifier.config import TargetConfig, YarnScaling
from services.verifier.kv_cache import OutOfPages, PagedKVCache
from services.verifier.make_target import (TINY_TARGET_CONFIG, int4_quantization_config, random_target_weights,
                                           write_random_target)
from services.verifier.model import ForwardBatch, ForwardOutput, TargetModel, expected_tensors
from services.verifier.moe import MoEWeights, moe_forward, select_experts
from services.verifier.reference import ReferenceModel
from services.verifier.rope import (RotaryTable, apply_rope_interleaved, softmax_scale, yarn_get_mscale,
                                    yarn_inv_freq)

VOCAB = 512
PAGE = 4
RTOL = 1e-4


@dataclass
class Models:
    target: TargetModel
    ref: ReferenceModel


VARIANTS = {
    "int4_qlora": dict(int4=True, overrides={}),
    "bf16_qproj": dict(int4=False, overrides={"q_lora_rank": None, "model_type": "kimi_k2"}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory) -> Models:
    d = tmp_path_factory.mktemp(request.param)
    write_random_target(d, VOCAB, seed=11, **VARIANTS[request.param])
    target = TargetModel.load(d)
    assert target.config.rope_scaling is not None
    assert target.config.int4_experts == VARIANTS[request.param]["int4"]
    return Models(target, ReferenceModel.load(d))


# ----------------------------------------------------------------------------- helpers


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        p = int(parents[i])
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def depths_of(parents: torch.Tensor) -> torch.Tensor:
    d = torch.zeros_like(parents)
    for i in range(1, parents.numel()):
        d[i] = d[parents[i]] + 1
    return d


def random_parents(n: int, g: torch.Generator) -> torch.Tensor:
    parents = torch.full((n,), -1, dtype=torch.int64)
    for i in range(1, n):
        parents[i] = int(torch.randint(0, i, (1,), generator=g))
    return parents


def path_to(parents: torch.Tensor, i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = int(parents[i])
    return path[::-1]


def new_cache(model: TargetModel, pages: int = 48, seed: int = 5) -> PagedKVCache:
    cache = model.new_cache(pages, PAGE, shuffle_seed=seed)
    cache.kv.fill_(float("nan"))  # any read of an unwritten slot poisons the logits
    return cache


@dataclass
class Req:
    rid: str
    tokens: torch.Tensor  # [n]
    parents: torch.Tensor  # [n]; a chain for prefill
    prefix_len: int


def chain(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.numel()) - 1


def run(model: TargetModel, cache: PagedKVCache, reqs: list[Req], feature_layers=()) -> ForwardOutput:
    ids, pos, starts, masks = [], [], [0], []
    for r in reqs:
        ids.append(r.tokens)
        pos.append(r.prefix_len + depths_of(r.parents))
        starts.append(starts[-1] + r.tokens.numel())
        masks.append(ancestor_mask(r.parents))
    meta = TreeAttentionMetadata(
        query_starts=torch.tensor(starts),
        prefix_lens=torch.tensor([r.prefix_len for r in reqs]),
        page_tables=[cache.page_table(r.rid) for r in reqs],
        tree_masks=masks,
    )
    return model(ForwardBatch(torch.cat(ids), torch.cat(pos), meta), cache, feature_layers)


def prefill(model: TargetModel, cache: PagedKVCache, rid: str, tokens: torch.Tensor, extra: int = 32) -> None:
    cache.reserve(rid, tokens.numel() + extra)
    out = run(model, cache, [Req(rid, tokens, chain(tokens), 0)])
    cache.write(rid, 0, out.new_kv)


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rtol * want.abs().max().item(), f"max abs err {err:.3g} vs scale {want.abs().max().item():.3g}"


def rand_tokens(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=g)


# ----------------------------------------------------------------------------- tests


def test_prefill_in_two_chunks_matches_reference(models: Models) -> None:
    g = torch.Generator().manual_seed(0)
    prompt = rand_tokens(13, g)
    cache = new_cache(models.target)
    cache.reserve("a", 13)
    first = run(models.target, cache, [Req("a", prompt[:6], chain(prompt[:6]), 0)])
    before = cache.kv.clone()
    cache.write("a", 0, first.new_kv)
    second = run(models.target, cache, [Req("a", prompt[6:], chain(prompt[6:]), 6)])
    after = cache.kv.clone()
    assert torch.equal(after.isnan(), cache.kv.isnan()) and not torch.equal(before.isnan(), after.isnan())
    want, _ = models.ref.forward(prompt)
    assert_close(torch.cat([first.logits, second.logits]), want)
    assert first.logits.dtype == torch.float32 and first.features.shape == (6, 0)


def test_forward_does_not_write_cache(models: Models) -> None:
    cache = new_cache(models.target)
    prompt = rand_tokens(7, torch.Generator().manual_seed(1))
    cache.reserve("a", 7)
    before = cache.kv.clone()
    run(models.target, cache, [Req("a", prompt, chain(prompt), 0)])
    assert torch.equal(before.isnan(), cache.kv.isnan())


def test_tree_after_prefix_matches_reference_per_path(models: Models) -> None:
    g = torch.Generator().manual_seed(2)
    prefix = rand_tokens(6, g)  # ends mid-page (page size 4): tree positions cross pages
    cache = new_cache(models.target)
    prefill(models.target, cache, "a", prefix)
    n = 14
    parents = random_parents(n, g)
    tokens = rand_tokens(n, g)
    out = run(models.target, cache, [Req("a", tokens, parents, 6)])
    assert int(depths_of(parents).max()) >= 2
    for i in range(n):
        seq = torch.cat([prefix, tokens[path_to(parents, i)]])
        want, _ = models.ref.forward(seq)
        assert_close(out.logits[i], want[-1])
    # Commit the deepest root-to-leaf path from the scratch kv, then decode on top of it.
    leaf = int(depths_of(parents).argmax())
    path = path_to(parents, leaf)
    cache.write("a", 6, out.new_kv[:, path])
    nxt = rand_tokens(1, g)
    step = run(models.target, cache, [Req("a", nxt, chain(nxt), 6 + len(path))])
    want, _ = models.ref.forward(torch.cat([prefix, tokens[path], nxt]))
    assert_close(step.logits[0], want[-1])


def test_batch_equals_each_alone(models: Models) -> None:
    g = torch.Generator().manual_seed(3)
    cache = new_cache(models.target, pages=64)
    reqs = []
    for rid, plen, n in (("a", 3, 5), ("b", 9, 12), ("c", 14, 1)):
        prefill(models.target, cache, rid, rand_tokens(plen, g))
        reqs.append(Req(rid, rand_tokens(n, g), random_parents(n, g), plen))
    together = run(models.target, cache, reqs, feature_layers=[1])
    alone = [run(models.target, cache, [r], feature_layers=[1]) for r in reqs]
    assert_close(together.logits, torch.cat([o.logits for o in alone]), rtol=1e-5)
    assert_close(together.features, torch.cat([o.features for o in alone]), rtol=1e-5)
    assert_close(together.new_kv, torch.cat([o.new_kv for o in alone], dim=1), rtol=1e-5)


def test_moe_layers_learn_the_steps_requests(models: Models, monkeypatch) -> None:
    """The MoE layers get the step's request count (``routing_groups``): the fused kernel's launch
    choice depends on it, because the nodes of one tree share experts."""

    seen: list[int | None] = []
    real = model_mod.moe_forward

    def spy(*args, routing_groups=None, **kwargs):
        seen.append(routing_groups)
        return real(*args, routing_groups=routing_groups, **kwargs)

    monkeypatch.setattr(model_mod, "moe_forward", spy)
    g = torch.Generator().manual_seed(4)
    cache = new_cache(models.target, pages=64)
    reqs = []
    for rid, plen, n in (("a", 3, 5), ("b", 9, 2)):
        prefill(models.target, cache, rid, rand_tokens(plen, g))
        reqs.append(Req(rid, rand_tokens(n, g), random_parents(n, g), plen))
    seen.clear()
    run(models.target, cache, reqs)
    moe_layers = sum(layer.moe is not None for layer in models.target.layers)
    assert moe_layers > 0 and seen == [2] * moe_layers


def test_features_are_hf_hidden_states(models: Models) -> None:
    prompt = rand_tokens(9, torch.Generator().manual_seed(4))
    cache = new_cache(models.target)
    cache.reserve("a", 9)
    layers = [2, 0, 1]
    out = run(models.target, cache, [Req("a", prompt, chain(prompt), 0)], feature_layers=layers)
    _, hidden = models.ref.forward(prompt)
    hid = models.target.config.hidden_size
    assert out.features.shape == (9, len(layers) * hid)
    for k, i in enumerate(layers):
        assert_close(out.features[:, k * hid : (k + 1) * hid], hidden[i + 1])


def test_greedy_matches_reference(models: Models) -> None:
    g = torch.Generator().manual_seed(5)
    for p in range(3):
        prompt = rand_tokens(5 + 3 * p, g)
        want = models.ref.greedy(prompt.tolist(), 30)
        cache = new_cache(models.target)
        cache.reserve("a", prompt.numel() + 31)
        out = run(models.target, cache, [Req("a", prompt, chain(prompt), 0)])
        cache.write("a", 0, out.new_kv)
        got, length = [], prompt.numel()
        tok = int(out.logits[-1].argmax())
        for _ in range(30):
            got.append(tok)
            step = run(models.target, cache, [Req("a", torch.tensor([tok]), torch.tensor([-1]), length)])
            cache.write("a", length, step.new_kv)
            length += 1
            tok = int(step.logits[-1].argmax())
        assert got == want


# ----------------------------------------------------------------------------- router, cache


def test_router_grouped_topk_hand_computed() -> None:
    # 8 experts in 4 groups of 2. Group scores (top-2 sums): g0 .9, g1 .98, g2 1.05, g3 .2.
    # topk_group=2 keeps g1, g2 -> expert 0 (the single best score) is excluded with its group.
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.48, 0.6, 0.45, 0.1, 0.1]] * 2)
    bias = torch.zeros(8)
    r = select_experts(scores, bias, top_k=2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    assert sorted(r.ids[0].tolist()) == [2, 4]
    w = dict(zip(r.ids[0].tolist(), r.weights[0].tolist()))
    assert w[4] == pytest.approx(0.6 / 1.1 * 2.5) and w[2] == pytest.approx(0.5 / 1.1 * 2.5)
    # The bias steers the choice (g3 now best, expert 7 chosen) but the weights stay unbiased.
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1.0])
    r = select_experts(scores, bias, top_k=2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    w = dict(zip(r.ids[0].tolist(), r.weights[0].tolist()))
    assert sorted(w) == [4, 7]
    assert w[7] == pytest.approx(0.1 / 0.7 * 2.5) and w[4] == pytest.approx(0.6 / 0.7 * 2.5)
    r = select_experts(scores, torch.zeros(8), top_k=2, n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.5)
    assert sorted(r.weights[0].tolist()) == pytest.approx([0.5 * 2.5, 0.6 * 2.5])


def test_experts_of_dropped_groups_never_win_under_a_negative_bias() -> None:
    """The group pass masks the dropped groups' experts with -inf: with 0 (the tests' biases kept
    every biased score positive) a negative correction bias let them beat the kept ones."""
    g = torch.Generator().manual_seed(0)
    scores, bias = torch.rand(16, 16, generator=g), torch.full((16,), -2.0)
    r = select_experts(scores, bias, top_k=4, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.0)
    kept = (scores + bias).view(16, 4, 4).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    for row in range(16):
        assert set((r.ids[row] // 4).tolist()) <= set(kept[row].tolist())


def test_the_router_stays_float32_in_a_bf16_model() -> None:
    """Its weight and correction bias as stored (float32), not rounded to the model's dtype: near
    ties would otherwise go to other experts than the float32 reference's."""

    E, H, I = 4, 16, 8
    cfg = types.SimpleNamespace(n_routed_experts=E, int4_experts=False, quantization=None, n_shared_experts=0)
    g = torch.Generator().manual_seed(0)
    w = {f"m.experts.{j}.{p}.weight": torch.randn((H, I) if p == "down_proj" else (I, H), generator=g)
         for j in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    w["m.gate.weight"] = torch.randn(E, H, generator=g) * (1 + 1e-3)   # not representable in bf16
    w["m.gate.e_score_correction_bias"] = torch.randn(E, generator=g) * (1 + 1e-3)
    moe = MoEWeights.from_checkpoint(w, "m.", cfg, torch.bfloat16, "cpu")
    assert moe.gate_weight.dtype == torch.float32 and torch.equal(moe.gate_weight, w["m.gate.weight"])
    assert moe.bias.dtype == torch.float32 and torch.equal(moe.bias, w["m.gate.e_score_correction_bias"])
    assert moe.w_gate.dtype == torch.bfloat16   # the experts in the model's dtype


def test_router_with_every_group_kept_is_plain_topk() -> None:
    """K2's router (one group, or topk_group == n_group) skips the group pass; same choice as
    running it."""
    g = torch.Generator().manual_seed(4)
    scores, bias = torch.rand(7, 16, generator=g), 0.1 * torch.randn(16, generator=g)
    for n_group in (1, 4):
        fast = select_experts(scores, bias, top_k=3, n_group=n_group, topk_group=n_group, norm_topk_prob=True,
                              routed_scaling_factor=2.0)
        want = (scores + bias).topk(3, dim=-1).indices
        assert torch.equal(fast.ids, want)
        w = scores.gather(1, want)
        torch.testing.assert_close(fast.weights, w / w.sum(-1, keepdim=True) * 2.0)


def test_paged_cache_reserve_free_write() -> None:
    cache = PagedKVCache(2, 5, 4, 3, torch.float32, "cpu", shuffle_seed=0)
    cache.reserve("a", 9)  # 3 pages
    assert cache.pages_free == 2 and cache.capacity_tokens == 20
    with pytest.raises(OutOfPages):
        cache.reserve("b", 12)
    assert cache.pages_free == 2 and cache.page_table("b").numel() == 0  # nothing changed
    cache.reserve("a", 12)  # same 3 pages cover 12
    assert cache.pages_free == 2
    kv = torch.arange(2 * 9 * 3, dtype=torch.float32).view(2, 9, 3)
    cache.write("a", 0, kv[:, :5])
    cache.write("a", 5, kv[:, 5:])
    assert torch.equal(cache.gather(1, "a", 9), kv[1])
    with pytest.raises(IndexError):
        cache.write("a", 10, kv[:, :3])
    cache.free("a")
    cache.free("a")
    assert cache.pages_free == 5


def test_rope_interleaved_layout_and_yarn() -> None:
    # d=4, position p: HF de-interleaves [a, b, c, d] -> [a, c, b, d] and pairs (a, b) at freq0, (c, d) at freq1.
    a, b, c, d = 0.3, -1.1, 0.7, 2.0
    inv = yarn_inv_freq(4, 10000.0, None)  # [1, 0.01]
    p = 5.0
    th0, th1 = p * inv[0].item(), p * inv[1].item()
    cos = torch.tensor([th0, th1, th0, th1], dtype=torch.float64).cos()
    sin = torch.tensor([th0, th1, th0, th1], dtype=torch.float64).sin()
    got = apply_rope_interleaved(torch.tensor([a, b, c, d], dtype=torch.float64), cos, sin)
    c0, s0, c1, s1 = cos[0].item(), sin[0].item(), cos[1].item(), sin[1].item()
    want = [a * c0 - b * s0, c * c1 - d * s1, b * c0 + a * s0, d * c1 + c * s1]
    assert got.tolist() == pytest.approx(want)
    # Yarn with the tiny config: ramp from dim index 0 (pure extrapolation) to 4.. (pure interpolation / factor).
    yarn = YarnScaling(factor=4.0, original_max_position_embeddings=256, beta_fast=32, beta_slow=1, mscale=1, mscale_all_dim=1)
    plain = yarn_inv_freq(16, 10000.0, None)
    scaled = yarn_inv_freq(16, 10000.0, yarn)
    assert scaled[0].item() == pytest.approx(plain[0].item())
    assert torch.allclose(scaled[4:], plain[4:] / 4)
    assert bool(((scaled[1:4] < plain[1:4]) & (scaled[1:4] > plain[1:4] / 4)).all())


def _k2_yarn(mscale_all_dim: float = 1.0):
    return YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                       mscale=1.0, mscale_all_dim=mscale_all_dim)


def test_yarn_at_the_k2_config_ramps_over_dims_8_to_20() -> None:
    """DeepSeek-V3's `yarn_find_correction_range(32, 1, 64, 50000, 4096)` is (8, 20). The tiny
    config's ramp (0 to 4) came out the same under a wrong rotation count; K2's did not."""

    plain = yarn_inv_freq(64, 50000.0, None)
    scaled = yarn_inv_freq(64, 50000.0, _k2_yarn())
    assert torch.equal(scaled[:9], plain[:9])
    torch.testing.assert_close(scaled[20:], plain[20:] / 32, rtol=1e-12, atol=0)
    assert bool(((scaled[9:20] < plain[9:20]) & (scaled[9:20] > plain[9:20] / 32)).all())
    # A ramp of no width (both betas round to one dim) is a step, not 0 / 0.
    step = YarnScaling(factor=4.0, original_max_position_embeddings=4096, beta_fast=1, beta_slow=1.1)
    assert torch.isfinite(yarn_inv_freq(64, 50000.0, step)).all()


@pytest.mark.parametrize("mscale_all_dim, want", [(1.0, 1.0), (0.0, 0.1 * math.log(32.0) + 1.0)])
def test_the_rotary_tables_scale_is_the_ratio_of_the_two_mscales(mscale_all_dim, want) -> None:
    """cos at position 0 is the table's scale: mscale(factor, mscale) / mscale(factor, mscale_all_dim),
    1 for K2 (both 1). The verifier and the float64 reference share this table, so comparing them
    could not see a wrong one (without the division, every rope logit of K2 1.8x too large)."""

    cfg = types.SimpleNamespace(qk_rope_head_dim=64, rope_theta=50000.0, rope_scaling=_k2_yarn(mscale_all_dim),
                                max_position_embeddings=16)
    table = RotaryTable(cfg, torch.float64, "cpu")
    assert torch.allclose(table.cos[0], torch.full((64,), want, dtype=torch.float64))
    assert torch.equal(table.sin[0], torch.zeros(64, dtype=torch.float64))
    assert yarn_get_mscale(40.0, 0.707) == pytest.approx(0.1 * 0.707 * math.log(40.0) + 1.0)


def test_softmax_scale_uses_mscale_all_dim(models: Models) -> None:
    want = 32**-0.5 * (0.1 * math.log(4.0) + 1.0) ** 2
    assert softmax_scale(models.target.config) == pytest.approx(want)


def _prefill(model: TargetModel, n: int = 9, seed: int = 0) -> tuple[torch.Tensor, ForwardOutput]:
    """One request's prompt of ``n`` random tokens through the model, on a cache of its own."""
    tokens = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    cache = new_cache(model)
    cache.reserve("a", n)
    return tokens, run(model, cache, [Req("a", tokens, chain(tokens), 0)])


def test_a_bf16_models_logits_are_float32(tmp_path) -> None:
    """Sampling and the greedy argmax read the logits: in bf16, near-ties went otherwise than HF's."""
    write_random_target(tmp_path, 512, int4=False, seed=3)
    out32 = _prefill(TargetModel.load(tmp_path))[1]
    out16 = _prefill(TargetModel.load(tmp_path, dtype=torch.bfloat16))[1]
    assert out16.logits.dtype == torch.float32 and out16.new_kv.dtype == torch.bfloat16
    assert (out16.logits - out32.logits).abs().max() < 0.1 * out32.logits.abs().max()


def test_distinct_nope_rope_and_v_head_dims_match_the_reference(tmp_path) -> None:
    """Every other test model has nope = rope = v head dims (and real ones nope = v): a weight cut
    at the wrong one of them went unseen."""
    write_random_target(tmp_path, 512, int4=False, seed=5,
                        overrides={"qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 16})
    tokens, out = _prefill(TargetModel.load(tmp_path))
    assert_close(out.logits, ReferenceModel.load(tmp_path).forward(tokens)[0], rtol=1e-4)


# What the float64 reference cannot see: it shares these tables, layouts and routing rules.

def _tiny_config(int4: bool, group_size: int = 32, **overrides) -> TargetConfig:
    hf = copy.deepcopy(TINY_TARGET_CONFIG)
    hf.update(overrides)
    cfg = TargetConfig.from_hf(hf)
    if int4:
        hf["quantization_config"] = int4_quantization_config(cfg, group_size=group_size)
        cfg = TargetConfig.from_hf(hf)
    return cfg


def _hf_yarn_inv_freq(dim: int, base: float, y: YarnScaling) -> torch.Tensor:
    """DeepSeek-V3's HF modeling code (yarn_find_correction_range / yarn_linear_ramp_mask), in float64."""
    def corr_dim(rot: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(y.beta_fast)), 0)
    high = min(math.ceil(corr_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    mask = 1.0 - ramp
    extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    inter = extra / y.factor
    return inter * (1 - mask) + extra * mask


@pytest.mark.parametrize("dim, base, yarn", [
    # fast-rotation bound below dim 0 (short original context): HF clamps low to 0
    (16, 10000.0, YarnScaling(factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1)),
    # slow-rotation bound past the last dim (small base): HF clamps high to dim - 1
    (16, 100.0, YarnScaling(factor=8.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=0.001)),
])
def test_yarn_correction_range_is_clamped_to_the_rope_dims(dim, base, yarn) -> None:
    """yarn_inv_freq equals HF's formula also where the correction range leaves [0, dim - 1]: HF
    clamps ``low`` at 0 and ``high`` at dim - 1. The tiny and K2 configs never reach either clamp
    (and the float64 reference shares ``RotaryTable``), so a dropped or shifted clamp would move the
    ramp (dim 0 no longer pure extrapolation, or a wider ramp) and rotate every rope key/query by a
    slightly different angle, unseen by any model-vs-reference comparison."""
    torch.testing.assert_close(yarn_inv_freq(dim, base, yarn), _hf_yarn_inv_freq(dim, base, yarn), rtol=1e-12, atol=0)


def test_the_rotary_table_covers_every_position_below_max_position_embeddings() -> None:
    """``RotaryTable`` holds ``max_position_embeddings`` rows, row p being cos/sin(p * inv_freq):
    a table one row short would raise (CPU) or read out of bounds (CUDA) for a request that reaches
    the model's last position; the tests' prompts stay far below it."""
    cfg = _tiny_config(int4=False, max_position_embeddings=40)
    table = RotaryTable(cfg, torch.float64, "cpu")
    assert table.cos.shape == (40, cfg.qk_rope_head_dim) == table.sin.shape
    inv = yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = table.lookup(torch.tensor([39, 0]))
    theta = 39.0 * torch.cat([inv, inv])
    torch.testing.assert_close(cos[0], theta.cos(), rtol=0, atol=1e-12)   # tiny config: mscale ratio 1
    torch.testing.assert_close(sin[0], theta.sin(), rtol=0, atol=1e-12)


def test_int4_scale_shape_follows_the_configs_group_size() -> None:
    """``expected_tensors`` derives an INT4 expert's ``weight_scale`` shape from the config's
    ``group_size`` (one scale per group of inputs, as ``pack_int4`` writes it). Every test checkpoint
    uses group size 32, so a hard-coded 32 would pass them all and refuse a valid group-64/128
    checkpoint (or accept a mis-sized scale)."""
    cfg = _tiny_config(int4=True, group_size=64, moe_intermediate_size=64)
    shapes = expected_tensors(cfg)
    hid, I = cfg.hidden_size, cfg.moe_intermediate_size
    for proj, (out_f, in_f) in (("gate_proj", (I, hid)), ("down_proj", (hid, I))):
        q = pack_int4(torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0)), group_size=64)
        assert shapes[f"model.layers.1.mlp.experts.0.{proj}.weight_scale"] == tuple(q.scale.shape) == (out_f, in_f // 64)
        assert shapes[f"model.layers.1.mlp.experts.0.{proj}.weight_packed"] == tuple(q.packed.shape)


def test_constructing_a_target_model_validates_its_weights() -> None:
    """``TargetModel(config, weights)`` (no tensor parallelism) checks the weights against the
    config: without that check a mis-shaped tensor would either crash deep inside a forward or, for
    a shape that still views (kv_b of another head split), serve silently wrong numbers."""
    cfg = _tiny_config(int4=False)
    w = random_target_weights(cfg, seed=1, int4=False)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    w[name] = w[name][:, :-1]   # one latent column short
    with pytest.raises(CheckpointError, match="kv_b_proj"):
        TargetModel(cfg, w)
    for name in ("model.layers.1.mlp.experts.3.down_proj.weight", "model.norm.weight"):   # missing: named, no KeyError
        w = random_target_weights(cfg, seed=1, int4=False)
        del w[name]
        with pytest.raises(CheckpointError, match=rf"^weights: missing tensor {re.escape(name)}$"):
            TargetModel(cfg, w)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_packed_experts_dequantised_on_use_match_the_dense_copies(dtype) -> None:
    """``MoEWeights.expert`` unpacks a packed INT4 expert on use (no dense copy: CUDA bf16 models,
    torch loop) into the layer's compute dtype, giving what the dense copies give. Unpacked in
    another dtype (e.g. the scales' bf16, or float32 in a float64 model) the torch loop would mix
    dtypes (an error) or round the experts differently from the reference."""
    cfg = _tiny_config(int4=True)
    weights = random_target_weights(cfg, seed=2, int4=True)
    moe = MoEWeights.from_checkpoint(weights, "model.layers.1.mlp.", cfg, dtype, "cpu")
    assert moe.w_gate is not None and moe.int4 is not None
    packed_only = dataclasses.replace(moe, w_gate=None, w_up=None, w_down=None)
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = moe_forward(x, moe, cfg, fused=False)
    got = moe_forward(x, packed_only, cfg, fused=False)
    assert got.dtype == dtype
    assert torch.equal(got, want)


def test_one_expert_per_token_keeps_its_score_unnormalised() -> None:
    """HF's noaux_tc gate normalises the chosen weights only when ``top_k > 1``: with one expert per
    token its weight is its sigmoid score times routed_scaling_factor. Normalising there too would
    make every weight exactly the scaling factor (score / score), so the router's confidence no
    longer scales the expert's output."""
    g = torch.Generator().manual_seed(6)
    scores = torch.rand(5, 8, generator=g, dtype=torch.float64)
    r = select_experts(scores, torch.zeros(8), top_k=1, n_group=4, topk_group=2, norm_topk_prob=True,
                       routed_scaling_factor=2.5)
    torch.testing.assert_close(r.weights, scores.gather(1, r.ids) * 2.5, rtol=1e-12, atol=0)


def test_a_bf16_models_features_are_in_the_models_dtype() -> None:
    """The features (layer hidden states for the drafter) come out in the model's dtype, as HF's
    hidden_states do: a float32 buffer would double the bytes every verify step ships to the drafter
    and hand it rows of another dtype than its own bf16 forward produces."""
    cfg = _tiny_config(int4=False, num_hidden_layers=2)
    model = TargetModel(cfg, random_target_weights(cfg, seed=4, int4=False), dtype=torch.bfloat16)
    cache = model.new_cache(4, 4)
    cache.reserve("a", 5)
    meta = TreeAttentionMetadata(query_starts=torch.tensor([0, 5]), prefix_lens=torch.tensor([0]),
                                 page_tables=[cache.page_table("a")], tree_masks=[torch.ones(5, 5, dtype=torch.bool).tril()])
    out = model(ForwardBatch(torch.arange(2, 7), torch.arange(5), meta), cache, feature_layers=(0, 1))
    assert out.features.dtype == torch.bfloat16 and out.features.shape == (5, 2 * cfg.hidden_size)
