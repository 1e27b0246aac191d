"""What a Triton launch compiles for, read from its arguments: the CPU tests' stand-in for Triton's
specialisation, since the interpreter compiles nothing.

Triton compiles a kernel for each combination of: a pointer's dtype and whether it is 16-byte
aligned; an integer argument's type (32 or 64 bits, by its value) and, unless
``do_not_specialize``, whether it is divisible by 16 and, in some versions, whether it equals 1
(counted here: the key may split more finely than Triton's); the constexprs and launch options. A
served launch whose key no start-up launch had compiles on a request, and its service stalls for
seconds.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Recorder", "compile_key"]


def compile_key(kernel: Any, args: tuple, options: dict[str, Any]) -> tuple:
    """The key of ``kernel[grid](*args, **options)`` (``kernel`` a ``triton.jit`` or ``gluon.jit``
    function, read for its argument names and ``do_not_specialize``)."""
    declared = kernel.kwargs.get("do_not_specialize") if hasattr(kernel, "kwargs") else kernel.do_not_specialize
    loose = set(declared or ())
    key: list[tuple] = []
    for name, value in zip(kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool):
            width = "i32" if -2**31 <= value < 2**31 else "i64" if value < 2**63 else "u64"
            key.append((name, width) if name in loose else (name, width, value == 1, value % 16 == 0))
        else:   # a float, a bool, None: typed, not specialised on its value
            key.append((name, type(value).__name__))
    return (*key, *sorted(options.items()))


class Recorder:
    """Stands in for a kernel (``monkeypatch.setattr(module, name, Recorder(kernel))``): each
    launch adds its key to ``keys`` and runs nothing."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.keys: list[tuple] = []
        self.args: list[tuple] = []

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **options: Any) -> None:
            self.args.append(args)
            self.keys.append(compile_key(self.kernel, args, options))
        return launch
