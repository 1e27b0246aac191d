"""kernels/rms_norm.py: the Triton RMSNorm and the fused residual add + RMSNorm (interpreter on the
CPU) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import (
    add_rms_norm, add_rms_norm_reference, add_rms_norm_triton, rms_norm_reference, rms_norm_triton,
)

# The compiled kernel on a GPU, the interpreter on the CPU: inputs made on the CPU go to DEV, results
# come back (CPU tensors on a GPU machine, where nothing interprets, reached no kernel).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,n,dtype", [(1, 7, torch.float32), (5, 96, torch.float32), (3, 128, torch.bfloat16),
                                          (4, 33, torch.float16)])
def test_triton_rms_norm_matches_reference(rows, n, dtype):
    g = torch.Generator().manual_seed(rows * 100 + n)
    x = (3 * torch.randn(rows, n, generator=g)).to(dtype)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype)
    got = rms_norm_triton(x.to(DEV), w.to(DEV), 1e-6).cpu()
    want = rms_norm_reference(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.isfinite(got).all()


def test_strided_rows_and_leading_dims():
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(6, 40, generator=g)          # [N, kvr + rope]: the norm reads the first 32 of each row
    w = torch.rand(32, generator=g) + 0.5
    got = rms_norm_triton(kv.to(DEV)[:, :32], w.to(DEV), 1e-6).cpu()   # the strided view taken on DEV
    torch.testing.assert_close(got, rms_norm_reference(kv[:, :32], w, 1e-6))
    x = torch.randn(2, 3, 16, generator=g)
    w16 = torch.rand(16, generator=g)
    out = rms_norm_triton(x.to(DEV), w16.to(DEV), 1e-5).cpu()
    assert out.shape == (2, 3, 16)
    torch.testing.assert_close(out, rms_norm_reference(x, w16, 1e-5))


@pytest.mark.parametrize("rows,n,dtype", [(1, 7, torch.float32), (5, 96, torch.float32), (3, 128, torch.float16),
                                          (4, 256, torch.bfloat16)])
def test_add_rms_norm_matches_the_two_steps(rows, n, dtype):
    # The decoder's residual step: the sum is rounded to the dtype (as torch's add) and the norm
    # reads that; x itself is left alone (a caller may hold it as a layer's features).
    g = torch.Generator().manual_seed(rows * 10 + n)
    x = (3 * torch.randn(rows, n, generator=g)).to(dtype)
    r = (2 * torch.randn(rows + 1, n, generator=g)).to(dtype).to(DEV)[1:]   # a strided-start view (on DEV)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype)
    x_before = x.clone()   # a copy: on the CPU ``x.to(DEV)`` is ``x`` itself
    xd, wd = x.to(DEV), w.to(DEV)
    total_d, normed_d = add_rms_norm_triton(xd, r, wd, 1e-6)
    total, normed = total_d.cpu(), normed_d.cpu()
    # The torch steps on the same DEV tensors: the sum is torch's add there, bit for bit on either machine.
    want_total, want_normed = (t.cpu() for t in add_rms_norm_reference(xd, r, wd, 1e-6))
    assert torch.equal(xd.cpu(), x_before)
    assert total.dtype == dtype and normed.shape == (rows, n)
    if dtype == torch.bfloat16:   # the interpreter truncates to bf16; bit for bit on the GPU (bench/fused_ops_check.py)
        torch.testing.assert_close(total.float(), want_total.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(normed.float(), want_normed.float(), rtol=3e-2, atol=3e-2)
    else:
        assert torch.equal(total, want_total)
        tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(normed.float(), want_normed.float(), rtol=tol, atol=tol)
        # the norm of the rounded sum, not of the exact one: equal to normalising ``total`` itself
        torch.testing.assert_close(normed, rms_norm_triton(total_d, wd, 1e-6).cpu(), rtol=0, atol=0)


def test_add_rms_norm_of_rows_at_three_row_strides() -> None:
    """x, residual and the float32 copy each a column slice of a wider tensor, each its own row
    stride (only their last dim must be contiguous)."""
    g = torch.Generator().manual_seed(31)
    rows, n = 4, 48
    x = (3 * torch.randn(rows, n + 8, generator=g)).to(DEV)[:, :n]    # row stride 56
    r = (2 * torch.randn(rows, n + 3, generator=g)).to(DEV)[:, 3:]    # row stride 51
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(DEV)
    f32 = torch.full((rows, n + 5), float("nan"), device=DEV)[:, :n]   # row stride 53
    total, normed = add_rms_norm_triton(x, r, w, 1e-6, f32)
    want_total, want_normed = add_rms_norm_reference(x.cpu(), r.cpu(), w.cpu(), 1e-6)
    assert torch.equal(total.cpu(), want_total)
    torch.testing.assert_close(normed.cpu(), want_normed, rtol=1e-5, atol=1e-5)
    assert torch.equal(f32, normed)


def test_add_rms_norm_dispatch_and_refusals():
    g = torch.Generator().manual_seed(5)
    x, r, w = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g), torch.rand(16, generator=g)
    total, normed = add_rms_norm(x, r, w, 1e-6)           # CPU: the torch expression
    torch.testing.assert_close(total, x + r, rtol=0, atol=0)
    torch.testing.assert_close(normed, rms_norm_reference(x + r, w, 1e-6))
    with pytest.raises(AssertionError, match="one \\[N, n\\] shape"):
        add_rms_norm_triton(x, r[:2], w, 1e-6)
    with pytest.raises(AssertionError, match="weight must be"):
        add_rms_norm_triton(x, r, w[:8], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_rms_norm_writes_the_float32_upcast(dtype):
    # the MoE router's input: exactly the normed rows, upcast (no cast launch of its own)
    g = torch.Generator().manual_seed(11)
    x, r = (3 * torch.randn(4, 64, generator=g)).to(dtype), torch.randn(4, 64, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(64, generator=g)).to(dtype)
    for fn in (add_rms_norm_triton, add_rms_norm_reference):
        f32 = torch.full((4, 64), float("nan")).to(DEV)
        _, normed = fn(x.to(DEV), r.to(DEV), w.to(DEV), 1e-6, f32)
        assert torch.equal(f32.cpu(), normed.float().cpu())
    with pytest.raises(AssertionError, match="float32_copy must be"):
        add_rms_norm_triton(x, r, w, 1e-6, torch.empty(4, 64, dtype=dtype))


def test_the_normed_row_rounds_to_the_input_dtype_before_the_weight() -> None:
    """HF rounds the normalised row to the input's dtype, then multiplies by the weight; the usual
    tolerances hid a kernel that skipped the rounding. It shows where the output is wider than the
    input (fp16 rows, a float32 weight): one fp16 rounding is ~5e-4 relative."""
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(4, 96, generator=g)).to(torch.float16)
    w = 1 + 0.3 * torch.randn(96, generator=g)
    got = rms_norm_triton(x.to(DEV), w.to(DEV), 1e-6).cpu()
    want = rms_norm_reference(x, w, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_the_fused_add_norm_of_narrow_rows_with_a_float32_weight_is_float32_as_the_reference() -> None:
    """The sum keeps the rows' dtype; the normed rows take the wider of the rows' and the weight's."""
    g = torch.Generator().manual_seed(4)
    x, residual = ((2 * torch.randn(3, 64, generator=g)).to(torch.float16) for _ in range(2))
    w = 1 + 0.3 * torch.randn(64, generator=g)
    total, normed = add_rms_norm_triton(x.to(DEV), residual.to(DEV), w.to(DEV), 1e-6)
    want_total, want_normed = add_rms_norm_reference(x, residual, w, 1e-6)
    assert total.dtype == torch.float16 and normed.dtype == want_normed.dtype == torch.float32
    assert torch.equal(total.cpu(), want_total)
    torch.testing.assert_close(normed.cpu(), want_normed, rtol=2e-3, atol=2e-3)   # one fp16 rounding apart at most
