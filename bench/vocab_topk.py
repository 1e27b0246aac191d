"""What the draft's per-depth vocabulary top-k costs before its tree build, and cheaper orders.

The drafter hands ``build_trees`` float32 log-probs over the whole vocabulary (``log_softmax`` of
its logits), and the tree builder takes ``torch.topk`` of them above 128 tokens. Rows:

* ``served``: ``log_softmax(logits.float())`` then ``topk`` of the float32 log-probs;
* ``bf16_logits``: ``topk`` of the bf16 logits themselves, then each row's ``logsumexp``
  subtracted from the k values (the same order: log_softmax is a shift per row);
* ``bf16_topk``: that top-k alone; ``two_stage``: the top-k of each 4096-token chunk, then the
  top-k of those (torch's top-k over a long row is a radix select; over short rows a sort);
* ``lse_torch`` / ``lse_triton``: each row's logsumexp in float32, through a float32 copy of the
  row, or one read of the bf16 row (``row_logsumexp`` below);
* ``bf16_triton_lse`` / ``two_stage_triton_lse``: a top-k then ``row_logsumexp``;
* ``kernel``: ``kernels.vocab_topk`` (log-sum-exp, threshold, candidates and their sort in one
  program a row).

Inputs: ``random`` (N(0, 3) logits) and ``clustered`` (the same plus a bump on the lowest token
ids, where a tokenizer puts its frequent tokens), and ``crowded`` (40 of the kernel's strided groups
above all other logits: every row takes its exact path); ``candidates_max`` / ``exact_path_rows`` say how
many logits pass the kernel's threshold and how many rows take its exact path.

Each is timed in a CUDA graph (median of 20 replays) on random bf16 logits ``[batch x 15, vocab]``
at the demo's and Kimi-K2's vocabularies; ``same_tokens`` is the share of rows whose top-k token
sets agree with the served ones (ties in bf16 may break either way), ``max_abs_diff`` the largest
difference of the k log-probs.

``trees`` rows time the whole tree build as the draft served it before (float32 ``log_softmax``,
then ``build_trees``) and as it serves it now (``build_trees_from_logits``), with the share of
requests whose trees are identical and the largest difference of their sorted node scores (tied
bf16 logits may swap tokens of equal score).

Usage: python -m bench.vocab_topk [--out DIR] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bench.common import git_commit, graph_replay_us
from kernels import vocab_topk as vt
from services.draft.tree import build_trees, build_trees_from_logits

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

CHUNK = 4096


def served(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


def bf16_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, tokens = logits.topk(k, dim=-1)
    return values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True), tokens


def two_stage_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each CHUNK-token piece of a row, then of the pieces' winners."""
    *lead, vocab = logits.shape
    if vocab % CHUNK or vocab // CHUNK < 2:
        return logits.topk(k, dim=-1)
    pieces = vocab // CHUNK
    v1, i1 = logits.view(*lead, pieces, CHUNK).topk(k, dim=-1)                       # [..., P, k]
    i1 = i1 + torch.arange(pieces, device=logits.device)[:, None] * CHUNK
    v2, j = v1.reshape(*lead, pieces * k).topk(k, dim=-1)                            # [..., k]
    return v2, i1.reshape(*lead, pieces * k).gather(-1, j)


if triton is not None:
    @triton.jit
    def _row_lse_kernel(x_ptr, out_ptr, n_cols, stride_row, BLOCK: tl.constexpr):
        # Per lane a running max m and sum s of exp(x - m), one exp an element: exp(-|x - m|)
        # is exp(x - m) when x <= m, and the factor that rescales s when x is the new max.
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * stride_row
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
            e = tl.exp(-tl.abs(x - m))
            e = tl.where(x == float("-inf"), 0.0, e)          # a masked lane adds nothing
            new_max = x > m
            s = tl.where(new_max, s * tl.where(m == float("-inf"), 0.0, e) + 1.0, s + e)
            m = tl.where(new_max, x, m)
        row_max = tl.max(m, 0)
        total = tl.sum(s * tl.where(m == float("-inf"), 0.0, tl.exp(m - row_max)), 0)
        tl.store(out_ptr + row, row_max + tl.log(total))


def row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """float32 logsumexp of each row of a (bf16) ``[..., V]`` tensor, one read of it."""
    rows = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    _row_lse_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=2048, num_warps=8)
    return out.view(logits.shape[:-1])


