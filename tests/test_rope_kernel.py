"""kernels/rope.py: the one-launch interleaved rope (interpreter on the CPU) against
`apply_rope_interleaved`, the torch expression: queries with heads, a key row, strided inputs, and
writes into a slice of a larger tensor."""

from __future__ import annotations


import pytest
import torch

from kernels.rms_norm import rms_norm, rms_norm_reference
from kernels.rope import rope_interleaved_triton
from services.verifier.rope import apply_rope, apply_rope_interleaved
from tests.compiled import run_compiled

# The compiled kernel on a GPU, the interpreter on the CPU: inputs made on the CPU go to DEV, results
# come back (CPU tensors on a GPU machine, where nothing interprets, reached no kernel).
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# The interpreter rounds float32 -> float16 to nearest, as the GPU does, so these compare bit for bit;
# its bfloat16 conversion truncates, so bfloat16 is compared with a tolerance here (and bit for bit
# on the GPU by bench/rope_check.py). The torch expression a bit-for-bit check compares with runs on
# the kernel's own DEV tensors, so that it is torch's rounding on that machine either way.


def _inputs(n: int, rows: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(n, rows, d, generator=g)).to(dtype)
    ang = torch.rand(n, d, generator=g) * 6.3
    return x, ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("n,rows,d,dtype", [(3, 8, 64, torch.float32), (5, 8, 32, torch.float16),
                                            (2, 3, 6, torch.float32), (4, 1, 64, torch.float16)])
def test_matches_the_torch_expression_bit_for_bit(n, rows, d, dtype):
    x, cos, sin = (t.to(DEV) for t in _inputs(n, rows, d, dtype, seed=n * rows + d))
    got = rope_interleaved_triton(x, cos, sin).cpu()
    want = apply_rope_interleaved(x, cos.unsqueeze(1), sin.unsqueeze(1)).cpu()
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)
    two_d = rope_interleaved_triton(x[:, 0], cos, sin).cpu()        # a key row: [N, d]
    assert torch.equal(two_d, apply_rope_interleaved(x[:, 0], cos, sin).cpu())


def test_bfloat16_within_rounding():
    x, cos, sin = _inputs(4, 8, 64, torch.bfloat16, seed=7)
    got = rope_interleaved_triton(x.to(DEV), cos.to(DEV), sin.to(DEV)).cpu()
    want = apply_rope_interleaved(x, cos.unsqueeze(1), sin.unsqueeze(1))
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=3e-2)


def test_strided_views_and_out_slices():
    # q [N, H, nope + rope]: the rope part is a strided view; the new latent kv [N, kvr + rope]
    # takes the key's rope in its last columns and the normalised latent in its first.
    g = torch.Generator().manual_seed(3)
    N, H, nope, rope, kvr = 5, 4, 16, 8, 24
    q = torch.randn(N, H, nope + rope, generator=g)
    kv = torch.randn(N, kvr + rope, generator=g)
    ang = torch.rand(N, rope, generator=g) * 6.3
    cos, sin = ang.cos(), ang.sin()
    qd, kvd, cosd, sind = q.to(DEV), kv.to(DEV), cos.to(DEV), sin.to(DEV)   # views below are taken on DEV
    q_pe = rope_interleaved_triton(qd[..., nope:], cosd, sind).cpu()
    assert torch.equal(q_pe, apply_rope_interleaved(qd[..., nope:], cosd.unsqueeze(1), sind.unsqueeze(1)).cpu())
    new_kv = torch.full((N, kvr + rope), float("nan")).to(DEV)
    w = torch.rand(kvr, generator=g) + 0.5
    assert rope_interleaved_triton(kvd[:, kvr:], cosd, sind, out=new_kv[:, kvr:]).data_ptr() == new_kv[:, kvr:].data_ptr()
    # The CPU path of the dispatcher (CPU inputs: the torch expression, copied into DEV's slice), on a
    # GPU machine too: its result is compared bit for bit with the CPU reference below.
    rms_norm(kv[:, :kvr], w, 1e-6, out=new_kv[:, :kvr])
    new_kv = new_kv.cpu()
    assert torch.isfinite(new_kv).all()                      # every element written
    assert torch.equal(new_kv[:, kvr:], apply_rope_interleaved(kvd[:, kvr:], cosd, sind).cpu())
    assert torch.equal(new_kv[:, :kvr], rms_norm_reference(kv[:, :kvr], w, 1e-6))
    # The model's dispatcher takes per-token cos/sin for both shapes on the CPU too: CPU inputs (its
    # torch path) against the kernel's result, on purpose.
    assert torch.equal(apply_rope(q[..., nope:], cos, sin), q_pe)


