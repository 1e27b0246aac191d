"""`kernels.gumbel_sample` (under the interpreter here) against the torch reference,
`services.verifier.sampling.posterior_tokens`: the same kept set a row, the same token a row, rows
of other parameters side by side in one launch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import gumbel_sample as gs
from services.verifier.sampling import (Sampling, _filter_top_k, _filter_top_p, draw_tokens, inverse_temperature,
                                        posterior_tokens, token_keys)

pytestmark = pytest.mark.skipif(gs.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _params(samplings: list[Sampling], vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inv_t = torch.tensor([inverse_temperature(s.temperature) for s in samplings], dtype=torch.float32)
    top_k = torch.tensor([s.top_k if 0 < s.top_k < vocab else 0 for s in samplings], dtype=torch.int32)
    top_p = torch.tensor([s.top_p for s in samplings], dtype=torch.float32)
    return inv_t.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE)


def _check(logits: torch.Tensor, samplings: list[Sampling], seed: int = 0) -> torch.Tensor:
    """Per row: the kernel keeps exactly the reference's tokens and draws the reference's token."""
    keys = torch.from_numpy(token_keys(seed, np.arange(len(samplings))))
    dev = logits.to(DEVICE)
    floors = gs.keep_floors(dev, *_params(samplings, logits.shape[-1])).cpu()
    tokens = gs.gumbel_sample(dev, *_params(samplings, logits.shape[-1]), keys.to(DEVICE)).cpu()
    assert bool(((tokens >= 0) & (tokens < logits.shape[-1])).all())
    for i, s in enumerate(samplings):
        scaled = logits[i:i + 1].float() * inverse_temperature(s.temperature)
        want = _filter_top_p(_filter_top_k(scaled, s.top_k), s.top_p) > float("-inf")
        got = (scaled >= floors[i]) & (scaled > float("-inf"))
        assert torch.equal(got, want), (i, s, int(want.sum()), int(got.sum()))
        assert int(tokens[i]) == int(posterior_tokens(logits[i:i + 1], s, keys[i:i + 1])), (i, s)
    return tokens


SETTINGS = [Sampling(temperature=1.0), Sampling(temperature=0.7, top_p=0.9), Sampling(temperature=0.6, top_k=50),
            Sampling(temperature=1.3, top_k=40, top_p=0.8), Sampling(temperature=0.5, top_k=1),
            Sampling(temperature=2.0, top_p=1e-6), Sampling(temperature=1.0, top_k=100000, top_p=0.95),
            Sampling(temperature=1e-6, top_p=0.5), Sampling(temperature=1e4, top_k=7, top_p=0.3)]


@pytest.mark.parametrize("vocab", [1, 37, gs.SEARCH_BLOCK, 5000])
def test_mixed_rows_match_the_reference(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(len(SETTINGS), vocab, generator=gen) * 4
    _check(logits, SETTINGS, seed=vocab)


def test_bf16_rows_full_of_ties_and_masked_tokens() -> None:
    """bf16 logits repeat values (ties at every threshold), -inf tokens stay out."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(len(SETTINGS), 3000, generator=gen) * 2).to(torch.bfloat16)
    logits[:, :40] = float("-inf")
    logits[2, 1000:1200] = logits[2].float().topk(50).values[-1]   # the 50th value, 200 more times
    _check(logits, SETTINGS, seed=2)


def test_thresholds_inside_tie_groups_keep_the_whole_group() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.1, 0.4, 0.1] + [0.0] * 60]))[:, :64].clamp(min=-30)
    logits = logits.repeat(2, 1)
    samplings = [Sampling(temperature=1.0, top_p=0.3), Sampling(temperature=1.0, top_k=3)]
    floors = gs.keep_floors(logits.to(DEVICE), *_params(samplings, 64)).cpu()
    assert (logits[0] >= floors[0]).nonzero().flatten().tolist() == [0, 2]           # 0.4 reaches 0.3; its twin stays
    assert (logits[1] >= floors[1]).nonzero().flatten().tolist() == [0, 1, 2, 3]     # the third is tied with the fourth
    _check(logits, samplings)


