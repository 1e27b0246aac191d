"""Does a verify step or a prefill compile anything on a request, after the verifier's start-up?

The verifier's start-up (``services.verifier.server.build_engine`` with its default settings:
every graph bucket captured, then the warm-up's steps at budgets 0 / 8 / 16 / 32 and batches
1 / 8 / 64) runs first, in this process, on an empty Triton cache; then the drafter's feature
layers are set, as its handshake does (every captured graph is captured again). After it, each
call is timed alone (wall clock, synchronised) and the Triton cache entries it added are counted
and named:

* prefills of one new request at a spread of prompt lengths, each with a short and a long KV
  reservation (each chunk a graph replay, or without graphs an eager forward whose fused-MoE
  launches depend on its token count, and whose attention splits depend on the width of the
  request's page table);
* prefill calls of many prompts at once (``BURSTS``: prompts of random lengths up to a bound,
  one-token prompts among them), as a step admitting many requests makes (``prefill_burst`` rows,
  each burst twice, of other lengths: ``ms``, ``second_ms``);
* a verify step at every (batch bucket, tree-size bucket) of ``VerifyGraphs``, trees of exactly the
  bucket's node count with random parents and tokens, twice (``first_ms``, ``second_ms``). Where
  the start-up did not capture a bucket (before ``capture_buckets``), the first call captures it;
* verify steps of one node a request for 1..``ONE_TOKEN_STEPS`` requests (``one_token_step`` rows,
  twice), eager where no batch bucket holds them, whose fused-MoE configs differ from a tree's;
* with ``--eager-steps N``, N verify steps of random shapes (trees up to the largest warm-up batch,
  1..129 nodes each) that no graph bucket holds (``eager_step`` rows, twice): a serving step of
  any size the warm-up left eager.

GPU memory is recorded after the start-up, after the feature layers, after the prefills and after
the verify steps (``after_verify``, with ``graph_outputs_gb``: the graphs' output buffers as
``VerifyGraphs.outputs_bytes`` counts them at that commit).

A call that compiles takes seconds and adds entries; one that captures a graph without compiling
takes tens of milliseconds. ``new_cache_entries`` in the summary row counts what every call after
the start-up added (0: nothing compiled on a request).

``--k2-layers N`` runs the Kimi-K2 TP8 per-rank slice of ``bench/k2_slice.py`` (random INT4
experts, N layers, the model's 131072-token context) instead of a checkpoint, warmed up as
``build_engine`` warms a loaded model.

``--graph-batches`` / ``--graph-nodes`` / ``--warmup-budgets`` set ``verifier.graph_batches`` /
``verifier.graph_nodes`` / ``verifier.warmup_budgets`` (a subset of buckets, to time a deep model's
captures in one run; the verify calls then cover those buckets). For the slice, the startup row's
``model_seconds`` is the part of its ``seconds`` spent making the random weights and the cache; the
rest is the warm-up.

Usage: python -m bench.verify_first_use [--model models/demo | --k2-layers 3] [--graph-batches 1,64]
       [--graph-nodes 1,129] [--warmup-budgets 0,8] [--eager-steps 24] [--out FILE] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from bench.empty_triton_cache import kernels_in_cache   # before triton's first import

import torch

from bench.common import write_result
from services.common.settings import MAX_BUDGET, VerifierSettings
from services.verifier.engine import WARMUP_BATCHES, PrefillInput, StepOutcome, VerifierEngine
from services.verifier.graphs import NODE_BUCKETS
from services.verifier.sampling import Sampling
from services.verifier.server import build_engine

PROMPT_LENGTHS = (2, 3, 5, 7, 12, 16, 17, 24, 33, 48, 65, 100, 129, 200, 256, 300, 511, 512, 700, 1000)
RESERVE = 1600   # KV a verify request reserves: its prompt, then a few tokens a step
PREFILL_RESERVES = (1, 1024)   # tokens a prefill reserves past its prompt (max_tokens)
BURSTS = ((8, 300), (64, 300), (64, 1), (128, 40))   # one prefill call: (prompts, longest prompt)
ONE_TOKEN_STEPS = 8   # verify steps of one node a request, for 1..8 requests


def memory() -> dict[str, float]:
    """GPU memory now: what tensors hold, what the caching allocator keeps (graph pools included)."""
    return {"gpu_gb_allocated": round(torch.cuda.memory_allocated() / 1e9, 3),
            "gpu_gb_reserved": round(torch.cuda.memory_reserved() / 1e9, 3),
            "gpu_gb_peak": round(torch.cuda.max_memory_allocated() / 1e9, 3)}


def timed(fn: Callable[[], StepOutcome]) -> tuple[float, list[str]]:
    """Wall milliseconds of one synchronised call, and the kernels it added to the cache."""
    before = kernels_in_cache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    failed = [i.error for i in out.items if i.error is not None]
    assert not failed, failed[0]
    after = kernels_in_cache()
    return ms, sorted(after[k] for k in after.keys() - before.keys())


def random_trees(engine: VerifierEngine, rids: list[str], nodes: int,
                 g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat tokens / parents / depths / sizes of trees of exactly ``nodes`` nodes each."""
    tokens, parents, depths = [], [], []
    for rid in rids:
        par = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, nodes)]
        dep = [0] * nodes
        for i in range(1, nodes):
            dep[i] = dep[par[i]] + 1
        tok = [engine._requests[rid].pending] + torch.randint(2, engine.vocab_size, (nodes - 1,), generator=g).tolist()
        tokens += tok
        parents += par
        depths += dep
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return as_t(tokens), as_t(parents), as_t(depths), torch.full((len(rids),), nodes, dtype=torch.int64)


