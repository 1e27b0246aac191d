"""The Triton INT4 MoE kernel built for sm_90 from the CPU run, once per scale dtype: float32 scales
take the exact dequantisation (a product a nibble, no FMA), bf16 and fp16 scales the one-FMA path.
The interpreter (tests/test_int4_moe.py) checks the values; this checks that the compiler, not only
the interpreter, takes the scale pointer's type as the switch."""

from __future__ import annotations

import json

import pytest

from tests.compiled import run_compiled


def _build() -> dict[str, dict[str, int]]:
    """Compile the gate/up launch (fp16 activations, no PTX dequant) for each scale dtype."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.int4_moe import _int4_moe_gemm_kernel as kernel

    out = {}
    for scale in ("fp32", "bf16", "fp16"):
        ptrs = {"a_ptr": "*fp16", "w0_ptr": "*i32", "s0_ptr": f"*{scale}", "w1_ptr": "*i32", "s1_ptr": f"*{scale}",
                "out_ptr": "*fp16", "ws_ptr": "*fp32", "count_ptr": "*i32", "sorted_ids_ptr": "*i32",
                "block_expert_ptr": "*i32", "topk_w_ptr": "*fp32"}
        constexprs = dict(GATED=True, ATOMIC=False, SWAP_AB=True, GROUP=32, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                          SPLIT_K=1, EVEN_K=True, DEQ_ASM=False, DOT_F32=False, DTYPE=tl.float16)
        signature = {n: ptrs.get(n, "i32") for n in kernel.arg_names if n not in constexprs}
        signature |= {c: "constexpr" for c in constexprs}
        src = ASTSource(fn=kernel, signature=signature,
                        constexprs={(kernel.arg_names.index(c),): v for c, v in constexprs.items()})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
        out[scale] = {"fma": ptx.count("fma.rn.f32"), "mul": ptx.count("mul.f32") + ptx.count("mul.rn.f32")}
    return out


def test_float32_scales_build_the_exact_dequantisation_for_sm90() -> None:
    pytest.importorskip("triton")
    built = run_compiled([__file__])
    assert built["fp32"]["fma"] == 0 and built["fp32"]["mul"] > 0, built
    assert built["bf16"]["fma"] > 0 and built["fp16"]["fma"] > 0, built


if __name__ == "__main__":
    print(json.dumps(_build()))
