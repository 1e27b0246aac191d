"""The Triton tree builder (``build_trees(..., backend="triton")``) selects what the torch one does.

Runs the kernel in Triton's interpreter on machines without a GPU (tests/conftest.py sets
TRITON_INTERPRET=1 before triton's first import).
"""

from __future__ import annotations

import os
import sys
import threading

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
from tests.launch_keys import Recorder, compile_key  # noqa: E402

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
    not KERNEL_RUNNABLE, reason="the kernel needs a GPU or TRITON_INTERPRET=1 before triton's first import "
    "(tests/conftest.py sets it unless the environment sets it otherwise)"
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


FIELDS = ("tokens", "parents", "depths", "scores", "sizes")


@needs_kernel
@pytest.mark.parametrize(
    "budget,depth,vocab,num_req,ties",
    # vocab == budget (the drafter's top-k handed over) and > budget (the kernel's top-k picks);
    # `ties`: log-probs on a 0.5 grid, so many candidates tie on score and the tie-break decides.
    # Big budgets get few depths: the interpreter's sort costs ~1 s per depth at budget 64.
    [
        (1, 15, 1, 3, False), (1, 15, 300, 2, True), (4, 3, 1, 2, False),  # vocab 1: C_PAD == B_PAD
        (2, 15, 2, 3, False), (2, 15, 40, 2, True),
        (5, 15, 5, 3, False), (5, 15, 300, 3, True),
        (8, 15, 8, 2, False), (8, 7, 50, 3, True),
        (16, 9, 16, 2, False), (16, 5, 100, 2, True),
        (33, 4, 33, 2, False), (33, 3, 200, 2, True),
        (64, 2, 64, 2, False), (64, 2, 300, 2, True),
    ],
)
def test_triton_matches_reference_with_ties(budget: int, depth: int, vocab: int, num_req: int, ties: bool) -> None:
    """Score ties, a vocabulary equal to the budget, depth beyond the budget: still the best prefixes."""
    gen = torch.Generator().manual_seed(budget * 7919 + depth * 31 + vocab)
    logprobs = random_logprobs(gen, num_req, depth, vocab)
    if ties:
        logprobs = torch.round(logprobs * 2) / 2  # still <= 0; sums of the grid add exactly
    if vocab > 2:
        logprobs[-1, :, vocab // 2 :] = float("-inf")  # impossible tokens are never selected
    roots = torch.randint(0, vocab, (num_req,), generator=gen)
    out = tb.tree_build_triton(logprobs.to(DEVICE), budget, roots.to(DEVICE))
    got = tb.TreeBuildOutput(*(getattr(out, name).cpu() for name in FIELDS))
    want = build_trees(logprobs, budget, roots, backend="torch")
    # Under ties torch.topk may pick other tied pairs than the key's tie-break (lower flat index),
    # so then only the per-slot depths and scores, and the sizes, must match; without ties, all.
    for name in FIELDS if not ties else ("depths", "scores", "sizes"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    if not ties:  # -0.0 and 0.0 compare equal: the sign bits must agree too
        assert torch.equal(got.scores.view(torch.int32), want.scores.view(torch.int32)), "scores (bits)"
    for r in range(num_req):
        paths = tree_paths(got, r)
        assert len(paths) == int(got.sizes[r]) - 1  # distinct prefixes, parents before children
        ref = build_tree_heapq(logprobs[r], budget)
        if not ties:
            assert paths == set(ref)
        else:  # the same scores, and each node's score is its prefix's (exact on the 0.5 grid)
            lp = logprobs[r].double()
            scores = sorted(sum(lp[d, t].item() for d, t in enumerate(p)) for p in paths)
            assert scores == sorted(sum(lp[d, t].item() for d, t in enumerate(p)) for p in ref)
            assert sorted(got.scores[r, 1 : int(got.sizes[r])].tolist()) == scores


@needs_kernel
@pytest.mark.parametrize("vocab", [128, 129])  # ranked in the kernel / by torch.topk first
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_input_ranking_paths_agree(vocab: int, dtype: torch.dtype) -> None:
    """Rows with padded strides, a near-certain chain, a flat row: both top-k paths agree."""
    assert (vocab <= tb.SORT_VOCAB_MAX) == (vocab == 128)
    gen = torch.Generator().manual_seed(vocab)
    num_req, depth, budget = 3, 4, 16
    logprobs = random_logprobs(gen, num_req, depth, vocab)
    # Request 1 is nearly certain at every depth (a deep chain); request 2 is flat (wide, shallow).
    logprobs[1] = torch.log_softmax(torch.randn(depth, vocab, generator=gen) + 30.0 * (torch.arange(vocab) == 7), -1)
    logprobs[2] = torch.log_softmax(0.05 * torch.randn(depth, vocab, generator=gen), -1)
    logprobs = logprobs.to(dtype)
    # Unit stride along the vocabulary, padded rows: the kernel reads the depth and request strides.
    padded = torch.empty(num_req, depth + 2, vocab + 3, dtype=dtype, device=DEVICE)[:, :depth, :vocab]
    padded.copy_(logprobs)
    roots = torch.randint(0, vocab, (num_req,), generator=gen)
    out = tb.tree_build_triton(padded, budget, roots.to(DEVICE))
    got = tb.TreeBuildOutput(*(getattr(out, name).cpu() for name in FIELDS))
    want = build_trees(logprobs.float(), budget, roots, backend="torch")
    # bf16 rounds log-probs onto few values: tied tokens may differ (the tie-breaks differ).
    ties = dtype == torch.bfloat16
    for name in FIELDS if not ties else ("depths", "scores", "sizes"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert int(got.depths[1].max()) == depth  # the chain reaches the last depth
    if not ties:
        for r in range(num_req):
            assert tree_paths(got, r) == set(build_tree_heapq(logprobs[r], budget))


@needs_kernel
def test_triton_reads_inputs_of_any_strides() -> None:
    """Log-probs whose vocabulary stride is not 1 (a permuted view, ranked in the kernel), and a
    handed-over top-k (``top=``) as non-contiguous views: the torch builder's trees."""
    gen = torch.Generator().manual_seed(21)
    lp = random_logprobs(gen, 2, 3, 40)
    strided = lp.permute(0, 2, 1).contiguous().permute(0, 2, 1)   # the same values, stride(-1) == depth
    roots = torch.randint(0, 40, (2,), generator=gen)
    want = build_trees(lp, 8, roots, backend="torch")
    out = tb.tree_build_triton(strided.to(DEVICE), 8, roots.to(DEVICE))
    for name in FIELDS:
        assert torch.equal(getattr(out, name).cpu(), getattr(want, name)), name
    big = random_logprobs(gen, 2, 3, 300)
    roots = torch.randint(0, 300, (2,), generator=gen)
    v, t = big.topk(8, dim=-1)
    top = tuple(x.permute(0, 2, 1).contiguous().permute(0, 2, 1).to(DEVICE) for x in (v, t))
    assert not top[0].is_contiguous()
    want = build_trees(big, 8, roots, backend="torch")
    out = tb.tree_build_triton(big.to(DEVICE), 8, roots.to(DEVICE), top=top)
    for name in FIELDS:
        assert torch.equal(getattr(out, name).cpu(), getattr(want, name)), name


@needs_kernel
@pytest.mark.parametrize("case", ["chain_past_budget", "certain_then_flat"])
def test_triton_pruning_bound_is_tight(case: str) -> None:
    """Trees whose selected nodes sit exactly on the pruning bound: one step tighter loses them.

    * A near-certain chain deeper than the budget: its last selected node is the pair (0, 0) at
      level budget - 1, where (i+1)(j+2) + d - 1 == budget.
    * A certain first token, then a flat depth: level 1 needs rank budget - 2 (all but the root's
      child), the last rank ``keep = budget - d`` admits.
    """
    budget, vocab = 8, 8
    gen = torch.Generator().manual_seed(17)
    if case == "chain_past_budget":
        depth = 12
        logits = torch.randn(depth, vocab, generator=gen) + 40.0 * (torch.arange(vocab) == 3)
    else:
        depth = 2
        logits = torch.stack([40.0 * (torch.arange(vocab) == 5).float(), 0.01 * torch.randn(vocab, generator=gen)])
    logprobs = torch.log_softmax(logits, -1)[None]  # [1, depth, vocab]
    roots = torch.tensor([1])
    out = tb.tree_build_triton(logprobs.to(DEVICE), budget, roots.to(DEVICE))
    got = tb.TreeBuildOutput(*(getattr(out, name).cpu() for name in FIELDS))
    want = build_trees(logprobs, budget, roots, backend="torch")
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert tree_paths(got, 0) == set(build_tree_heapq(logprobs[0], budget))
    if case == "chain_past_budget":
        assert int(got.depths[0].max()) == budget  # the chain's node at depth `budget` is kept
    else:
        assert int((got.depths[0] == 2).sum()) == budget - 1  # every depth-2 node but one


def test_candidate_pairs_follow_the_pruning_bound() -> None:
    """Exactly the pairs (i, j) with (i+1)(j+2) <= budget and j < k, padded to a power of two."""
    for budget, k in ((1, 1), (2, 2), (8, 8), (64, 64), (64, 5), (128, 128)):
        ci, cj = tb.candidate_pairs(budget, k, torch.device("cpu"))
        got = {(int(i), int(j)) for i, j in zip(ci, cj) if i >= 0}
        want = {(i, j) for i in range(budget) for j in range(k) if (i + 1) * (j + 2) <= budget}
        assert got == want
        n = ci.numel()
        assert n & (n - 1) == 0 and n >= len(want) and n >= budget
        assert bool((cj[ci < 0] == -1).all())


def test_budgets_share_ten_compiled_kernels(monkeypatch) -> None:
    """A budget's launch compiles what its pads budget's does, so budgets 1..128 compile 10 kernels
    (a budget compiled on first use stalled its draft replica for seconds)."""
    launches = Recorder(tb._tree_build_kernel)
    monkeypatch.setattr(tb, "_tree_build_kernel", launches)
    for vocab in (64, 4096):
        launches.keys.clear()
        launches.args.clear()
        for budget in range(1, 129):
            logprobs = torch.log_softmax(torch.randn(2, 15, vocab), dim=-1)
            tb.tree_build_triton(logprobs, budget, torch.zeros(2, dtype=torch.int64))
        kernels = {args[-1]: key for args, key in zip(launches.args, launches.keys)}   # the last argument is BUDGET
        assert {tb.pads_budget(b) for b in range(1, 129)} == {1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128}
        for budget, key in kernels.items():
            assert key == kernels[tb.pads_budget(budget)], (vocab, budget)
        assert len(set(kernels.values())) == (9 if vocab == 64 else 10), vocab   # 64 tokens: pads 64-128 alike


def test_the_draft_warm_up_compiles_every_shared_kernel(monkeypatch) -> None:
    """warm_up_kernels (the draft's start-up) launches every kernel budgets 1..128 need, so none
    compiles on a request: the first alone, the others from a thread pool."""
    launched: dict[int, tuple] = {}
    threads: dict[int, int] = {}

    kernel = tb._tree_build_kernel

    class Launch:
        def __getitem__(self, grid):
            def run(*args, **options):
                launched[args[-1]] = compile_key(kernel, args, options)   # the last argument is BUDGET
                threads[args[-1]] = threading.get_ident()
            return run

    monkeypatch.setattr(tb, "_tree_build_kernel", Launch())
    called = tb.warm_up_kernels(15, 4096, "cpu")
    assert called == sorted(launched) == sorted({tb.pads_budget(b) for b in range(1, 129)})
    assert len(set(launched.values())) == 10
    first, *rest = called
    assert threads[first] == threading.get_ident()
    assert all(threads[b] != threading.get_ident() for b in rest)


def test_a_depth_cap_runs_the_kernel_of_the_full_depth(monkeypatch) -> None:
    """A request near its context end caps its tree's depth: the cap is a run-time value, so it
    launches the kernel the start-up compiled (a new one would stall its replica for seconds)."""
    seen: dict[tuple[int, int | None], tuple] = {}
    kernel = tb._tree_build_kernel

    class Launch:
        def __getitem__(self, grid):
            def run(*args, **options):
                seen[(budget, cap)] = compile_key(kernel, args, options)
            return run

    monkeypatch.setattr(tb, "_tree_build_kernel", Launch())
    for budget in (1, 5, 16, 100, 128):
        for cap in (None, *range(1, 16)):
            logprobs = torch.log_softmax(torch.randn(2, 15, 4096), dim=-1)
            tb.tree_build_triton(logprobs, budget, torch.zeros(2, dtype=torch.int64), max_depth=cap)
        assert len({seen[(budget, cap)] for cap in (None, *range(1, 16))}) == 1, budget


@pytest.fixture
def no_launch(monkeypatch) -> list[int]:
    """The kernel replaced by a stub that notes each launch's budget: the host's checks alone."""
    launched: list[int] = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **options: launched.append(args[-1])   # the last argument is BUDGET

    monkeypatch.setattr(tb, "_tree_build_kernel", Launch())
    return launched


@pytest.mark.parametrize("budget", [0, 129, 200])
def test_a_budget_outside_1_to_128_is_refused(no_launch: list[int], budget: int) -> None:
    """The kernel's pads and registers are sized for 128 nodes at most."""
    logprobs = random_logprobs(torch.Generator().manual_seed(budget), 1, 2, 8)
    with pytest.raises(AssertionError, match="budget must be in 1..128"):
        tb.tree_build_triton(logprobs, budget, torch.zeros(1, dtype=torch.int64))
    assert no_launch == []


def test_a_depth_cap_of_zero_is_refused(no_launch: list[int]) -> None:
    logprobs = random_logprobs(torch.Generator().manual_seed(5), 2, 3, 8)
    with pytest.raises(AssertionError, match="at least one depth"):
        tb.tree_build_triton(logprobs, 8, torch.zeros(2, dtype=torch.int64), max_depth=0)
    assert no_launch == []


def test_top_is_refused_for_a_vocabulary_the_kernel_ranks(no_launch: list[int]) -> None:
    """At or below SORT_VOCAB_MAX tokens the kernel ranks each row itself: a caller's ``top`` would
    be ignored, and written over in place."""
    logprobs = random_logprobs(torch.Generator().manual_seed(6), 2, 3, 40)
    values, tokens = logprobs.topk(8, dim=-1)
    with pytest.raises(AssertionError, match="top: for vocabularies above"):
        tb.tree_build_triton(logprobs, 8, torch.zeros(2, dtype=torch.int64),
                             top=(values.contiguous(), tokens.contiguous()))
    assert no_launch == []


def test_float64_log_probs_and_a_top_not_in_float32_are_refused(no_launch: list[int]) -> None:
    """The kernel scores in float32: float64 inputs belong to the torch builder, and a bf16 ``top``
    would round the scores (and compile another kernel)."""
    gen = torch.Generator().manual_seed(7)
    with pytest.raises(AssertionError, match="dtype"):
        tb.tree_build_triton(random_logprobs(gen, 2, 3, 40).double(), 8, torch.zeros(2, dtype=torch.int64))
    big = random_logprobs(gen, 2, 3, 300)
    values, tokens = big.topk(8, dim=-1)
    with pytest.raises(AssertionError):
        tb.tree_build_triton(big, 8, torch.zeros(2, dtype=torch.int64), top=(values.to(torch.bfloat16), tokens))
    assert no_launch == []


@needs_kernel
def test_top_of_the_depths_a_budget_reaches_without_a_cap() -> None:
    """A tree of ``budget`` nodes is at most ``budget`` deep: with more depths than that and no
    ``max_depth``, ``top`` covers the first ``budget`` depths and the trees are the torch builder's."""
    gen = torch.Generator().manual_seed(20)
    budget, depth_limit, vocab = 4, 6, 300
    logprobs = random_logprobs(gen, 2, depth_limit, vocab)
    roots = torch.randint(0, vocab, (2,), generator=gen)
    values, tokens = logprobs[:, :budget].topk(budget, dim=-1)
    got = tb.tree_build_triton(logprobs.to(DEVICE), budget, roots.to(DEVICE),
                               top=(values.contiguous().to(DEVICE), tokens.contiguous().to(DEVICE)))
    want = build_trees(logprobs, budget, roots, backend="torch")
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f


@needs_kernel
def test_scores_one_ulp_apart_rank_in_float_order() -> None:
    """The packed sort keys keep every bit of a score: two log-probs one ulp apart, both above the
    rest of their row, rank as floats do in the kernel's row sort and in its level and global sorts."""
    gen = torch.Generator().manual_seed(35)
    num_req, depth, vocab, budget = 2, 3, 8, 3
    logprobs = random_logprobs(gen, num_req, depth, vocab)
    for r in range(num_req):
        for d in range(depth):
            row_max = logprobs[r, d].max().view(torch.int32)
            hi = ((row_max - 2) & ~1).view(torch.float32)              # an even bit pattern above the row's max
            lo = (hi.view(torch.int32) + 1).view(torch.float32)       # one ulp below it
            assert float(logprobs[r, d].max()) < float(lo) < float(hi) < 0
            logprobs[r, d, (r + d) % vocab], logprobs[r, d, (r + d + 3) % vocab] = hi, lo
    roots = torch.randint(0, vocab, (num_req,), generator=gen)
    got = tb.tree_build_triton(logprobs.to(DEVICE), budget, roots.to(DEVICE))
    want = build_trees(logprobs, budget, roots, backend="torch")
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
    got_cpu = tb.TreeBuildOutput(*(getattr(got, f).cpu() for f in FIELDS))
    for r in range(num_req):
        assert tree_paths(got_cpu, r) == set(build_tree_heapq(logprobs[r], budget))


@needs_kernel
@pytest.mark.parametrize("budget,cap,vocab", [(8, 2, 50), (16, 3, 16), (5, 1, 300)])
def test_a_depth_cap_builds_the_trees_of_the_capped_rows(budget: int, cap: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(budget * 31 + cap)
    logprobs = random_logprobs(gen, 3, 5, vocab)
    roots = torch.randint(0, vocab, (3,), generator=gen)
    want = build_trees(logprobs[:, :cap], budget, roots, backend="torch")
    assert all(torch.equal(getattr(build_trees(logprobs, budget, roots, backend="torch", max_depth=cap), f),
                           getattr(want, f)) for f in FIELDS)
    got = build_trees(logprobs.to(DEVICE), budget, roots.to(DEVICE), backend="triton", max_depth=cap)
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
    assert int(got.depths.max()) <= cap


@needs_kernel
@pytest.mark.parametrize("budget,depth,vocab,cap",
                         [(1, 3, 300, None), (9, 4, 1000, None), (16, 5, 300, 3), (64, 2, 600, None)])
def test_trees_from_logits_are_those_of_their_log_softmax(budget: int, depth: int, vocab: int,
                                                          cap: int | None) -> None:
    """The draft's path: unnormalised logits (well above 0), each depth's top-k log-probs taken by
    kernels.vocab_topk (torch's top-k less each row's log-sum-exp), then the tree kernel. The same
    trees as the torch builder on ``log_softmax(logits)`` and as heapq; scores to float32 rounding."""
    from services.draft.tree import build_trees_from_logits
    gen = torch.Generator().manual_seed(budget * 131 + vocab)
    logits = torch.randn(3, depth, vocab, generator=gen) * (1 + 3 * torch.rand(3, depth, 1, generator=gen)) + 20
    roots = torch.randint(0, vocab, (3,), generator=gen)
    logprobs = torch.log_softmax(logits, dim=-1)
    want = build_trees(logprobs, budget, roots, backend="torch", max_depth=cap)
    got = build_trees_from_logits(logits.to(DEVICE), budget, roots.to(DEVICE), backend="triton", max_depth=cap)
    for f in ("tokens", "parents", "depths", "sizes"):
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
    assert torch.allclose(got.scores.cpu(), want.scores, atol=1e-5, rtol=0)
    on_cpu = build_trees_from_logits(logits, budget, roots, backend="torch", max_depth=cap)
    assert all(torch.equal(getattr(on_cpu, f), getattr(want, f)) for f in FIELDS)
    for r in range(3):
        assert tree_paths(got, r) == set(build_tree_heapq(logprobs[r, :cap], budget))


@pytest.mark.parametrize("dtype, vocab, warm_budgets", [
    (torch.bfloat16, 4096, (8, 16, 32)), (torch.float16, 4096, (8, 16, 32)), (torch.float32, 4096, (8, 16, 32)),
    (torch.bfloat16, 1000, (16,)),   # `draft.warmup_budgets` set to 16 alone
])
def test_trees_from_logits_launch_only_kernels_the_start_up_compiled(monkeypatch, dtype: torch.dtype, vocab: int,
                                                                     warm_budgets: tuple[int, ...]) -> None:
    """The draft's start-up (``warm_up_tree_builds``, as ``DraftEngine.warm_up`` calls it) compiles
    every kernel that trees from the drafter's logits launch: every budget 1..128, batch size and
    depth cap. The tree kernel used to get the logits (bf16) in the place of the float32 log-probs
    it was warmed up with, an argument it does not read: each pads budget compiled anew on its
    first request (the soak's first requests waited 23 s on an H200). Where the vocabulary is not a
    multiple of 16, a capped request's rows have an outer stride (cap x V) the warm-up may not have
    had (divisible by 16 or not): it is not specialised on."""
    from kernels import vocab_topk as vt
    from services.draft import tree
    from services.draft.tree import build_trees_from_logits, warm_up_tree_builds
    monkeypatch.setattr(tree, "_backend", lambda scores, backend: "triton")   # the GPU's choice, here
    trees, lse = Recorder(tb._tree_build_kernel), Recorder(vt._row_lse_kernel)
    monkeypatch.setattr(tb, "_tree_build_kernel", trees)
    monkeypatch.setattr(vt, "_row_lse_kernel", lse)
    # The kernel path for these CPU tensors on a GPU machine too (the interpreter's choice): the
    # Recorders launch nothing, so where they run does not matter.
    monkeypatch.setattr(vt, "interpreted", lambda: True)
    depth = 15
    warm_up_tree_builds(depth, vocab, dtype, "cpu", 128, budgets=warm_budgets, batch_sizes=(1, 4))
    compiled_trees, compiled_lse = set(trees.keys), set(lse.keys)
    assert len(compiled_trees) == 10 and len(compiled_lse) == 1
    trees.keys.clear()
    lse.keys.clear()
    gen = torch.Generator().manual_seed(7)
    for budget in range(1, 129):
        for r, cap in ((1, None), (3, None), (2, 1 + budget % depth), (1, 1 + budget % depth)):
            logits = (torch.randn(r, depth, vocab, generator=gen) * 3 + 5).to(dtype)
            build_trees_from_logits(logits, budget, torch.zeros(r, dtype=torch.int64), backend="triton", max_depth=cap)
    assert len(trees.keys) == 4 * 128 and set(trees.keys) <= compiled_trees
    assert set(lse.keys) <= compiled_lse