def eager_shapes(engine: VerifierEngine, count: int, most_batch: int, g: torch.Generator) -> list[tuple[int, int]]:
    """``count`` random (trees, nodes) step shapes, up to ``most_batch`` trees, that no captured
    graph bucket holds: what the warm-up's MoE step sweep must have covered for them to compile
    nothing. Drawn from every such shape, so buckets that hold them all are an error, not a loop."""
    if count <= 0:
        return []
    eager = [(b, t) for b in range(1, most_batch + 1) for t in range(1, MAX_BUDGET + 2)
             if engine.graphs is None or engine.graphs.bucket_for(b, t) is None]
    if not eager:
        raise SystemExit(f"--eager-steps: the graph buckets hold every step of up to {most_batch} trees of up to "
                         f"{MAX_BUDGET + 1} nodes; pass --graph-batches / --graph-nodes that leave some eager")
    picks = torch.randint(0, len(eager), (count,), generator=g).tolist()
    return [eager[i] for i in picks]


def k2_slice_engine(layers: int, settings: VerifierSettings) -> tuple[VerifierEngine, list[int], float]:
    """The K2 per-rank slice as ``build_engine`` would serve it, and feature layers it holds."""
    from bench.k2_slice import K2_CONFIG, TP, build_model, per_rank_config
    from services.verifier.config import TargetConfig
    from services.verifier.kv_cache import PagedKVCache

    config = TargetConfig.from_hf(per_rank_config(K2_CONFIG, TP, layers), source="k2-slice config")
    device, dtype = torch.device("cuda"), torch.bfloat16
    t0 = time.perf_counter()
    model = build_model(config, dtype, device, seed=0)
    cache = PagedKVCache(layers, settings.kv_capacity_tokens // settings.page_size, settings.page_size, config.kv_dim,
                         dtype, device)
    engine = VerifierEngine(model, cache, max_context=config.max_position_embeddings, prefill_chunk=settings.prefill_chunk)
    torch.cuda.synchronize()
    model_seconds = round(time.perf_counter() - t0, 2)
    engine.enable_graphs(batch_buckets=settings.graph_batches, node_buckets=settings.graph_nodes)
    engine.warm_up(settings.warmup_budgets)
    return engine, list(range(min(3, layers))), model_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--k2-layers", type=int, default=0, help="run the K2 TP8 slice with this many layers")
    p.add_argument("--out", default="bench/results/verify_first_use.json")
    p.add_argument("--commit", default=None)
    p.add_argument("--graph-batches", default=None, help="comma-separated batch buckets (default: the setting's)")
    p.add_argument("--graph-nodes", default=None, help="comma-separated tree-size buckets (default: the setting's)")
    p.add_argument("--warmup-budgets", default=None, help="comma-separated warm-up verify budgets (default: the setting's)")
    p.add_argument("--eager-steps", type=int, default=0, help="verify steps of random shapes no graph bucket holds")
    args = p.parse_args()
    buckets = {name: tuple(int(x) for x in value.split(",")) for name, value in
               (("graph_batches", args.graph_batches), ("graph_nodes", args.graph_nodes),
                ("warmup_budgets", args.warmup_budgets)) if value}
    settings = VerifierSettings(model_path=args.model, device="cuda", dtype="bfloat16", kv_capacity_tokens=1 << 18,
                                **buckets)
    g = torch.Generator().manual_seed(0)
    rows: list[dict] = []

    t0 = time.perf_counter()
    model_seconds = {}
    if args.k2_layers:
        engine, layers, seconds = k2_slice_engine(args.k2_layers, settings)
        model_seconds = {"model_seconds": seconds}
    else:
        engine = build_engine(settings)   # loads, sizes the cache, warms up and captures
        drafter = json.loads((Path(args.model) / "drafter" / "config.json").read_text())
        layers = drafter["dflash_config"]["target_layer_ids"]
    torch.cuda.synchronize()
    eager = eager_shapes(engine, args.eager_steps, max(WARMUP_BATCHES), g)   # before the calls: a refusal comes early
    start_entries = len(kernels_in_cache())
    rows.append({"row": "startup", "seconds": round(time.perf_counter() - t0, 2), **model_seconds, "cache_entries": start_entries,
                 **memory(), "graphs": [list(k) for k in engine.graphs.captured] if engine.graphs else []})
    batches = engine.graphs.batch_buckets if engine.graphs else (1,)
    node_buckets = engine.graphs.node_buckets if engine.graphs else NODE_BUCKETS
    model = "/".join(Path(args.model).parts[-2:])   # a machine's checkout path is no parameter of the run
    params = {"model": f"k2-slice, {args.k2_layers} layers" if args.k2_layers else model,
              "dtype": "bfloat16", "max_context": engine.max_context, "prefill_reserves": list(PREFILL_RESERVES),
              "warmup_budgets": list(settings.warmup_budgets), "graph_batches": list(settings.graph_batches),
              "node_buckets": list(node_buckets), "kv_capacity_tokens": settings.kv_capacity_tokens,
              "prompt_lengths": list(PROMPT_LENGTHS), "bursts": [list(b) for b in BURSTS], "feature_layers": layers}

    def save(complete: bool) -> None:
        """The rows so far: a deep model's run may meet its time limit after the start-up."""
        write_result(args.out, args.commit, {**params, "complete": complete}, rows)

    before = kernels_in_cache()
    t0 = time.perf_counter()
    engine.set_feature_layers(layers)
    torch.cuda.synchronize()
    new = sorted(v for k, v in kernels_in_cache().items() if k not in before)
    rows.append({"row": "feature_layers", "layers": layers, "ms": round((time.perf_counter() - t0) * 1e3, 1),
                 "kernels": new, **memory()})
    print(rows[0], rows[1], flush=True)
    save(False)

    for extra in PREFILL_RESERVES:
        for n in PROMPT_LENGTHS:
            if n + extra > engine.max_context:
                continue
            prompt = torch.randint(2, engine.vocab_size, (n,), generator=g).tolist()
            ms, new = timed(lambda: engine.prefill([PrefillInput("p", prompt, Sampling(), reserve_tokens=n + extra)]))
            engine.release(["p"])
            rows.append({"row": "prefill", "tokens": n, "reserve": n + extra, "ms": round(ms, 1), "kernels": new})
            print(rows[-1], flush=True)

    for count, longest in BURSTS:   # one step admitting many prompts (they share replays, or eager forwards)
        times = []
        for _ in range(2):   # the second of other random lengths: eager forwards of a new size cost more once
            lengths = torch.randint(1, longest + 1, (count,), generator=g).tolist()
            items = [PrefillInput(f"b{i}", torch.randint(2, engine.vocab_size, (n,), generator=g).tolist(), Sampling(),
                                  reserve_tokens=n + 1) for i, n in enumerate(lengths)]
            ms, new = timed(lambda: engine.prefill(items))
            engine.release([it.request_id for it in items])
            times.append((ms, new, sum(lengths), max(lengths)))
        rows.append({"row": "prefill_burst", "prompts": count, "tokens": times[0][2], "longest": times[0][3],
                     "ms": round(times[0][0], 1), "second_tokens": times[1][2], "second_ms": round(times[1][0], 1),
                     "kernels": times[0][1] + times[1][1]})
        print(rows[-1], flush=True)

    torch.cuda.synchronize()
    rows.append({"row": "after_prefills", **memory()})
    save(False)
    rids = [f"r{i}" for i in range(max(*batches, ONE_TOKEN_STEPS, *(b for b, _ in eager)))]
    prompts = [torch.randint(2, engine.vocab_size, (16,), generator=g).tolist() for _ in rids]
    timed(lambda: engine.prefill([PrefillInput(r, pr, Sampling(), reserve_tokens=RESERVE) for r, pr in zip(rids, prompts)]))
    for batch in batches:
        for nodes in node_buckets:
            times = []
            for _ in range(2):
                tree = random_trees(engine, rids[:batch], nodes, g)
                ms, new = timed(lambda: engine.verify(rids[:batch], *tree))
                times.append((ms, new))
            rows.append({"row": "verify", "batch": batch, "nodes": nodes, "first_ms": round(times[0][0], 1),
                         "second_ms": round(times[1][0], 1), "kernels": times[0][1] + times[1][1], **memory()})
            print(rows[-1], flush=True)
        save(False)
    for batch in range(1, ONE_TOKEN_STEPS + 1):   # eager where no batch bucket holds them (their own MoE configs)
        times = []
        for _ in range(2):
            tree = random_trees(engine, rids[:batch], 1, g)
            times.append(timed(lambda: engine.verify(rids[:batch], *tree)))
        rows.append({"row": "one_token_step", "batch": batch, "first_ms": round(times[0][0], 1),
                     "second_ms": round(times[1][0], 1), "kernels": times[0][1] + times[1][1]})
        print(rows[-1], flush=True)
    for batch, nodes in eager:
        times = []
        for _ in range(2):
            tree = random_trees(engine, rids[:batch], nodes, g)
            times.append(timed(lambda: engine.verify(rids[:batch], *tree)))
        rows.append({"row": "eager_step", "batch": batch, "nodes": nodes, "first_ms": round(times[0][0], 1),
                     "second_ms": round(times[1][0], 1), "kernels": times[0][1] + times[1][1]})
        print(rows[-1], flush=True)
    save(False)

    torch.cuda.synchronize()
    graphs = engine.graphs
    rows.append({"row": "after_verify", "graphs": len(graphs.captured) if graphs else 0,
                 "graph_outputs_gb": round(graphs.outputs_bytes() / 1e9, 3) if graphs else None, **memory()})
    print(rows[-1], flush=True)
    calls = [r for r in rows[1:] if r["row"] not in ("after_prefills", "after_verify")]
    added = sorted(k for r in calls for k in r["kernels"])
    slow = max(calls, key=lambda r: max(r.get("first_ms", r.get("ms", 0)), r.get("second_ms", 0)))   # either run
    summary = {"row": "summary", "calls": len(calls), "new_cache_entries": len(kernels_in_cache()) - start_entries,
               "kernels_compiled": added, "slowest_call": {k: v for k, v in slow.items() if k != "kernels"}}
    print(summary, flush=True)
    rows.insert(0, summary)
    save(True)


if __name__ == "__main__":
    main()
