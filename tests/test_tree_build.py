"""The Triton tree builder (``build_trees(..., backend="triton")``) selects what the torch one does.

Runs the kernel in Triton's interpreter on machines without a GPU (tests/conftest.py sets
TRITON_INTERPRET=1 before triton's first import).
"""

from __future__ import annotations

import os
import sys

import torch

# The interpreter needs the variable before triton's first import: triton's own @jit library
# functions (tl.sort, tl.cdiv, ...) are interpreted only if it was set then. Set it only while
# triton is still unimported, so no later module gets a mix of interpreted and compiled functions.
INTERPRET_PRESET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_FRESH = "triton" not in sys.modules
if not torch.cuda.is_available() and TRITON_FRESH:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from services.draft.tree import build_tree_heapq, build_trees, tree_paths  # noqa: E402

try:
    from kernels import tree_build as tb
except ImportError:  # pragma: no cover
    tb = None

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
KERNEL_RUNNABLE = tb is not None and tb.triton is not None and (
    CUDA or ((TRITON_FRESH or INTERPRET_PRESET) and type(tb._tree_build_kernel).__name__ == "InterpretedFunction")
)
needs_kernel = pytest.mark.skipif(
    not KERNEL_RUNNABLE, reason="triton was set up before TRITON_INTERPRET=1; the subprocess test runs these"
)


def random_logprobs(gen: torch.Generator, num_req: int, depth: int, vocab: int) -> torch.Tensor:
    scale = 0.5 + 4.0 * torch.rand(num_req, depth, 1, generator=gen)
    return torch.log_softmax(torch.randn(num_req, depth, vocab, generator=gen) * scale, dim=-1)  # [R, D, V] fp32


@needs_kernel
@pytest.mark.parametrize(
    "depth,vocab,budget,num_req",
    # The interpreter sorts slowly (~1 s per depth at budget 64-128), so the big budgets get few
    # depths and one request; the GPU benchmark checks budget 64-128 at depth 15 against heapq.
    [(1, 50, 8, 3), (3, 5, 16, 2), (4, 2, 32, 1), (4, 1000, 1, 3), (15, 300, 9, 1), (3, 300, 64, 1), (2, 40, 128, 1)],
)
def test_triton_matches_torch_builder(depth: int, vocab: int, budget: int, num_req: int) -> None:
    gen = torch.Generator().manual_seed(depth * 7919 + vocab * 31 + budget)
    logprobs = random_logprobs(gen, num_req, depth, vocab)
    if vocab > 2:
        logprobs[0, :, vocab // 2 :] = float("-inf")  # impossible tokens are never selected
    roots = torch.randint(0, vocab, (num_req,), generator=gen)
    want = build_trees(logprobs, budget, roots, backend="torch")
    got = build_trees(logprobs.to(DEVICE), budget, roots.to(DEVICE), backend="triton")
    for name in ("tokens", "parents", "depths", "scores", "sizes"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    for r in range(num_req):
        assert tree_paths(got, r) == set(build_tree_heapq(logprobs[r], budget))