def test_top_p_at_kimi_k2s_vocabulary_keeps_the_float64_set_in_kernel_and_reference() -> None:
    """163840 tokens, thousands kept under top-p 0.95: the reference's float32 running sum drifted by
    ~2e-5 of the mass and kept 3 tokens fewer than the exact set in every such row, so the kernel
    parted from it in every row of the GPU check. The kernel sums in float32 too, blockwise: the
    interpreter's keeps the exact set; a GPU's may part by a boundary token (a few rows in 129)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 163840, generator=g) * 3.0
    sampling = Sampling(temperature=0.9, top_p=0.95)
    scaled = logits * inverse_temperature(sampling.temperature)
    exact = scaled.double()
    ranked = torch.sort(exact, dim=-1, descending=True).values
    before = torch.cumsum(torch.softmax(ranked, dim=-1), dim=-1)[..., :-1]
    want = exact >= ranked.gather(-1, 1 + (before < sampling.top_p).sum(-1, keepdim=True) - 1)
    assert 1000 < int(want.sum()) < 163840
    assert torch.equal(_filter_top_p(scaled, sampling.top_p) > float("-inf"), want)
    floors = gs.keep_floors(logits.to(DEVICE), *_params([sampling], 163840)).cpu()
    got = scaled >= floors[:, None]
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:   # float32 sums in the GPU's order: the top-p rule kept to within their rounding
        prob = torch.softmax(exact, dim=-1)
        above, at = float((prob * (scaled > floors[:, None])).sum()), float((prob * got).sum())
        assert above < sampling.top_p + 5e-6 and at >= sampling.top_p - 5e-6, (above, at)


def test_rows_of_non_negative_logits_keep_and_draw_the_reference_tokens() -> None:
    """Rows whose minimum is exactly +0.0 (its key must not wrap to the top of the order), and rows
    within [1, 1.25) (a search range of ~2e6 keys, whose last passes narrow to two keys, the lower
    of which must still be tested): each row keeps exactly the reference's set and draws its token."""
    g = torch.Generator().manual_seed(12)
    settings = [Sampling(temperature=1.0, top_k=k, top_p=p) for k in (0, 3, 17, 60) for p in (1.0, 0.9, 0.5)]
    settings = [s for s in settings if s.top_k or s.top_p < 1.0] * 2
    logits = torch.randn(len(settings), 300, generator=g) * 3
    logits = logits - logits.min(-1, keepdim=True).values
    half = len(settings) // 2
    logits[half:] = 1 + 0.25 * torch.rand(len(settings) - half, 300, generator=g)
    _check(logits, settings, seed=3)


