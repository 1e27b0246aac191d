"""kernels/swiglu.py: ``silu(gate) * up`` from the stacked gate/up product, one launch (compiled on a GPU,
the interpreter on the CPU) against the torch expression; bit for bit on the GPU in bench/fused_ops_check.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.swiglu import silu_mul, silu_mul_reference, silu_mul_triton
from services.verifier.moe import MLPWeights, mlp_forward

# The compiled kernel on a GPU, the interpreter on the CPU: inputs made on the CPU go to DEV, results
# come back (CPU tensors on a GPU machine, where nothing interprets, reached no kernel).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,inter,dtype", [(1, 7, torch.float32), (5, 256, torch.float32), (3, 2304, torch.float16),
                                              (2, 96, torch.bfloat16)])
def test_matches_the_torch_expression(rows, inter, dtype):
    g = torch.Generator().manual_seed(rows + inter)
    gu = (4 * torch.randn(rows, 2 * inter, generator=g)).to(dtype).to(DEV)
    got = silu_mul_triton(gu).cpu()
    want = (F.silu(gu[:, :inter]) * gu[:, inter:]).cpu()   # the torch expression on the kernel's own tensors
    assert got.shape == (rows, inter) and got.dtype == dtype
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.isfinite(got).all()


def test_strided_rows_and_extremes():
    # rows of a larger product (a strided view), and gates far out on both tails: silu(-100) is -0-ish,
    # silu(100) is 100, no NaN from exp overflow
    g = torch.Generator().manual_seed(9)
    big = torch.randn(4, 40, generator=g)
    big[0, 0], big[1, 1], big[2, 2] = -100.0, 100.0, 0.0
    view = big.to(DEV)[:, 4:36]                        # [4, 32]: gate 16 | up 16, row stride 40
    got = silu_mul_triton(view).cpu()
    torch.testing.assert_close(got, silu_mul_reference(view).cpu(), rtol=1e-6, atol=1e-6)
    assert torch.isfinite(got).all()


def test_mlp_forward_stacks_gate_and_up():
    # on DEV: on a GPU silu_mul takes the kernel (float32 GEMMs stay torch's)
    g = torch.Generator().manual_seed(2)
    I, hid = 12, 20
    gate, up, down = (torch.randn(I, hid, generator=g), torch.randn(I, hid, generator=g),
                      torch.randn(hid, I, generator=g))
    w = MLPWeights.stack(gate.to(DEV), up.to(DEV), down.to(DEV))
    assert torch.equal(w.gate.cpu(), gate) and torch.equal(w.up.cpu(), up) and w.gate_up.shape == (2 * I, hid)
    x = torch.randn(3, hid, generator=g)
    want = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(mlp_forward(x.to(DEV), w).cpu(), want, rtol=1e-5, atol=1e-5)
    base = torch.randn(3, hid, generator=g)
    expected = base + want
    base = base.to(DEV)
    out = mlp_forward(x.to(DEV), w, add_to=base)
    assert out is base   # the down GEMM adds into add_to itself (no copy first)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    assert silu_mul(torch.zeros(0, 8, device=DEV)).shape == (0, 4)
