"""kernels/pdl.py: programmatic dependent launch. The CPU cannot run it, so these check what it can:
PDL stays off here, and the sm_90 builds of the kernels that use it wait for their predecessor
before any activation load or store, with only weight prefetches ahead of the wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from kernels import pdl

ROOT = Path(__file__).resolve().parent.parent


def test_off_without_a_hopper_gpu():
    assert not pdl.enabled(torch.device("cpu"))
    saved = pdl.PDL
    try:
        pdl.PDL = False
        assert not pdl.enabled(torch.device("cuda", 0))  # the switch alone turns it off, no GPU asked
    finally:
        pdl.PDL = saved


_SM90_BUILD = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.skinny_gemm import _skinny_kernel
from kernels.rms_norm import _rms_norm_kernel
from kernels.swiglu import _silu_mul_kernel

def build(kernel, types, constexprs, warps=4):
    names = kernel.arg_names
    assert set(types) | set(constexprs) == set(names), f"kernel arguments changed: {names}"
    src = ASTSource(fn=kernel, signature={n: types.get(n, "constexpr") for n in names}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["ptx"]

def order(ptx):
    body = [line.split("//")[0].strip() for line in ptx.splitlines()]
    first = lambda pat: next((i for i, l in enumerate(body) if re.search(pat, l)), None)
    wait = first(r"griddepcontrol\\.wait")
    return dict(wait=wait, launch=first(r"griddepcontrol\\.launch_dependents"),
                first_access=first(r"^(@%p\\d+ )?(ld\\.global|st\\.global|cp\\.async|atom\\.|red\\.)"),
                prefetches=sum("prefetch.global.L2" in l for l in body),
                prefetches_after_wait=sum("prefetch.global.L2" in l for l in body[wait or 0:]))

out = {}
names = _skinny_kernel.arg_names
types = {n: ("*bf16" if n in ("x_ptr", "w_ptr", "out_ptr", "add_ptr") else "*fp32" if n == "part_ptr" else "*i32")
         for n in names if n.endswith("_ptr")} | {n: "i32" for n in ("M", "N", "K", "k_slice")} \
        | {n: "i32" for n in names if n.startswith("stride_")}
for pre in (False, True):
    ce = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, HAS_ADD=False, DOT_F32=False, PDL=True, PREFETCH=pre)
    out[f"skinny_prefetch_{pre}"] = order(build(_skinny_kernel, types, ce))
ce = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, HAS_ADD=False, DOT_F32=False, PDL=False, PREFETCH=False)
out["skinny_off"] = order(build(_skinny_kernel, types, ce))
names = _rms_norm_kernel.arg_names
types = {n: "*bf16" for n in names if n.endswith("_ptr")} | {n: "i32" for n in names if n.startswith("stride_") or n == "n_cols"}
types["eps"] = "fp32"
out["rms_norm"] = order(build(_rms_norm_kernel, types, dict(BLOCK=8192, RESIDUAL=True, F32_COPY=False, PDL=True), 8))
names = _silu_mul_kernel.arg_names
types = {n: "*bf16" for n in names if n.endswith("_ptr")} | {n: "i32" for n in names if n.startswith("stride_") or n == "inter"}
out["silu_mul"] = order(build(_silu_mul_kernel, types, dict(BLOCK=256, LIBDEVICE=True, PDL=True)))
print(json.dumps(out))
"""


def test_sm90_builds_wait_before_any_activation_access():
    """Compiled for sm_90 in a child process (this one runs Triton's interpreter): each PDL kernel
    has the wait and the launch of its dependents, and no global load, store, copy or atomic comes
    before the wait; the skinny GEMM's weight prefetches (``PREFETCH``) all come before it. Without
    PDL the build has neither instruction."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _SM90_BUILD], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("skinny_prefetch_False", "skinny_prefetch_True", "rms_norm", "silu_mul"):
        o = got[name]
        assert o["wait"] is not None and o["launch"] is not None, (name, o)
        assert o["first_access"] is not None and o["first_access"] > o["wait"], (name, o)
    assert got["skinny_prefetch_False"]["prefetches"] == 0
    assert got["skinny_prefetch_True"]["prefetches"] > 0
    assert got["skinny_prefetch_True"]["prefetches_after_wait"] == 0
    assert got["skinny_off"]["wait"] is None and got["skinny_off"]["launch"] is None and got["skinny_off"]["prefetches"] == 0
