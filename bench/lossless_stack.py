"""Greedy DDTree against the same stack's greedy autoregressive decoding, budget by budget, per TP.

    python -m bench.lossless_stack --tp 1,2 --budgets 1-128 --device cpu --dtype float32

T-lossless asks for token-for-token equality at every budget 1..128 and at TP 1 and 2. The
in-process check (``train.eval_acceptance``) runs one rank; this one goes through the served path,
the three-process stack with its verifier ranks (gloo on the CPU, NCCL on GPUs), and compares each
budget's greedy output with the autoregressive output of the same stack, so a TP group is held to
its own greedy decoding, not to another group's rounding. Held-out prompts of the demo pair (clear
margins); rows in the acceptance-demo shape plus ``tp``. Exits 1 when a row is not identical on
every prompt. In bf16 the tree and autoregressive steps round differently, so outputs can part at
near ties there: float32 is the check.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import write_result
from services.common.launcher import Stack, StackSpec
from services.scheduler.client import Client


def parse_budgets(text: str) -> list[int]:
    """``1-128`` or ``1,4,16`` (or both, comma-separated) -> sorted distinct budgets."""
    budgets: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        budgets.update(range(int(lo), int(hi or lo) + 1))
    return sorted(budgets)


def check_tp(model: Path, tp: int, prompts: list[list[int]], budgets: list[int], max_tokens: int,
             device: str, dtype: str, log_path: str | None = None) -> list[dict]:
    """One stack at ``tp`` ranks: AR once, then every budget; a row a budget. The scheduler's pause
    of speculation that does not pay is off: its autoregressive steps would check nothing."""
    env = {"DDTREE_VERIFIER_TP": str(tp), "DDTREE_VERIFIER_DEVICE": device, "DDTREE_DRAFT_DEVICE": device,
           "DDTREE_VERIFIER_DTYPE": dtype, "DDTREE_DRAFT_DTYPE": dtype, "NCCL_NVLS_ENABLE": "0",
           "DDTREE_SCHEDULER_SPEC_MIN_ACCEPTANCE": "0"}
    rows = []
    spec = StackSpec(model_path=str(model), scheduler_port=0, extra_env=env, log_path=log_path)
    with Stack(spec) as stack, Client(stack.scheduler_address) as client:
        ar = [client.generate(p, max_tokens=max_tokens, mode="autoregressive", ignore_eos=True).token_ids
              for p in prompts]
        for budget in budgets:
            t0 = time.perf_counter()
            outs = [client.generate(p, max_tokens=max_tokens, budget=budget, ignore_eos=True) for p in prompts]
            same = sum(o.token_ids == a for o, a in zip(outs, ar))
            accept = sum(o.mean_acceptance for o in outs) / len(outs)
            rows.append({"tp": tp, "budget": budget, "temperature": 0.0, "prompts": len(prompts),
                         "mean_acceptance": round(accept, 4), "identical_to_autoregressive": same})
            print(f"tp {tp} budget {budget:3d}: identical {same}/{len(prompts)}, mean acceptance {accept:.3f} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("models/demo"))
    p.add_argument("--tp", default="1,2", help="comma-separated TP sizes, one stack each")
    p.add_argument("--budgets", default="1-128", help="e.g. 1-128 or 1,8,16")
    p.add_argument("--prompts", type=int, default=4, help="the first N held-out prompts of the model")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--commit", default="")
    p.add_argument("--out", default="bench/results/lossless-stack.json")
    p.add_argument("--stack-log", default=None, help="the services' output goes here (appended), not to ours")
    args = p.parse_args()
    held = json.loads((args.model / "heldout_prompts.json").read_text())["prompts"]
    prompts = [h["ids"] for h in held[:args.prompts]]
    budgets = parse_budgets(args.budgets)
    rows = [row for tp in map(int, args.tp.split(","))
            for row in check_tp(args.model, tp, prompts, budgets, args.max_tokens, args.device, args.dtype,
                                args.stack_log)]
    params = {"model": str(args.model), "prompts": len(prompts), "prompt_source": "heldout_prompts.json, first N",
              "max_tokens": args.max_tokens, "budgets": budgets, "device": args.device, "dtype": args.dtype,
              "deployment": "three-process stack (bench.lossless_stack)", "ignore_eos": True,
              "spec_min_acceptance": 0,
              "identical_to_autoregressive": "greedy DDTree vs greedy AR of the same stack, token for token",
              "mean_acceptance": "the server's per-request mean, averaged over the prompts"}
    write_result(args.out, args.commit, params, rows, device=args.device)
    bad = [r for r in rows if r["identical_to_autoregressive"] != r["prompts"]]
    print(f"wrote {args.out}: {len(rows) - len(bad)} of {len(rows)} rows identical on every prompt", flush=True)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
