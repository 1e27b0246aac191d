"""What the draft's per-depth vocabulary top-k costs before its tree build, and a cheaper order.

The drafter hands ``build_trees`` float32 log-probs over the whole vocabulary (``log_softmax`` of
its logits), and the tree builder takes ``torch.topk`` of them above 128 tokens. Rows:

* ``served``: ``log_softmax(logits.float())`` then ``topk`` of the float32 log-probs;
* ``bf16_logits``: ``topk`` of the bf16 logits themselves, then each row's ``logsumexp``
  subtracted from the k values (the same order: log_softmax is a shift per row).

Each is timed in a CUDA graph (median of 20 replays) on random bf16 logits ``[batch x 15, vocab]``
at the demo's and Kimi-K2's vocabularies; ``same_tokens`` is the share of rows whose top-k token
sets agree (ties in bf16 may break either way), ``max_abs_diff`` the largest difference of the k
log-probs.

Usage: python -m bench.vocab_topk [--out DIR] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bench.common import git_commit, graph_replay_us


def served(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


def bf16_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, tokens = logits.topk(k, dim=-1)
    return values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    args = ap.parse_args()
    rows = []
    for vocab in (4096, 163840):
        for batch in (1, 32, 128):
            for k in (16, 64):
                gen = torch.Generator(device="cuda").manual_seed(vocab + batch + k)
                logits = (torch.randn(batch * 15, vocab, generator=gen, device="cuda") * 3).to(torch.bfloat16)
                want_v, want_t = served(logits, k)
                got_v, got_t = bf16_logits(logits, k)
                same = (want_t.sort(-1).values == got_t.sort(-1).values).all(-1).float().mean().item()
                row = {"batch": batch, "vocab": vocab, "k": k,
                       "served_us": round(graph_replay_us([lambda lg=logits, k=k: served(lg, k)], 20), 1),
                       "bf16_logits_us": round(graph_replay_us([lambda lg=logits, k=k: bf16_logits(lg, k)], 20), 1),
                       "same_tokens": same, "max_abs_diff": (want_v - got_v).abs().max().item()}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del logits
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab_topk.json").write_text(json.dumps({
        "benchmark": "vocab_topk", "commit": git_commit(args.commit), "gpu": torch.cuda.get_device_name(),
        "copy_gbps": None, "params": {"depth": 15, "logits": "bf16, N(0, 3)", "timing": "CUDA graph replay, median of 20",
                                      "torch": torch.__version__},
        "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
