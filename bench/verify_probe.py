"""Where one verify step's wall time goes, in one process: the demo model at C=1.

The stack's verify step on the demo model (6 layers, 24 MB) took 2.5-2.9 ms of wall time in the
serving matrix, far above what its GPU work should take. This script splits a step the way
`VerifierEngine.verify` runs it: the host-side checks, the padding and copy into the graph's inputs
(`VerifyGraphs._load`), the replay call, the wait for the GPU plus the posterior (the rest of the
step), the acceptance walk, the KV commit and the features. Alongside it times the captured graph
alone (replay + sync: the GPU floor of the step) and counts the kernels in one replay.

Trees come from the demo drafter (`bench.split_overhead.InProcess`), so their sizes and accepted
lengths are the service's. Writes JSON when `--out` is given; `--profile-dir` also writes a
torch.profiler trace of a few steps and the cProfile table of the step loop.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.common import copy_gbps_on, git_commit
from bench.split_overhead import InProcess, load_prompts
from services.draft.tree import build_trees_from_logits
from services.verifier import engine as engine_mod
from services.verifier.engine import PrefillInput
from services.verifier.sampling import Sampling

__all__ = ["Stages", "main"]


class Stages:
    """Wall time of named calls, summed per step: wraps attributes in place while `patched` is open."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, fn: Callable, name: str) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[name] += time.perf_counter() - t0
        return timed

    @contextmanager
    def patched(self, targets: list[tuple[object, str, str]]) -> Iterator[None]:
        saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in targets]
        for obj, attr, name in targets:
            setattr(obj, attr, self.wrap(getattr(obj, attr), name))
        try:
            yield
        finally:
            for obj, attr, fn in saved:
                setattr(obj, attr, fn)

    def end_step(self, total_s: float) -> None:
        row = {k: v * 1e3 for k, v in self.step.items()}
        row["verify"] = total_s * 1e3
        self.steps.append(row)
        self.step = defaultdict(float)

    def medians(self) -> dict[str, float]:
        keys = sorted({k for s in self.steps for k in s})
        return {k: round(statistics.median(s.get(k, 0.0) for s in self.steps), 4) for k in keys}


def decode_steps(side: InProcess, prompt: list[int], steps: int, budget: int,
                 on_verify: Callable[[Callable[[], object]], object]) -> int:
    """Greedy DDTree decoding as `InProcess.generate` does it; `on_verify` runs each verify call."""
    engine, proposer = side.engine, side.proposer
    rid = "probe"
    proposer.start(rid, prompt)
    pre = engine.prefill([PrefillInput(rid, prompt, Sampling(), len(prompt) + steps * (budget + 1) + 64)])
    proposer.commit(rid, prompt, pre.features)
    pending, accepted = pre.items[0].tokens[-1], 0
    for _ in range(steps):
        bonus = torch.tensor([pending], device=side.device)
        if budget:
            tree = build_trees_from_logits(proposer.propose([rid], bonus), budget, bonus)
            n = int(tree.sizes[0])
            args = ([rid], tree.tokens[0, :n].cpu(), tree.parents[0, :n].cpu(), tree.depths[0, :n].cpu(),
                    tree.sizes[:1].cpu())
        else:
            args = ([rid], torch.tensor([pending]), torch.tensor([-1]), torch.tensor([0]), torch.tensor([1]))
        res = on_verify(lambda: engine.verify(*args))
        item = res.items[0]
        proposer.commit(rid, [pending] + item.tokens[:-1], res.features)
        accepted += len(item.tokens)
        pending = item.tokens[-1]
    engine.release([rid])
    proposer.drop(rid)
    return accepted


def replay_alone_ms(side: InProcess, reps: int = 50) -> dict[str, float]:
    """The last bucket's graph replayed with a sync after each: the step's GPU time, no host work."""
    graphs = side.engine.graphs
    out = {}
    for key in graphs.captured:
        b = graphs._bucket(*key)
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            b.graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        out[f"{key[0]}x{key[1]}"] = round(statistics.median(times), 4)
    return out


