"""Triton kernels, each beside a plain-torch reference of the same function."""

import os

# Every kernel was checked and timed with floating-point contraction on (a * b + c as one FMA), Triton's
# default up to 3.9; Triton 3.10 turns it off by default (ptxas --fmad=false), which would change their
# rounding and speed. Keep it on unless the environment says otherwise (read when a kernel compiles).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

if os.environ.get("TRITON_INTERPRET") == "1":   # tests and dry runs: the interpreter as later tritons run it
    from kernels.device import fix_interpreter_scalars

    fix_interpreter_scalars()
