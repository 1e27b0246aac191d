"""kernels/pdl.py: programmatic dependent launch. The CPU cannot run it, so these check what it can:
PDL stays off here, the sm_90 builds of the kernels that use it wait for their predecessor before
any global load or store, and every kernel module keeps the contract in ``kernels/pdl.py``."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from kernels import pdl
from tests.compiled import run_compiled

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
                first_access=first(r"^(@%p\\d+ )?(ld\\.global|st\\.global|cp\\.async|atom\\.|red\\.)"))

out = {}
names = _skinny_kernel.arg_names
types = {n: ("*bf16" if n in ("x_ptr", "w_ptr", "out_ptr", "add_ptr") else "*fp32" if n == "part_ptr" else "*i32")
         for n in names if n.endswith("_ptr")} | {n: "i32" for n in ("M", "N", "K", "k_slice")} \
        | {n: "i32" for n in names if n.startswith("stride_")}
for on in (True, False):
    ce = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, HAS_ADD=True, DOT_F32=False, PDL=on)
    out["skinny" if on else "skinny_off"] = order(build(_skinny_kernel, types, ce))
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
    before the wait. Without PDL the build has neither instruction."""
    got = run_compiled(["-c", _SM90_BUILD])
    for name in ("skinny", "rms_norm", "silu_mul"):
        o = got[name]
        assert o["wait"] is not None and o["launch"] is not None, (name, o)
        assert o["first_access"] is not None and o["first_access"] > o["wait"], (name, o)
    assert got["skinny_off"]["wait"] is None and got["skinny_off"]["launch"] is None
    assert got["skinny_off"]["first_access"] is not None


_BEFORE_SYNC_OK = {"constexpr", "program_id", "num_programs", "arange", "to", "zeros", "full", "cdiv", "multiple_of", "max_contiguous",
                   "minimum", "maximum", "where"}


def _calls_in_order(node: ast.AST) -> list[ast.AST]:
    """Calls and returns under ``node`` in source order (by position)."""
    found = [n for n in ast.walk(node) if isinstance(n, (ast.Call, ast.Return))]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def _name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def test_every_pdl_kernel_syncs_first_and_every_launch_says_so():
    """Static check of the contract in ``kernels/pdl.py`` over every kernel module: a kernel that takes
    ``PDL`` calls ``pdl.grid_sync(PDL)`` before any call that could touch memory (only index
    arithmetic may come first) and before any return; and every launch that passes ``PDL=`` passes
    ``launch_pdl=`` too, and the other way round."""
    kernels_with_pdl, launched = set(), set()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and "PDL" in [a.arg for a in fn.args.args] and not fn.name.startswith("grid_sync"):
                kernels_with_pdl.add(fn.name)
                body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
                synced = False
                for stmt in body:
                    for n in _calls_in_order(stmt):
                        if isinstance(n, ast.Call) and _name(n).startswith("grid_sync"):
                            synced = True
                            break
                        assert not isinstance(n, ast.Return), f"{path.name}:{n.lineno} {fn.name} returns before grid_sync"
                        assert _name(n) in _BEFORE_SYNC_OK, f"{path.name}:{n.lineno} {fn.name} calls {_name(n)} before grid_sync"
                    if synced:
                        break
                assert synced, f"{path.name}: {fn.name} takes PDL but never calls grid_sync"
            if isinstance(fn, ast.Call) and isinstance(fn.func, ast.Subscript):
                kw = {k.arg for k in fn.keywords}
                assert ("PDL" in kw) == ("launch_pdl" in kw), f"{path.name}:{fn.lineno}: PDL= and launch_pdl= go together"
                if "PDL" in kw and isinstance(fn.func.value, ast.Name):
                    launched.add(fn.func.value.id)
    assert {"_skinny_kernel", "_rms_norm_kernel", "_int4_moe_gemv_gate_up_kernel", "_tree_mla_merge_kernel",
            "_moe_gemm_hopper_kernel", "_tree_mla_hopper_kernel", "_tree_mla_few_rows_kernel"} <= kernels_with_pdl
    assert kernels_with_pdl == launched, kernels_with_pdl ^ launched


def test_merge_waits_for_a_split_launch_that_holds_most_sms() -> None:
    """A merge after a split launch of more than half the SMs' CTAs is launched plainly: launched
    early its programs would sit on the few SMs left free (``bench/results/tree_mla_pdl_ab-*.json``)."""
    from kernels.tree_mla import EARLY_MERGE_MAX_SHARE, merge_launches_early

    assert EARLY_MERGE_MAX_SHARE == 0.5
    assert merge_launches_early(None, 132)  # not known: early, as every other launch
    assert merge_launches_early(24, 132) and merge_launches_early(66, 132)  # few-row at batch 1; half the GPU
    assert not merge_launches_early(67, 132) and not merge_launches_early(130, 132)  # 64-row at batch 1, tree 33
    assert not merge_launches_early(264, 132)  # more CTAs than SMs
