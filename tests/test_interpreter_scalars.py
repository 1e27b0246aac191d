"""Triton's interpreter indexes with a scalar argument as later tritons do (``fix_interpreter_scalars``).

Why: under triton 3.6 (torch 2.11's pin) and numpy 2.4 or later, every kernel loop to a run-time bound failed
in the interpreter (``int()`` of a one-element array), so the INT4 MoE's interpreter cases failed on
a GPU host's ``make test``.
"""

from __future__ import annotations

import operator
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from triton.runtime import interpreter

from kernels.device import fix_interpreter_scalars


class Tensor:
    """Stands in for ``tl.tensor`` while the interpreter's patch is applied and undone."""


def tensor_holding(data: np.ndarray) -> Tensor:
    t = Tensor()
    t.handle = SimpleNamespace(data=data)
    return t


def test_a_scalar_argument_indexes_and_the_tensor_class_gets_its_own_attributes_back() -> None:
    fix_interpreter_scalars()
    fix_interpreter_scalars()   # once: a second call wraps nothing more
    patch = interpreter._patch_lang_tensor
    assert patch.scalars_fixed and not getattr(patch.__closure__[0].cell_contents, "scalars_fixed", False)
    scope = interpreter._LangPatchScope()
    patch(Tensor, scope)
    assert operator.index(tensor_holding(np.array([37], dtype=np.int32))) == 37   # a scalar argument
    assert list(range(0, tensor_holding(np.array([10], dtype=np.int64)), 4)) == [0, 4, 8]
    with pytest.raises(TypeError):   # a block is no index
        operator.index(tensor_holding(np.array([1, 2], dtype=np.int32)))
    scope.restore()
    assert "__index__" not in vars(Tensor) and "__bool__" not in vars(Tensor)


# A child process emulates triton 3.6's index (numpy 2.4 and later refuse it; the warnings filter
# makes an older numpy as strict) and runs a kernel summing to a run-time bound, with the fix
# applied over the emulation (as at import) or not (the emulation put in after the import).
CHILD = '''
import os, sys, warnings
os.environ["TRITON_INTERPRET"] = "1"
warnings.simplefilter("error", DeprecationWarning)
import torch, triton, triton.language as tl
from triton.runtime import interpreter


def as_triton_36(emulate=interpreter._patch_lang_tensor):
    def patch(tensor, scope):
        emulate(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))
    interpreter._patch_lang_tensor = patch


@triton.jit
def total(x_ptr, out_ptr, n):
    acc = tl.zeros([1], dtype=tl.float32)
    for i in tl.range(0, n, 1):
        acc += tl.load(x_ptr + i + tl.arange(0, 1))
    tl.store(out_ptr + tl.arange(0, 1), acc)


if sys.argv[1] == "fixed":
    as_triton_36()
    import kernels  # noqa: F401  (applies the fix under TRITON_INTERPRET=1)
else:
    import kernels  # noqa: F401
    as_triton_36()
x = torch.rand(7, generator=torch.Generator().manual_seed(3)) + 0.5
out = torch.full((1,), float("nan"))
try:
    total[(1,)](x, out, 7)
except Exception as exc:
    print("failed:", repr(exc)[:300])
else:
    print("sum", abs(float(out) - float(x.sum())) < 1e-5)
'''


@pytest.mark.parametrize("order, want", [("fixed", "sum True"), ("unfixed", "failed:")])
def test_a_loop_to_a_run_time_bound_runs_under_triton_36s_index(tmp_path, order: str, want: str) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(script), order], capture_output=True, text=True, timeout=120,
                         cwd=root, env=dict(os.environ, PYTHONPATH=str(root)))
    assert out.stdout.startswith(want), (out.stdout, out.stderr[-2000:])
