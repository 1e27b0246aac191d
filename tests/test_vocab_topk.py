"""`kernels.vocab_topk`: the top-k log-probs of each row of draft logits (torch's top-k of the
logits, less each row's log-sum-exp from a Triton kernel, under the interpreter here), against
log_softmax then topk."""

from __future__ import annotations

import pytest
import torch

from kernels import vocab_topk as vt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(vt.triton is None, reason="needs triton")


def _check(logits: torch.Tensor, k: int) -> None:
    """Same values as the reference (float32 rounding), each value its own token's log-prob,
    k distinct tokens, descending, and a true top-k: nothing left out beats the k-th value."""
    lp, tok = vt.vocab_topk(logits.to(DEVICE), k)
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
def test_random_bf16_rows_over_several_blocks(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    _check((torch.randn(2, 3, 5000, generator=gen) * 3).to(torch.bfloat16), k)


@needs_kernel
def test_fp16_with_minus_inf_a_short_row_and_k_the_whole_row() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 700, generator=gen) * 3
    x[:, ::3] = float("-inf")
    _check(x.half(), 64)
    _check(torch.randn(3, 130, generator=gen), 130)


@needs_kernel
def test_the_log_sum_exp_of_a_depth_slice_is_read_in_place() -> None:
    """The tree build passes ``logits[:, :depth]`` (rows not back to back): read through its
    strides, each row's own log-sum-exp (float64 reference), and -inf for a row of -inf."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 6, 3000, generator=gen) * 3 + 40
    logits[1, 1] = float("-inf")
    for piece in (logits[:, :4], logits[:, 2:5, :2500], logits[0, 0]):
        got = vt.row_logsumexp(piece.to(DEVICE)).cpu()
        want = torch.logsumexp(piece.double(), dim=-1)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, atol=1e-5, rtol=0, equal_nan=False), (got, want)
    _check((torch.randn(3, 6, 3000, generator=gen) * 3)[:, :4], 32)   # a slice, logits near 0: float32 values


@needs_kernel
def test_rows_with_a_non_unit_vocab_stride() -> None:
    """A transposed view, [4, 3000] with strides (1, 4): its log-sum-exp and top-k as the reference's."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(3000, 4, generator=g) * 3).t()
    got = vt.row_logsumexp(logits.to(DEVICE)).cpu()
    assert torch.allclose(got.double(), torch.logsumexp(logits.double(), -1), atol=1e-5, rtol=0)
    _check(logits, 16)


@needs_kernel
def test_a_nan_logit_makes_its_row_nan_as_log_softmax_does() -> None:
    x = torch.randn(2, 500)
    x[0, 7] = float("nan")
    got = vt.row_logsumexp(x.to(DEVICE)).cpu()
    assert torch.isnan(got[0]) and torch.isfinite(got[1])


def test_k_outside_the_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="k must be in 1..100"):
        vt.vocab_topk(torch.randn(2, 100), 101)
    with pytest.raises(ValueError, match="k must be in"):
        vt.vocab_topk(torch.randn(2, 100), 0)


def test_no_rows_give_empty_results() -> None:
    """The reshape to [outer, inner, V] raised on zero rows, before the empty-launch guard."""
    for shape in ((0, 50), (2, 0, 50)):
        assert vt.row_logsumexp(torch.randn(*shape)).shape == shape[:-1]
    values, tokens = vt.vocab_topk(torch.randn(0, 50), 4)
    assert values.shape == tokens.shape == (0, 4)