def replay_kernels(side: InProcess, key: tuple[int, int], reps: int = 5, top: int = 40) -> dict:
    """The kernels of one bucket's replay (torch.profiler): per replay, how many of each and their
    device time, largest first; what fusing launches would save."""
    b = side.engine.graphs._bucket(*key)
    b.graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            b.graph.replay()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.device_time_total
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {"kernels_per_replay": round(sum(n for n, _ in by_name.values()) / reps, 1),
            "device_us_per_replay": round(sum(us for _, us in by_name.values()) / reps, 1),
            "top": [{"kernel": name[:120], "per_replay": round(n / reps, 1), "us": round(us / reps, 1)}
                    for name, (n, us) in ranked[:top]]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/demo")
    p.add_argument("--budgets", type=int, nargs="+", default=[0, 16])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="")
    p.add_argument("--profile-dir", default="")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernels", action="store_true", help="profile the 1x1 and 1x17 replays' kernels")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    side = InProcess(Path(args.model), args.device, dtype)
    prompt = load_prompts(Path(args.model), 1)[0][:60]
    engine = side.engine
    graphs = engine.graphs
    rows = []
    for budget in args.budgets:
        decode_steps(side, prompt, 20, budget, lambda f: f())                       # warm: captures
        stages = Stages()

        def timed(f, stages=stages):
            t0 = time.perf_counter()
            out = f()
            stages.end_step(time.perf_counter() - t0)
            return out
        targets = [(engine, "_check_trees", "check_trees"), (engine, "_posterior", "posterior_launch"),
                   (engine_mod, "accept", "accept"), (engine.cache, "write_slots", "commit"),
                   (engine, "cat_features", "features")]
        if graphs is not None:
            targets += [(graphs, "_load", "load"), (graphs, "run", "graph_run")]
        with stages.patched(targets):
            accepted = decode_steps(side, prompt, args.steps, budget, timed)
        t0 = time.perf_counter()
        decode_steps(side, prompt, args.steps, budget, lambda f: f())
        loop_ms = (time.perf_counter() - t0) * 1e3 / args.steps
        row = {"budget": budget, "steps": args.steps, "tokens_per_step": round(accepted / args.steps, 3),
               "decode_step_ms": round(loop_ms, 4), "verify_stage_ms": stages.medians()}
        if args.profile_dir and args.device.startswith("cuda"):
            out = Path(args.profile_dir)
            out.mkdir(parents=True, exist_ok=True)
            prof = cProfile.Profile()
            prof.enable()
            decode_steps(side, prompt, args.steps, budget, lambda f: f())
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(60)
            (out / f"cprofile-b{budget}.txt").write_text(buf.getvalue())
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as tp:
                decode_steps(side, prompt, 5, budget, lambda f: f())
            tp.export_chrome_trace(str(out / f"trace-b{budget}.json"))
            kernels = [e for e in tp.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            row["profiled_kernels_per_step"] = round(len(kernels) / 5, 1)
            row["profiled_gpu_ms_per_step"] = round(sum(e.device_time_total for e in kernels) / 5e3, 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    alone = replay_alone_ms(side) if graphs is not None else {}
    print("replay alone (ms, with sync):", alone, flush=True)
    kernels = {}
    if args.kernels and graphs is not None:
        for key in ((1, 1), (1, 17)):
            if key in graphs.captured:
                kernels[f"{key[0]}x{key[1]}"] = replay_kernels(side, key)
                print(f"{key}:", json.dumps(kernels[f"{key[0]}x{key[1]}"])[:3000], flush=True)
    if args.out:
        doc = {"benchmark": Path(args.out).stem, "commit": git_commit(args.commit),
               "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu", "copy_gbps": copy_gbps_on(args.device),
               "params": {"model": args.model, "context": len(prompt), "concurrency": 1, "dtype": dtype,
                          "steps": args.steps, "note": "verify_stage_ms: medians over steps of the wall time "
                          "inside each named call; verify = the whole engine.verify call; graph_run includes "
                          "load and the replay call; the GPU wait lands in the rest of verify (posterior .cpu())"},
               "replay_alone_ms": alone, "replay_kernels": kernels, "rows": rows}
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
