"""Triton kernels, each beside a plain-torch reference of the same function."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":   # tests and dry runs: the interpreter as later tritons run it
    from kernels.device import fix_interpreter_scalars

    fix_interpreter_scalars()