@pytest.mark.parametrize("scale", [1e18, 1e30])
def test_huge_tied_logits_are_drawn_by_the_noise_not_by_their_id(scale: float) -> None:
    """Ten tokens tie at a logit where float64's spacing passes the noise's spread (from ~1e16): each
    is a tenth of the law, so 160 keys draw several of them, in kernel and reference alike (the noise
    added to the bare logit was rounded away and every key drew the lowest id)."""
    g = torch.Generator().manual_seed(8)
    row = torch.randn(1, 300, generator=g) * scale * 1e-3
    row[0, 40:50] = scale
    logits = row.expand(160, -1).contiguous()
    tokens = _check(logits, [Sampling(temperature=1.0), Sampling(temperature=0.8, top_p=0.9)] * 80, seed=11)
    assert set(tokens.tolist()) <= set(range(40, 50))
    assert len(set(tokens.tolist())) >= 6


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's -inf - -inf
def test_a_top_k_reaching_a_tie_at_the_row_minimum_keeps_the_tie() -> None:
    """The k-th value is the row's smallest (tied 60 times): every token is kept, as the reference
    keeps ties; and a row of no finite logit gets a NaN floor (``keep_floors``' contract)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.full((3, 64), -30.0)
    logits[:, :4] = torch.randn(3, 4, generator=g)
    samplings = [Sampling(temperature=1.0, top_k=10), Sampling(temperature=0.7, top_k=10, top_p=0.999),
                 Sampling(temperature=1.0, top_k=5)]
    _check(logits, samplings, seed=1)
    floors = gs.keep_floors(logits.to(DEVICE), *_params(samplings, 64)).cpu()
    assert bool((logits[0] >= floors[0]).all())   # all 64 kept
    none = [Sampling(temperature=1.0), Sampling(temperature=1.0, top_p=0.9)]
    dead = torch.full((2, 64), float("-inf"))
    assert torch.isnan(gs.keep_floors(dead.to(DEVICE), *_params(none, 64)).cpu()).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's inf - inf
def test_rows_holding_nan_or_inf_draw_minus_one_and_leave_the_others() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 500, generator=gen)
    logits[1, 7] = float("nan")
    logits[2, 300] = float("inf")
    logits[3, :] = float("-inf")
    samplings = [Sampling(temperature=0.9, top_p=0.9)] * 4
    keys = torch.from_numpy(token_keys(5, np.arange(4)))
    tokens = gs.gumbel_sample(logits.to(DEVICE), *_params(samplings, 500), keys.to(DEVICE)).cpu()
    assert tokens[1:].tolist() == [-1, -1, -1]
    assert int(tokens[0]) == int(posterior_tokens(logits[:1], samplings[0], keys[:1]))


def test_many_keys_draw_the_reference_tokens() -> None:
    """Unfiltered rows at T = 1: each draw is decided by the noise, so 128 keys over one row pin
    the kernel's hash and logs to the reference's (whose distribution `test_acceptance` checks)."""
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(4)).expand(128, -1).contiguous()
    tokens = _check(logits, [Sampling(temperature=1.0)] * 128, seed=9)
    assert len(set(tokens.tolist())) > 20


@pytest.mark.parametrize("kernel", [False, True])
def test_draw_tokens_is_the_reference_request_by_request(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's entry point, on its reference path and (forced here, as on a GPU) its kernel
    path: requests of other parameters and row counts, a request of non-finite logits marked -1
    beside the others, and its refusals."""
    from services.verifier import sampling

    monkeypatch.setattr(sampling, "gumbel_sample_runs", lambda logits: kernel)
    gen = torch.Generator().manual_seed(6)
    samplings, counts = SETTINGS[:4], [3, 1, 5, 2]
    logits = torch.randn(sum(counts), 200, generator=gen)
    keys = torch.from_numpy(token_keys(np.repeat(np.arange(4, dtype=np.uint64) + 11, counts), np.arange(11)))
    got = draw_tokens(logits.to(DEVICE), samplings, counts, keys.to(DEVICE)).cpu()
    at = 0
    for s, n in zip(samplings, counts):
        assert torch.equal(got[at:at + n], posterior_tokens(logits[at:at + n], s, keys[at:at + n]))
        at += n
    assert draw_tokens(logits[:0], [], [], keys[:0]).shape == (0,)
    with pytest.raises(ValueError, match="rows"):
        draw_tokens(logits, samplings, [3, 1, 5, 1], keys)
    with pytest.raises(ValueError, match="3 counts for 4 requests"):
        draw_tokens(logits, samplings, [3, 1, 7], keys)
    with pytest.raises(ValueError, match="greedy"):
        draw_tokens(logits, [Sampling(), *samplings[1:]], counts, keys)
    for bad in (float("nan"), float("inf")):   # row 4: the third request's first; it fails, the others draw
        poisoned = logits.clone()
        poisoned[4, 0] = bad
        drawn = draw_tokens(poisoned.to(DEVICE), samplings, counts, keys.to(DEVICE)).cpu()
        assert torch.equal(drawn[:4], got[:4]) and torch.equal(drawn[9:], got[9:]) and int(drawn[4]) == -1
        # the kernel marks the row, the reference (which raises on the request) all of its rows
        assert torch.equal(drawn[5:9], got[5:9]) if kernel else bool((drawn[4:9] == -1).all())


