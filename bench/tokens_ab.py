"""Greedy outputs of two commits, compared: did a change move the demo model's tokens?

`run` (from a checkout's root) writes the in-process engine's greedy tokens (the first 4 held-out
prompts cut to 60 tokens, 300 new tokens, budgets 0 and 16; `bench.split_overhead.InProcess`);
`compare` writes the result file from two such runs.

    python -m bench.tokens_ab run /tmp/after.json [--float32-router]
    (cd old && python -m bench.tokens_ab run /tmp/before.json)
    python -m bench.tokens_ab compare /tmp/before.json /tmp/after.json --before-commit SHA --after-commit SHA \\
        --what "..." --out bench/results/tokens-ab-SHA.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODEL = Path("models/demo")


def run(out: Path, float32_router: bool) -> None:
    """The tokens of each (prompt, budget), as JSON."""
    from bench.split_overhead import InProcess, load_prompts

    if float32_router:   # the float32 cuBLAS router instead of the bf16 parts
        import services.verifier.moe as moe_mod
        moe_mod.uses_router_parts = lambda device, dtype: False
    engine = InProcess(MODEL, "cuda", "bfloat16")
    runs = []
    for i, prompt in enumerate(load_prompts(MODEL, 4)):
        for budget in (0, 16):
            r = engine.generate(prompt[:60], 300, budget)
            runs.append(dict(prompt=i, budget=budget, tokens=r.tokens, steps=r.steps))
            print(i, budget, r.steps, flush=True)
    import torch

    from bench.common import copy_gbps_on

    out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), copy_gbps=copy_gbps_on("cuda"), runs=runs)))


def compare(before: Path, after: Path, args: argparse.Namespace) -> None:
    """One row per (prompt, budget): equal, the first differing token, steps and acceptance."""
    first, second = json.loads(before.read_text()), json.loads(after.read_text())
    # A run by an older checkout (the docstring's "before") is a bare list, without its GPU.
    a, b = (x["runs"] if isinstance(x, dict) else x for x in (first, second))
    ran = second if isinstance(second, dict) else {"gpu": "unknown", "copy_gbps": None}
    rows = []
    for k, (x, y) in enumerate(zip(a, b)):
        diff = next((i for i, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t), None)
        rows.append(dict(run=k, prompt=x["prompt"], budget=x["budget"], path="in_process", tokens=len(y["tokens"]),
                         equal=x["tokens"] == y["tokens"], first_difference=diff, steps_before=x["steps"],
                         steps_after=y["steps"], acceptance_before=round(len(x["tokens"]) / max(1, x["steps"]), 3),
                         acceptance_after=round(len(y["tokens"]) / max(1, y["steps"]), 3)))
    doc = dict(benchmark=Path(args.out).stem, commit=args.after_commit, gpu=ran["gpu"], copy_gbps=ran["copy_gbps"],
               params=dict(model=str(MODEL), dtype="bfloat16", compared=f"{args.before_commit} (before) against {args.after_commit}"
                           f" ({args.what}), greedy", in_process="first 4 held-out prompts cut to 60 tokens, 300 "
                           "tokens, budgets 0 and 16 (bench.split_overhead.InProcess)"), rows=rows)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"equal {sum(r['equal'] for r in rows)} of {len(rows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--float32-router", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    for name in ("--before-commit", "--after-commit", "--what", "--out"):
        c.add_argument(name, required=True)
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.out, args.float32_router)
    else:
        compare(args.before, args.after, args)


if __name__ == "__main__":
    main()
