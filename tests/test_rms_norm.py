"""kernels/rms_norm.py: the Triton RMSNorm (interpreter on the CPU) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import rms_norm_reference, rms_norm_triton


@pytest.mark.parametrize("rows,n,dtype", [(1, 7, torch.float32), (5, 96, torch.float32), (3, 128, torch.bfloat16),
                                          (4, 33, torch.float16)])
def test_triton_rms_norm_matches_reference(rows, n, dtype):
    g = torch.Generator().manual_seed(rows * 100 + n)
    x = (3 * torch.randn(rows, n, generator=g)).to(dtype)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype)
    got = rms_norm_triton(x, w, 1e-6)
    want = rms_norm_reference(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.isfinite(got).all()


def test_strided_rows_and_leading_dims():
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(6, 40, generator=g)          # [N, kvr + rope]: the norm reads the first 32 of each row
    w = torch.rand(32, generator=g) + 0.5
    torch.testing.assert_close(rms_norm_triton(kv[:, :32], w, 1e-6), rms_norm_reference(kv[:, :32], w, 1e-6))
    x = torch.randn(2, 3, 16, generator=g)
    w16 = torch.rand(16, generator=g)
    out = rms_norm_triton(x, w16, 1e-5)
    assert out.shape == (2, 3, 16)
    torch.testing.assert_close(out, rms_norm_reference(x, w16, 1e-5))
