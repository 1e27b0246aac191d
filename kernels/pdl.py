"""Programmatic dependent launch (PDL) for the step's Triton and Gluon kernels.

Why: a Kimi-K2 decode step is about 1100 short launches (``bench/results/k2-profile-*.json``), most
of them a few microseconds long. In a CUDA graph each still starts only once its predecessor has
drained, and its first loads then pay the full memory latency. A kernel launched with PDL (sm_90
and later) may be scheduled while its predecessor finishes: its programs become resident and run
up to ``gdc_wait``, which returns once the predecessor has completed and its writes are visible.
On a Kimi-K2 per-rank chain of dense projections, norms and SiLU·mul (61 layers of nine
launches, ``bench/pdl_probe.py``; H200) PDL took 2.46 ms to 2.10 at one token and 2.64 to 2.29 at
17, bit for bit the same outputs. Asking L2 for each projection's weights before the wait
(``prefetch.global.L2``) gained nothing on top (2.11 / 2.30 ms) and was dropped. With every kernel
of the K2 slice's step on it (``bench/results/pdl_ab-765c3bf.json``): AR at batch 1 5.58 -> 4.99 ms,
a budget-16 verify 8.12 -> 7.37, the same logits bit for bit.

The contract every kernel launched with ``launch_pdl=enabled(...)`` keeps:
* every program calls ``grid_sync`` (or ``gdc_wait`` itself) before it reads or writes any
  activation, workspace or counter memory, and before any early exit. Then a kernel's completion
  implies its predecessor's, so the chain of waits stays transitive for the kernel after it;
* ``grid_sync`` also lets the next kernel launch at once (``gdc_launch_dependents``): its programs
  wait in their own ``grid_sync`` for this one to finish.
Kernels launched without PDL (torch's, cuBLAS's) keep full stream order; a PDL kernel after one of
them starts after it completes, as without PDL. A kernel built with ``PDL`` may still be launched
plainly: its wait then returns at once, and it still lets the next kernel launch early. The tree
attention's merge is, after a split launch that holds most SMs (``tree_mla.merge_launches_early``):
launched early, its programs would sit on the few SMs that launch leaves free and run there.

``PDL`` is the switch (``DDTREE_PDL=0`` turns it off; ``bench/k2_ab.py --switch pdl`` A/Bs it). Off
CUDA, under the interpreter, before sm_90 or where the installed Triton lacks the instructions,
``enabled`` is False and the kernels compile without them.
"""

from __future__ import annotations

import os

import torch

from kernels.device import capability_major, interpreted

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - only where triton is not installed
    triton = None
    tl = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - a Triton without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None
try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except Exception:  # pragma: no cover - depends on the installed Triton
    gluon = None

__all__ = ["ENV", "PDL", "enabled", "grid_sync", "grid_sync_gluon", "switch_from_env"]

ENV = "DDTREE_PDL"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch_from_env() -> bool:
    """``ENV`` read as the settings read a boolean; another word is refused naming the variable
    (`false` left PDL on without a word). The services call it at start-up; at import, below, a
    word it refuses keeps the default, so that importing a kernel never fails."""
    value = os.environ.get(ENV, "").strip()
    if not value or value.lower() in _ON:
        return True
    if value.lower() in _OFF:
        return False
    raise ValueError(f"{ENV}={value!r}: must be 0 (off) or 1 (on) (or false / true, no / yes, off / on)")


try:
    PDL = switch_from_env()
except ValueError:
    PDL = True


def enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: the switch on, Triton's grid dependency control
    present, a CUDA device of compute capability 9.0 or later, not the interpreter."""
    if not PDL or gdc_wait is None or device.type != "cuda" or interpreted():
        return False
    return capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


if triton is not None:

    @triton.jit
    def grid_sync(PDL: tl.constexpr):
        """Wait until the previous kernel's writes are visible, and let the next kernel launch."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()


if gluon is not None:

    @gluon.jit
    def grid_sync_gluon(PDL: gl.constexpr):
        """``grid_sync`` for the Gluon kernels (a Gluon kernel calls Gluon functions only)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
