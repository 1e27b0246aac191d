"""Why an eager forward of a row count not run before is slower once (no kernel compiles).

On the 3-layer K2 TP8 slice (buckets 1, 4 x 1, 9, so prompts past ~100 tokens run eagerly:
``VerifyGraphs.replays_pay``) eager prompts of new lengths are timed, then the first lengths
again. Each mode runs in its own process (a fresh CUDA context and cuBLAS):

* ``plain``: as served.
* ``module_loading_eager``: ``CUDA_MODULE_LOADING=EAGER`` (is it lazy kernel loading?).
* ``gemm_warm``: first ``F.linear`` over every 2-D bf16 weight of the model at every row count
  33..512 (is it the dense GEMMs' first call at a shape?).
* ``profile``: a new length twice under torch.profiler; the ops whose host time the first call adds.

Usage: python -m bench.eager_first_use [--out bench/results/eager_first_use.json] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

LENGTHS = (100, 129, 200, 300, 137, 263, 450, 333, 100, 129, 200, 300)   # new lengths, then four again
MODES = {"plain": {}, "module_loading_eager": {"CUDA_MODULE_LOADING": "EAGER"}, "gemm_warm": {}, "profile": {}}


def run_mode(mode: str) -> dict:
    """One mode's row, in this process."""
    from bench.verify_first_use import k2_slice_engine
    from services.common.settings import VerifierSettings
    from services.verifier.engine import PrefillInput
    from services.verifier.sampling import Sampling

    settings = VerifierSettings(device="cuda", dtype="bfloat16", kv_capacity_tokens=1 << 18,
                                graph_batches=(1, 4), graph_nodes=(1, 9))
    engine, layers, _ = k2_slice_engine(3, settings)
    engine.set_feature_layers(layers)
    g = torch.Generator().manual_seed(0)

    def call(n: int) -> float:
        prompt = torch.randint(2, engine.vocab_size, (n,), generator=g).tolist()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.prefill([PrefillInput("p", prompt, Sampling(), reserve_tokens=n + 1)], eager=True)
        torch.cuda.synchronize()
        engine.release(["p"])
        return round((time.perf_counter() - t0) * 1e3, 1)

    row: dict = {"row": mode, "env": MODES[mode]}
    if mode == "gemm_warm":
        shapes = sorted({tuple(t.shape) for t in weights([engine.model.layers, engine.model.lm_head_weight])
                         if t.dim() == 2 and t.dtype == torch.bfloat16})
        t0 = time.perf_counter()
        x = torch.randn(512, max(s[1] for s in shapes), device="cuda", dtype=torch.bfloat16)
        for w in [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]:
            for m in range(33, 513):
                torch.nn.functional.linear(x[:m, :w.shape[1]], w)
        torch.cuda.synchronize()
        row.update(weight_shapes=[list(s) for s in shapes], gemm_warm_s=round(time.perf_counter() - t0, 2))
    row["prompts_ms"] = [[n, call(n)] for n in LENGTHS]
    if mode == "profile":
        from torch.profiler import ProfilerActivity, profile
        host, ms = [], []
        for n in (377, 377):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                ms.append(call(n))
            host.append({e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()})
        added = sorted(((k, round(v - host[1].get(k, 0.0), 2)) for k, v in host[0].items()), key=lambda kv: -kv[1])
        row.update(profiled_ms=ms, first_minus_second_host_ms=added[:8])
    return row


def weights(obj: object, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` through dataclasses, lists and dicts (a model's weights)."""
    if torch.is_tensor(obj):
        return [obj]
    if depth > 8:   # no cycles in weight dataclasses, but a stray back-reference must not recurse forever
        return []
    if isinstance(obj, (list, tuple)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in weights(item, depth + 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/eager_first_use.json")
    p.add_argument("--commit", default=None)
    p.add_argument("--mode", choices=sorted(MODES), help="run one mode here and print its row (used by the others)")
    args = p.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode)), flush=True)
        return
    rows = []
    for mode, env in MODES.items():
        done = subprocess.run([sys.executable, "-m", "bench.eager_first_use", "--mode", mode], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=300)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        assert done.returncode == 0 and lines, done.stderr[-2000:]
        rows.append(json.loads(lines[-1]))
        print(json.dumps(rows[-1])[:600], flush=True)
    from bench.common import write_result
    write_result(args.out, args.commit, {"model": "k2-slice, 3 layers", "dtype": "bfloat16", "graph_batches": [1, 4],
                                         "graph_nodes": [1, 9], "prompt_lengths": list(LENGTHS), "eager": True}, rows)


if __name__ == "__main__":
    main()
