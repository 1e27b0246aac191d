"""Triton's CPU interpreter without its redundant re-patching of ``triton.language`` (test speed only).

Each launch under ``TRITON_INTERPRET=1`` patches ``triton.language`` (and ``triton.language.core``
where the kernel's module names it) for the interpreter, and restores it when the launch ends. On
top of that, *every call of a @triton.jit helper from inside a kernel* (``_load_int4_tile``,
``_dequant_int4``, ``tl.sort``'s helpers, ...) patches the same modules again: ``inspect.getmembers``
over every member of ``tl``, ``tl.core``, ``tl.math``, the tensor class, ... and fresh but identical
replacement functions. Builtins already replaced are not builtins any more, so the second pass
changes nothing that matters; it only costs time (about half of an interpreted MoE launch here).

``install()`` skips a helper call's patch when the running launch has already patched every
``triton.language`` module the helper's globals name (a helper naming one more module is patched as
before). Kernels, launch grids and the interpreter's arithmetic are untouched: the same code runs on
the same patched modules, so every result is bit-for-bit what the unpatched interpreter gives.
Without the expected interpreter internals it does nothing (Triton as it comes).
"""

from __future__ import annotations

import inspect
import os

_installed = False


def install() -> bool:
    """Install the skip in this process (only under ``TRITON_INTERPRET=1``); True when active."""
    global _installed
    if _installed:
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    original = getattr(interp, "_patch_lang", None)
    scope_type = getattr(interp, "_LangPatchScope", None)
    if original is None or scope_type is None or not hasattr(scope_type, "restore"):
        return False
    patched: list[set[int]] = []  # per running launch: ids of the language modules it has patched

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn):
        names = langs(fn)
        if patched:  # a @jit helper called from the running kernel
            if names <= patched[-1]:
                return scope_type()  # already patched by this launch: nothing to do, nothing to restore
            patched[-1] |= names
            return original(fn)
        scope = original(fn)  # a launch (GridExecutor): restores its scope when it ends
        patched.append(names)
        restore = scope.restore

        def restore_and_end() -> None:
            try:
                restore()
            finally:
                patched.pop()

        scope.restore = restore_and_end
        return scope

    interp._patch_lang = patch_lang
    _installed = True
    return True
