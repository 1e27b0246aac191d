"""kernels/mla_norm_rope.py: the MLA layer's two latent norms and the key's rope in one launch
(compiled on a GPU, the interpreter on the CPU) against the separate kernels it replaces, which match torch."""

from __future__ import annotations

import pytest
import torch

from kernels.mla_norm_rope import fusable, mla_norm_rope
from kernels.rms_norm import rms_norm_triton
from kernels.rope import rope_interleaved_triton

# The compiled kernels on a GPU, the interpreter on the CPU: inputs made on the CPU go to DEV (CPU
# tensors on a GPU machine, where nothing interprets, reached no kernel).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n: int, q_rows: int, kvr: int, rope: int, dtype: torch.dtype, seed: int, dev: str = DEV):
    """Made on the CPU (the same values on every machine), returned on ``dev``."""
    g = torch.Generator().manual_seed(seed)
    q_kv = (3 * torch.randn(n, q_rows + kvr + rope + 8, generator=g)).to(dtype).to(dev)[:, 4:-4]   # rows strided
    ang = torch.rand(n, rope, generator=g) * 6.3
    q_w = (1 + 0.2 * torch.randn(q_rows, generator=g)).to(dtype)
    kv_w = (1 + 0.2 * torch.randn(kvr, generator=g)).to(dtype)
    return q_kv, q_w.to(dev), kv_w.to(dev), ang.cos().to(dtype).to(dev), ang.sin().to(dtype).to(dev)


@pytest.mark.parametrize("n,q_rows,kvr,rope,dtype", [(3, 96, 64, 16, torch.float32), (5, 128, 128, 32, torch.float16),
                                                     (2, 48, 40, 8, torch.float32)])
def test_equals_the_separate_launches(n, q_rows, kvr, rope, dtype):
    q_kv, q_w, kv_w, cos, sin = _inputs(n, q_rows, kvr, rope, dtype, seed=n + q_rows)
    new_kv = torch.full((n, kvr + rope), float("nan"), dtype=dtype, device=DEV)
    q = mla_norm_rope(q_kv, q_rows, q_w, kv_w, cos, sin, 1e-6, new_kv)
    want_kv = torch.empty(n, kvr + rope, dtype=dtype, device=DEV)
    rms_norm_triton(q_kv[:, q_rows:q_rows + kvr], kv_w, 1e-6, out=want_kv[:, :kvr])
    rope_interleaved_triton(q_kv[:, q_rows + kvr:], cos, sin, out=want_kv[:, kvr:])
    assert torch.equal(q, rms_norm_triton(q_kv[:, :q_rows], q_w, 1e-6))
    assert torch.equal(new_kv, want_kv)           # every element written (the NaN poison is gone)


def test_new_kv_and_sin_at_their_own_row_strides():
    """``new_kv`` a column slice of a wider tensor (row stride kvr + rope + 8), and sin a slice at
    another row stride than cos: the same rows as the separate launches, nothing outside written."""
    n, q_rows, kvr, rope = 3, 96, 64, 16
    q_kv, q_w, kv_w, cos, _ = _inputs(n, q_rows, kvr, rope, torch.float32, seed=7)
    sin_wide = torch.randn(n, rope + 5, generator=torch.Generator().manual_seed(8)).to(DEV)
    sin = sin_wide[:, 5:]                                              # row stride rope + 5, cos's is rope
    wide = torch.full((n, kvr + rope + 8), float("nan"), device=DEV)
    new_kv = wide[:, 4:-4]
    q = mla_norm_rope(q_kv, q_rows, q_w, kv_w, cos, sin, 1e-6, new_kv)
    want_kv = torch.empty(n, kvr + rope, device=DEV)
    rms_norm_triton(q_kv[:, q_rows:q_rows + kvr], kv_w, 1e-6, out=want_kv[:, :kvr])
    rope_interleaved_triton(q_kv[:, q_rows + kvr:], cos, sin.contiguous(), out=want_kv[:, kvr:])
    assert torch.equal(q, rms_norm_triton(q_kv[:, :q_rows], q_w, 1e-6))
    assert torch.equal(new_kv, want_kv)
    assert torch.isnan(wide[:, :4]).all() and torch.isnan(wide[:, -4:]).all()


def test_without_a_q_lora_only_the_kv_part():
    q_kv, _, kv_w, cos, sin = _inputs(4, 72, 32, 16, torch.float32, seed=3)
    new_kv = torch.full((4, 48), float("nan"), device=DEV)
    assert mla_norm_rope(q_kv, 72, None, kv_w, cos, sin, 1e-6, new_kv) is None
    torch.testing.assert_close(new_kv[:, :32], rms_norm_triton(q_kv[:, 72:104], kv_w, 1e-6), rtol=0, atol=0)
    torch.testing.assert_close(new_kv[:, 32:], rope_interleaved_triton(q_kv[:, 104:], cos, sin), rtol=0, atol=0)


def test_shapes_it_refuses():
    q_kv, q_w, kv_w, cos, sin = _inputs(2, 32, 32, 16, torch.float32, seed=4, dev="cpu")   # refused before a launch
    with pytest.raises(AssertionError, match="q_kv must be"):
        mla_norm_rope(q_kv, 40, q_w, kv_w, cos, sin, 1e-6, torch.empty(2, 48))
    assert fusable(1536, 512) and fusable(128, 128) and not fusable(4096, 512)


def test_the_eps_it_is_given_is_the_one_it_uses() -> None:
    """Every test above used 1e-6, DeepSeek-V3's and K2's: a kernel that ignored the argument
    normed a model of another `rms_norm_eps` otherwise than the CPU path, without an error."""
    from kernels.rms_norm import rms_norm_reference

    q_kv, q_w, kv_w, cos, sin = _inputs(3, 64, 64, 16, torch.float32, seed=11)
    q_kv = q_kv * 0.1   # small rows, where an eps of 0.5 changes the norm
    new_kv = torch.full((3, 80), float("nan"), device=DEV)
    q = mla_norm_rope(q_kv, 64, q_w, kv_w, cos, sin, 0.5, new_kv)
    torch.testing.assert_close(q.cpu(), rms_norm_reference(q_kv[:, :64].cpu(), q_w.cpu(), 0.5))
    torch.testing.assert_close(new_kv[:, :64].cpu(), rms_norm_reference(q_kv[:, 64:128].cpu(), kv_w.cpu(), 0.5))
