"""Greedy DDTree against greedy AR on the demo model in bf16, with the logits rounded to bf16 or not.

T-lossless asks greedy DDTree output to equal greedy autoregressive output token for token. In
bf16 an AR step and a tree step run other kernels and round differently upstream of the logits;
where the top two logits round to the same bf16 value, argmax breaks the tie by whatever landed
on which side. `services.verifier.model.float32_logits` keeps the lm_head's float32 sums. This
runs the in-process engine (`bench.split_overhead.InProcess`, CUDA graphs as served) once per
setting of `LOGITS_FLOAT32`, on held-out prompts, AR and each budget, and counts the runs whose
tokens equal the AR run's, with the first token where they part.

    python -m bench.logits_ab [--prompts 8] [--tokens 300] [--budgets 8 16 32] [--commit SHA]
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from bench.common import git_commit

__all__ = ["main"]

MODEL = Path("models/demo")


def _first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where the two differ (the shorter's length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _variant(float32: bool, prompts: list[list[int]], tokens: int, budgets: list[int]) -> list[dict]:
    import services.verifier.model as model_mod
    from bench.split_overhead import InProcess

    model_mod.LOGITS_FLOAT32 = float32   # read as the engine's graphs are captured: a fresh engine
    engine = InProcess(MODEL, "cuda", "bfloat16")
    rows = []
    for i, prompt in enumerate(prompts):
        ar = engine.generate(prompt, tokens, 0).tokens
        for budget in budgets:
            run = engine.generate(prompt, tokens, budget)
            diff = _first_diff(ar, run.tokens)
            rows.append({"logits": "float32" if float32 else "bf16", "prompt": i, "budget": budget,
                         "equal_to_ar": diff is None, "first_diff": diff, "tokens": len(run.tokens),
                         "mean_acceptance": round(len(run.tokens[1:]) / max(run.steps, 1), 3)})
            print(rows[-1], flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    from bench.split_overhead import load_prompts

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=60)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--commit", default="")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    prompts = [pr[:args.prompt_tokens] for pr in load_prompts(MODEL, args.prompts)]
    rows = _variant(False, prompts, args.tokens, args.budgets) + _variant(True, prompts, args.tokens, args.budgets)
    commit = git_commit(args.commit or None)
    out = Path(args.out or f"bench/results/logits-ab-{commit}.json")
    summary = {v: sum(r["equal_to_ar"] for r in rows if r["logits"] == v) for v in ("bf16", "float32")}
    doc = {"benchmark": out.stem, "commit": commit, "gpu": torch.cuda.get_device_name(), "copy_gbps": None,
           "params": {"model": str(MODEL), "dtype": "bfloat16", "prompts": args.prompts,
                      "prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "budgets": args.budgets,
                      "runs_per_variant": len(rows) // 2, "equal_to_ar": summary},
           "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"equal to AR: {summary} of {len(rows) // 2} each; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