def test_rope_into_a_padded_3d_out_with_sin_strided_apart_from_cos() -> None:
    """[N, R, d] rows into a slice of a wider [N, R, d + 16] tensor (row stride d + 16, not d), with
    cos contiguous (row stride d) and sin a column slice (row stride d + 7)."""
    g = torch.Generator().manual_seed(51)
    N, R, d = 3, 4, 16
    x = 3 * torch.randn(N, R, d, generator=g)
    table = torch.rand(N, 3 * d, generator=g) * 6.3
    cos, sin = table[:, :d].cos(), table[:, d + 5:2 * d + 5].sin()
    sin_wide = torch.full((N, d + 7), float("nan"))
    sin_wide[:, 7:] = sin
    wide = torch.full((N, R, d + 16), float("nan"), device=DEV)
    sin_d = sin_wide.to(DEV)[:, 7:]   # the views are taken on DEV (.to of a view would pack it)
    rope_interleaved_triton(x.to(DEV), cos.to(DEV), sin_d, out=wide[..., 8:8 + d])
    wide = wide.cpu()
    want = apply_rope_interleaved(x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1))
    torch.testing.assert_close(wide[..., 8:8 + d].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.isnan(wide[..., :8]).all() and torch.isnan(wide[..., 8 + d:]).all()


def test_bad_shapes_are_refused():
    x, cos, sin = _inputs(2, 2, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_interleaved_triton(x, cos[:, :4], sin[:, :4])
    with pytest.raises(ValueError, match="out must be"):
        rope_interleaved_triton(x, cos, sin, out=torch.empty(2, 2, 6))


_SM90_BUILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.rope import _rope_interleaved_kernel as kernel

names = kernel.arg_names
types = {n: "*bf16" for n in names if n.endswith("_ptr")} | {n: "i32" for n in names if n == "rows" or n.startswith("stride_")}
constexprs = {"HALF": 32, "BLOCK_R": 8, "BLOCK_H": 32, "EXACT": True, "PDL": True}
assert set(types) | set(constexprs) == set(names), f"kernel arguments changed: {names}"
src = ASTSource(fn=kernel, signature={n: types.get(n, "constexpr") for n in names}, constexprs=constexprs)
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1)).asm["ptx"]
body = [line.split("//")[0] for line in ptx.splitlines()]
print(json.dumps({"fma": sum("fma" in line for line in body),
                  "mul_rn_f32": sum("mul.rn" in line and ".f32" in line for line in body),
                  "cvt_bf16": sum("cvt.rn.bf16.f32" in line for line in body)}))
"""


def test_sm90_build_rounds_each_product():
    """The GPU build must round each product to 16 bits before the sum, as torch does: LLVM fuses a
    product narrowed to bf16 with the add into one `fma.rn.bf16` unless the product is `mul.rn`
    (that fusion made an earlier build differ from torch in the last bit). Compiled for sm_90 in a
    child process, since this one runs Triton's interpreter."""
    counts = run_compiled(["-c", _SM90_BUILD], timeout=300)
    assert counts["fma"] == 0, "a product was fused with the sum"
    assert counts["mul_rn_f32"] == 4 * 8            # 4 products x 8 rows a thread (one warp, 8 x 32 pairs)
    assert counts["cvt_bf16"] >= 4 * 8