def test_a_top_p_below_float32_is_refused_and_one_just_under_1_is_off() -> None:
    """top_p is kept as its float32, the value the kernel compares with: 1e-46 was 0 there (every
    token >= 0 kept, or none) while the reference drew greedily; 1 - 1e-9 was 1 there (no cut)
    while the reference cut."""
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=1e-46)
    assert Sampling(temperature=1.0, top_p=1 - 1e-9).top_p == 1.0
    assert Sampling(temperature=1.0, top_p=0.9).top_p == float(np.float32(0.9))


def test_a_zero_top_p_target_searches_to_the_maximum() -> None:
    """The search's answer where even its upper end fails (a top_p of 0 reaching the kernel): the
    row's maximum, greedy, not a threshold of 0.0."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.0], [-3.0, -1.0, -2.0, -5.0, -1.5]])
    dev = logits.to(DEVICE)
    floors = gs.keep_floors(dev, torch.ones(2, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE),
                            torch.zeros(2, device=DEVICE)).cpu()
    assert floors.tolist() == [2.0, -1.0]


def test_row_arguments_are_checked_not_read_past() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 50, generator=gen).to(DEVICE)
    inv_t, top_k, top_p = _params([Sampling(temperature=1.0)] * 4, 50)
    keys = torch.from_numpy(token_keys(1, np.arange(8))).to(DEVICE)
    for bad, match in ((dict(keys=keys[::2]), "keys"), (dict(keys=keys[:3]), "keys"),
                       (dict(keys=keys[:4].to(torch.int32)), "keys"), (dict(top_p=top_p[:2]), "top_p"),
                       (dict(inv_temperature=inv_t.double()), "inv_temperature"), (dict(top_k=top_k.long()), "top_k")):
        args = dict(inv_temperature=inv_t, top_k=top_k, top_p=top_p, keys=keys[:4]) | bad
        with pytest.raises(ValueError, match=match):
            gs.gumbel_sample(logits, **args)
    with pytest.raises(ValueError, match="each row contiguous"):
        gs.gumbel_sample(logits.t().contiguous().t(), inv_t, top_k, top_p, keys[:4])
    one = logits.t().contiguous().t()[:, :1]   # V = 1, strides (1, 4): one token a row is contiguous
    assert gs.gumbel_sample(one, inv_t, top_k, top_p, keys[:4]).tolist() == [0, 0, 0, 0]


_SM90_BUILD = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.gumbel_sample import DRAW_BLOCK, SEARCH_BLOCK, WAYS, _floor_kernel, _gumbel_argmax_kernel

def build(kernel, types, constexprs):
    names = kernel.arg_names
    assert set(types) | set(constexprs) == set(names), f"kernel arguments changed: {names}"
    src = ASTSource(fn=kernel, signature={n: types.get(n, "constexpr") for n in names}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]

rows = dict(x_ptr="*fp32", stride="i32", inv_t_ptr="*fp32", vocab="i32")
floor = build(_floor_kernel, rows | dict(top_k_ptr="*i32", top_p_ptr="*fp32", floor_ptr="*fp32", max_ptr="*fp32"),
              dict(BLOCK=SEARCH_BLOCK, WAYS=WAYS))
draw = build(_gumbel_argmax_kernel, rows | dict(floor_ptr="*fp32", max_ptr="*fp32", key_ptr="*i64", out_ptr="*i64"),
             dict(BLOCK=DRAW_BLOCK, LIBDEVICE=True))
print(json.dumps(dict(floor=len(floor), draw_f64=draw.count(".f64"), approx_log=draw.count("lg2.approx"))))
"""


def test_both_kernels_build_for_hopper() -> None:
    """The interpreter runs Python, not the compiler: both kernels go through Triton's GPU
    pipeline here (control flow on scalars, uint32 hashing, float64 logs from libdevice)."""
    from tests.compiled import run_compiled

    built = run_compiled(["-c", _SM90_BUILD], timeout=300)
    assert built["floor"] > 0 and built["draw_f64"] > 0
    assert built["approx_log"] == 0   # the float64 noise is not the float32 approximation's
