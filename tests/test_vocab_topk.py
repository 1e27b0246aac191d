"""`kernels.vocab_topk`: the top-k log-probs of each row of draft logits, against log_softmax then
topk, under the Triton interpreter (tests/conftest.py) with a small tile so that rows span
several, and with the inputs that take its exact path (more candidates than it keeps)."""

from __future__ import annotations

import pytest
import torch

from kernels import vocab_topk as vt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(vt.triton is None, reason="needs triton")
SMALL = {"tile": 256, "cmax": 256}   # a tile and a candidate list the interpreter runs quickly


def _check(logits: torch.Tensor, k: int, **sizes) -> None:
    """Same values as the reference (float32 rounding), each value its own token's log-prob,
    k distinct tokens, descending, and a true top-k: nothing left out beats the k-th value."""
    lp = torch.full((*logits.shape[:-1], k), float("nan"))   # poisoned: the kernel must write it all
    lp, tok = vt.vocab_topk(logits.to(DEVICE), k, **sizes)
    lp, tok = lp.cpu(), tok.cpu()
    want, _ = vt.vocab_topk_reference(logits, k)
    every = torch.log_softmax(logits.double(), dim=-1)
    assert lp.shape == tok.shape == (*logits.shape[:-1], k) and lp.dtype == torch.float32 and tok.dtype == torch.int64
    assert torch.isfinite(lp).all()
    assert torch.allclose(lp.double(), want.double(), atol=2e-6, rtol=0)
    assert torch.allclose(lp.double(), every.gather(-1, tok), atol=2e-6, rtol=0)
    assert all(len(set(row)) == k for row in tok.reshape(-1, k).tolist())
    assert bool((lp[..., 1:] <= lp[..., :-1]).all())
    kth = logits.float().topk(k, dim=-1).values[..., -1:]
    assert bool((logits.float().gather(-1, tok) >= kth).all())


@needs_kernel
@pytest.mark.parametrize("k", [1, 16, 128])
def test_random_bf16_rows_over_several_tiles(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    _check((torch.randn(2, 3, 1000, generator=gen) * 3).to(torch.bfloat16), k, **SMALL)


@needs_kernel
def test_a_vocabulary_smaller_than_a_tile_and_fp16_with_minus_inf() -> None:
    gen = torch.Generator().manual_seed(1)
    _check(torch.randn(3, 130, generator=gen), 128, **SMALL)
    x = torch.randn(2, 700, generator=gen) * 3
    x[:, ::3] = float("-inf")
    _check(x.half(), 64, **SMALL)


@needs_kernel
def test_the_top_tokens_crowded_into_a_few_groups_take_the_exact_path() -> None:
    """Every element of 40 strided groups beats every other: the k-th group maximum lets ~1000
    candidates through, more than the 256 kept, so the exact threshold picks the tokens."""
    gen = torch.Generator().manual_seed(2)
    vocab, tile = 256 * 30, 256
    x = torch.randn(2, vocab, generator=gen)
    crowded = (torch.arange(vocab) % tile) < 40
    x[:, crowded] += 100.0
    assert int((x[0] >= torch.sort(x[0].view(-1, tile).amax(0), descending=True).values[63]).sum()) > 256
    _check(x, 64, **SMALL)


@needs_kernel
def test_ties_fill_the_top_k_with_the_lowest_token_ids() -> None:
    """A row of equal logits (and one above them): k - 1 tied tokens are as good as any others;
    the kernel takes the lowest ids, deterministically."""
    x = torch.zeros(2, 900, dtype=torch.bfloat16)
    x[0, 700] = 1.0
    lp, tok = vt.vocab_topk(x.to(DEVICE), 16, **SMALL)
    assert tok[0].tolist() == [700, *range(15)] and tok[1].tolist() == list(range(16))
    _check(x, 16, **SMALL)


def test_k_outside_the_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="k must be in 1..100"):
        vt.vocab_topk(torch.randn(2, 100), 101)
    with pytest.raises(ValueError, match="k must be in"):
        vt.vocab_topk(torch.randn(2, 100), 0)


@needs_kernel
def test_nan_counts_as_minus_inf_and_minus_zero_ties_plus_zero() -> None:
    """A NaN logit is a token never chosen (a drafter row gone NaN gives -inf log-probs, so a
    root-only tree, and token ids inside the vocabulary); -0.0 and +0.0 tie (the lower id first)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 1000, generator=gen) * 3
    x[0, ::3] = float("nan")
    x[1] = float("nan")
    x[2] = -float("nan")
    x[3, :5] = torch.tensor([-0.0, 0.0, -0.0, 0.0, -0.0])
    x[3, 5:] = -5.0
    lp, tok = vt.vocab_topk(x.to(DEVICE), 8, **SMALL)
    lp, tok = lp.cpu(), tok.cpu()
    assert bool(((tok >= 0) & (tok < 1000)).all())
    clean = x[0].nan_to_num(nan=float("-inf"))
    assert torch.allclose(lp[0], vt.vocab_topk_reference(clean, 8)[0], atol=2e-6, rtol=0)
    assert bool((x[0].gather(0, tok[0]) == clean.topk(8).values).all())
    assert bool(torch.isneginf(lp[1:3]).all())
    assert tok[3, :5].tolist() == [0, 1, 2, 3, 4]


@needs_kernel
def test_a_depth_slice_is_read_in_place_and_k_may_be_the_vocabulary() -> None:
    """The tree build passes ``logits[:, :depth]`` (rows not back to back): read through its
    strides. And k = V returns the whole row, sorted."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 6, 300, generator=gen) * 3
    _check(logits[:, :4], 32, **SMALL)
    _check(logits[:, 2:5, :200], 200, **SMALL)


def test_tile_and_candidate_list_must_be_powers_of_two() -> None:
    with pytest.raises(ValueError, match="powers of two"):
        vt.vocab_topk(torch.randn(2, 100), 4, tile=100)
