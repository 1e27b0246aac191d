"""What the draft's per-depth vocabulary top-k costs before its tree build, as served and before.

Before, the drafter handed ``build_trees`` float32 log-probs over the whole vocabulary
(``log_softmax`` of its logits) and the tree builder took ``torch.topk`` of them above 128 tokens.
Now it hands over its logits, and ``build_trees_from_logits`` takes ``kernels.vocab_topk``. Rows:

* ``before``: ``log_softmax(logits.float())`` then ``topk`` of the float32 log-probs;
* ``bf16_logits``: ``topk`` of the bf16 logits themselves, then each row's ``torch.logsumexp`` of
  a float32 copy subtracted from the k values (the same order: log_softmax is a shift per row);
* ``bf16_topk``: that top-k alone; ``lse_torch`` / ``lse_triton``: each row's log-sum-exp in
  float32, through a float32 copy of the row, or one read of the bf16 row
  (``kernels.vocab_topk.row_logsumexp``);
* ``served``: ``kernels.vocab_topk.vocab_topk``: the top-k of the bf16 logits less
  ``row_logsumexp``.

Each is timed in a CUDA graph (median of 20 replays) on bf16 logits ``[batch, 15, vocab]`` at the
demo's and Kimi-K2's vocabularies: ``random`` (N(0, 3)) and ``clustered`` (the same plus a bump on
the lowest token ids, where a tokenizer puts its frequent tokens). ``*_same_tokens`` is the share
of rows whose top-k token sets agree with ``before``'s (ties in bf16 may break either way),
``*_max_abs_diff`` the largest difference of the k log-probs, ``*_value_err`` the largest
difference of a value from its own token's log-prob.

``trees`` rows time the whole tree build as the draft served it before (float32 ``log_softmax``,
then ``build_trees``) and as it serves it now (``build_trees_from_logits``), with the share of
requests whose trees are identical and the largest difference of their sorted node scores (tied
bf16 logits may swap tokens of equal score).

Usage: python -m bench.vocab_topk [--out FILE] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.common import add_out_argument, copy_gbps_on, git_commit, graph_replay_us
from kernels import vocab_topk as vt
from services.draft.tree import build_trees, build_trees_from_logits


def bf16_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, tokens = logits.topk(k, dim=-1)
    return values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True), tokens


VARIANTS = {
    "before": vt.vocab_topk_reference,   # what the draft served before: log_softmax, then topk
    "bf16_logits": bf16_logits,
    "bf16_topk": lambda lg, k: lg.topk(k, dim=-1),
    "lse_torch": lambda lg, k: torch.logsumexp(lg.float(), dim=-1),
    "lse_triton": lambda lg, k: vt.row_logsumexp(lg),
    "served": vt.vocab_topk,
}
CHECKED = ("bf16_logits", "served")


def make_logits(kind: str, batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(batch, 15, vocab, generator=gen, device="cuda") * 3
    if kind == "clustered":
        x += 6 * torch.exp(-torch.arange(vocab, device="cuda") / 2000.0)
    return x.to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "vocab_topk")
    ap.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    args = ap.parse_args()
    rows = []
    points = [("random", vocab, batch, k) for vocab in (4096, 163840) for batch in (1, 32, 128) for k in (16, 64, 128)]
    points += [("clustered", vocab, 32, k) for vocab in (4096, 163840) for k in (16, 128)]
    for kind, vocab, batch, k in points:
        gen = torch.Generator(device="cuda").manual_seed(vocab + batch + k)
        logits = make_logits(kind, batch, vocab, gen)
        want_v, want_t = vt.vocab_topk_reference(logits, k)
        row = {"input": kind, "batch": batch, "vocab": vocab, "k": k}
        lse_want = torch.logsumexp(logits.double(), dim=-1).float()
        row["lse_triton_max_abs_diff"] = (vt.row_logsumexp(logits) - lse_want).abs().max().item()
        for name in CHECKED:
            got_v, got_t = VARIANTS[name](logits, k)
            row[f"{name}_same_tokens"] = (want_t.sort(-1).values == got_t.sort(-1).values).all(-1).float().mean().item()
            row[f"{name}_max_abs_diff"] = (want_v - got_v).abs().max().item()
            row[f"{name}_value_err"] = (got_v - torch.log_softmax(logits.float(), -1).gather(-1, got_t)).abs().max().item()
        for name, fn in VARIANTS.items():
            row[f"{name}_us"] = round(graph_replay_us([lambda lg=logits, k=k, fn=fn: fn(lg, k)], 20), 1)
        rows.append(row)
        print(" ".join(f"{key}={row[key]}" for key in ("input", "vocab", "batch", "k", "before_us", "bf16_topk_us",
                                                       "lse_triton_us", "served_us", "served_same_tokens",
                                                       "served_max_abs_diff")), flush=True)
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
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": out.stem, "commit": git_commit(args.commit), "gpu": torch.cuda.get_device_name(),
        "copy_gbps": copy_gbps_on("cuda"), "params": {"depth": 15, "logits": "bf16, N(0, 3) (+ a bump, see make_logits)",
                                      "timing": "CUDA graph replay, median of 20", "lse_block": vt.BLOCK,
                                      "torch": torch.__version__, "triton": vt.triton.__version__ if vt.triton else None},
        "rows": rows, "trees": trees}, indent=1) + "\n")


if __name__ == "__main__":
    main()
