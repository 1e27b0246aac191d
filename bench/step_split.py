"""Per-request step split of a fresh stack: does a draft service start warm?

Starts the stack, sends `--requests` requests one after another and reports, per request, the
mean draft / propose / tree / verify / transport milliseconds per step from the draft's
Prometheus page (differences between scrapes). A warm start shows the same figures for the first
request as for the last. Writes JSON when `--out` is given.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import git_commit
from bench.matrix import stage_totals
from services.common.launcher import Stack, StackSpec, free_port
from services.scheduler.client import Client


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/demo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--out", default="")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    port = free_port()
    env = {"DDTREE_DRAFT_METRICS_PORT": str(port)}
    for svc in ("VERIFIER", "DRAFT"):
        env[f"DDTREE_{svc}_DEVICE"], env[f"DDTREE_{svc}_DTYPE"] = args.device, args.dtype
    prompts = json.loads((Path(args.model) / "heldout_prompts.json").read_text())["prompts"]
    rows = []
    t_start = time.perf_counter()
    with Stack(StackSpec(model_path=args.model, scheduler_port=0, extra_env=env)) as stack, \
            Client(stack.scheduler_address) as client:
        started_s = time.perf_counter() - t_start
        for i in range(args.requests):
            before = stage_totals(f"127.0.0.1:{port}")
            t0 = time.perf_counter()
            client.generate(prompts[i % len(prompts)]["ids"][:args.prompt_len], max_tokens=args.max_tokens,
                            budget=args.budget, ignore_eos=True)
            wall = time.perf_counter() - t0
            after = stage_totals(f"127.0.0.1:{port}")
            split = {f"{k}_ms": round((s - before.get(k, (0, 0))[0]) / (n - before.get(k, (0, 0))[1]), 3)
                     for k, (s, n) in after.items() if n > before.get(k, (0, 0))[1]}
            rows.append({"request": i, "wall_s": round(wall, 3), **split})
            print(rows[-1], flush=True)
    if args.out:
        gpu = "cpu"
        if args.device.startswith("cuda"):
            import torch
            gpu = torch.cuda.get_device_name(0)
        doc = {"benchmark": Path(args.out).stem, "commit": git_commit(args.commit), "gpu": gpu, "copy_gbps": None,
               "params": {**{k: v for k, v in vars(args).items() if k not in ("out", "commit")},
                          "stack_start_s": round(started_s, 1)}, "rows": rows}
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
