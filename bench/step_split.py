"""Per-request step split of a fresh stack: does a draft service start warm, and where does a
step's time go between the three processes?

Starts the stack, sends `--requests` requests one after another (C=1) and reports, per request, the
mean milliseconds per step of every stage each service times (README "Metrics"), from the three
Prometheus pages (differences between scrapes), as `<service>_<stage>_ms`. The hops are the
differences between a caller's time and its callee's:
* `scheduler_hop_ms` = the scheduler's Step round trip - the draft's whole handler. The draft's
  work ahead (its context commit and the next trees, run on its event loop once the answer has
  left) falls inside this hop where it outlasts the answer's trip;
* `verifier_hop_ms` = the draft's call to the verifier - the verifier's time for that message;
* `verifier_thread_ms` = the verifier's time for a message - its engine work and feature write;
and `step_ms` = the scheduler's round trips + its own time between steps, over its round trips: one
step as the stack runs it.
A warm start shows the same figures for the first request as for the last. Writes JSON when `--out`
is given.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import add_step_sockets_arg, copy_gbps_on, git_commit, step_sockets_env
from bench.matrix import stage_split, stage_totals
from services.common.launcher import Stack, StackSpec, free_port
from services.scheduler.client import Client

SERVICES = ("scheduler", "draft", "verifier")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/demo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=16)
    add_step_sockets_arg(p)
    p.add_argument("--out", default="")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    ports = {svc: free_port() for svc in SERVICES}
    env = {f"DDTREE_{svc.upper()}_METRICS_PORT": str(port) for svc, port in ports.items()}
    for svc in ("VERIFIER", "DRAFT"):
        env[f"DDTREE_{svc}_DEVICE"], env[f"DDTREE_{svc}_DTYPE"] = args.device, args.dtype
    env.update(step_sockets_env(args.step_sockets))
    prompts = json.loads((Path(args.model) / "heldout_prompts.json").read_text())["prompts"]
    rows = []
    t_start = time.perf_counter()
    with Stack(StackSpec(model_path=args.model, scheduler_port=0, extra_env=env)) as stack, \
            Client(stack.scheduler_address) as client:
        started_s = time.perf_counter() - t_start
        ports = {svc: int(stack.metrics_address(svc).rsplit(":", 1)[1]) for svc in ports}   # one may have moved
        for i in range(args.requests):
            before = scrape(ports)
            t0 = time.perf_counter()
            client.generate(prompts[i % len(prompts)]["ids"][:args.prompt_len], max_tokens=args.max_tokens,
                            budget=args.budget, ignore_eos=True)
            wall = time.perf_counter() - t0
            time.sleep(0.2)   # the release-only step after the last token ends first (no service times it)
            after = scrape(ports)
            split = {k: round(v, 3) for k, v in stage_split(before, after).items() if v is not None}
            rows.append({"request": i, "wall_s": round(wall, 3), "step_ms": step_ms(before, after), **hops(split),
                         **split})
            print(rows[-1], flush=True)
    if args.out:
        gpu = "cpu"
        if args.device.startswith("cuda"):
            import torch
            gpu = torch.cuda.get_device_name(0)
        doc = {"benchmark": Path(args.out).stem, "commit": git_commit(args.commit), "gpu": gpu, "copy_gbps": copy_gbps_on(args.device),
               "params": {**{k: v for k, v in vars(args).items() if k not in ("out", "commit")},
                          "stack_start_s": round(started_s, 1)}, "rows": rows}
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


def scrape(ports: dict[str, int]) -> dict[str, tuple[float, float]]:
    """(sum_ms, count) of every service's stages, keyed ``<service>_<stage>``; a page that did not
    answer fails the run (its stages read as none would misstate the next request's split)."""
    out = {}
    for svc, port in ports.items():
        totals = stage_totals(f"127.0.0.1:{port}")
        if totals is None:
            raise SystemExit(f"step_split: the {svc}'s /metrics page on port {port} did not answer")
        out.update({f"{svc}_{stage}": v for stage, v in totals.items()})
    return out


def step_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> float:
    """Mean ms a step as the scheduler runs them: its round trips and its own time between steps,
    over the round trips (its own time is not counted for a step that followed an idle wait)."""
    d = {k: (after[k][0] - before.get(k, (0.0, 0.0))[0], after[k][1] - before.get(k, (0.0, 0.0))[1])
         for k in ("scheduler_step_rpc", "scheduler_scheduler") if k in after}
    rpc_sum, steps = d.get("scheduler_step_rpc", (0.0, 0.0))
    return round((rpc_sum + d.get("scheduler_scheduler", (0.0, 0.0))[0]) / steps, 3) if steps else 0.0


def hops(split: dict[str, float]) -> dict[str, float]:
    """The time between the services: each caller's time less its callee's."""
    g = lambda key: split.get(f"{key}_ms", 0.0)  # noqa: E731
    return {"scheduler_hop_ms": round(g("scheduler_step_rpc") - g("draft_ahead_wait") - g("draft_step"), 3),
            "verifier_hop_ms": round(g("draft_verifier_rpc") - g("verifier_stream_step"), 3),
            "verifier_thread_ms": round(g("verifier_stream_step") - g("verifier_verify") - g("verifier_features"), 3)}


if __name__ == "__main__":
    main()