def bf16_triton_lse(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, tokens = logits.topk(k, dim=-1)
    return values.float() - row_logsumexp(logits)[..., None], tokens


def two_stage_triton_lse(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, tokens = two_stage_topk(logits, k)
    return values.float() - row_logsumexp(logits)[..., None], tokens


VARIANTS = {
    "served": served,
    "bf16_logits": bf16_logits,
    "bf16_topk": lambda lg, k: lg.topk(k, dim=-1),
    "two_stage": two_stage_topk,
    "lse_torch": lambda lg, k: torch.logsumexp(lg.float(), dim=-1),
    "lse_triton": lambda lg, k: row_logsumexp(lg),
    "bf16_triton_lse": bf16_triton_lse,
    "two_stage_triton_lse": two_stage_triton_lse,
    "kernel": vt.vocab_topk,
}
CHECKED = ("bf16_logits", "bf16_triton_lse", "two_stage_triton_lse", "kernel")


def candidates(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the logits at or above the kernel's threshold (the k-th largest strided group max)."""
    rows = logits.reshape(-1, logits.shape[-1]).float()
    pad = -rows.shape[1] % vt.TILE
    groups = torch.nn.functional.pad(rows, (0, pad), value=float("-inf")).view(rows.shape[0], -1, vt.TILE)
    t = groups.amax(1).topk(k, dim=-1).values[:, -1:]
    return (rows >= t).sum(-1)


def make_logits(kind: str, batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(batch, 15, vocab, generator=gen, device="cuda") * 3
    if kind == "clustered":
        x += 6 * torch.exp(-torch.arange(vocab, device="cuda") / 2000.0)
    if kind == "crowded":   # 40 strided groups above all others: the kernel's exact path
        x[..., (torch.arange(vocab, device="cuda") % vt.TILE) < 40] += 100.0
    return x.to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    args = ap.parse_args()
    rows = []
    points = [("random", vocab, batch, k) for vocab in (4096, 163840) for batch in (1, 32, 128) for k in (16, 64, 128)]
    points += [("clustered", vocab, 32, k) for vocab in (4096, 163840) for k in (16, 128)] + [("crowded", 163840, 32, 128)]
    for kind, vocab, batch, k in points:
        gen = torch.Generator(device="cuda").manual_seed(vocab + batch + k)
        logits = make_logits(kind, batch, vocab, gen)
        want_v, want_t = served(logits, k)
        n = candidates(logits, k)
        row = {"input": kind, "batch": batch, "vocab": vocab, "k": k, "candidates_max": int(n.max()),
               "candidates_mean": round(n.float().mean().item(), 1), "exact_path_rows": int((n > vt.CMAX).sum())}
        lse_want = torch.logsumexp(logits.double(), dim=-1).float()
        row["lse_triton_max_abs_diff"] = (row_logsumexp(logits) - lse_want).abs().max().item()
        for name in CHECKED:
            got_v, got_t = VARIANTS[name](logits, k)
            row[f"{name}_same_tokens"] = (want_t.sort(-1).values == got_t.sort(-1).values).all(-1).float().mean().item()
            row[f"{name}_max_abs_diff"] = (want_v - got_v).abs().max().item()
            # every token's log-prob is its own: the values are those of the tokens named
            row[f"{name}_value_err"] = (got_v - torch.log_softmax(logits.float(), -1).gather(-1, got_t)).abs().max().item()
        for name, fn in VARIANTS.items():
            row[f"{name}_us"] = round(graph_replay_us([lambda lg=logits, k=k, fn=fn: fn(lg, k)], 20), 1)
        rows.append(row)
        print(" ".join(f"{key}={row[key]}" for key in ("input", "vocab", "batch", "k", "served_us", "bf16_topk_us",
                                                       "bf16_triton_lse_us", "kernel_us", "kernel_same_tokens",
                                                       "kernel_max_abs_diff", "candidates_max", "exact_path_rows")),
              flush=True)
        del logits
    trees = []
    for vocab in (4096, 163840):
        for batch in (1, 32, 128):
            for budget in (16, 64):
                gen = torch.Generator(device="cuda").manual_seed(vocab + batch + budget)
                logits = make_logits("random", batch, vocab, gen)
                roots = torch.randint(0, vocab, (batch,), device="cuda", generator=gen)
                before = build_trees(torch.log_softmax(logits.float(), dim=-1), budget, roots)
                now = build_trees_from_logits(logits, budget, roots)
                same = torch.ones(batch, dtype=torch.bool, device="cuda")
                for f in ("tokens", "parents", "depths", "sizes"):
                    same &= (getattr(before, f) == getattr(now, f)).reshape(batch, -1).all(-1)
                sorted_scores = [t.scores.sort(-1).values for t in (before, now)]
                row = {"vocab": vocab, "batch": batch, "budget": budget,
                       "same_trees": same.float().mean().item(),
                       "max_score_diff": (sorted_scores[0] - sorted_scores[1]).nan_to_num(0.0).abs().max().item(),
                       "before_us": round(graph_replay_us([lambda lg=logits, b=budget, r=roots: build_trees(
                           torch.log_softmax(lg.float(), dim=-1), b, r)], 20), 1),
                       "now_us": round(graph_replay_us([lambda lg=logits, b=budget, r=roots: build_trees_from_logits(
                           lg, b, r)], 20), 1)}
                trees.append(row)
                print("trees", " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                del logits
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab_topk.json").write_text(json.dumps({
        "benchmark": "vocab_topk", "commit": git_commit(args.commit), "gpu": torch.cuda.get_device_name(),
        "copy_gbps": None, "params": {"depth": 15, "logits": "bf16, N(0, 3) (+ a bump, see make_logits)", "timing": "CUDA graph replay, median of 20",
                                      "chunk": CHUNK, "tile": vt.TILE, "cmax": vt.CMAX, "torch": torch.__version__,
                                      "triton": triton.__version__ if triton else None},
        "rows": rows, "trees": trees}, indent=1) + "\n")


if __name__ == "__main__":
    main()
