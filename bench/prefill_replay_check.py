"""A step's prompts replayed from the verify graphs equal the same padded forward run eagerly,
bit for bit (GPU, demo model, bf16, the fused MoE pinned split-free: atomic split-K sums vary run
to run).

``bench/prefill_graphs_check.py`` compares the replay with the eager engine, whose forwards have
other shapes (other roundings, and in bf16 a rounding can flip a token's experts). This isolates
the replay: one model, two engines, one replaying (buckets captured on first use), one running the
same padded inputs eagerly (``enable_graphs(capture=False)``: what the CPU tests check against
the unpadded path). Rows: ``replay_vs_padded`` (bitwise, and max differences), ``reference``
(each engine's first-token logits against the float64 reference, prompt by prompt).

Usage: python -m bench.prefill_replay_check [--model models/demo] [--out FILE] [--commit SHA]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kernels.int4_moe import CONFIG_ENV

os.environ[CONFIG_ENV] = "split=1,reduce=sum"   # before any MoE launch

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from bench.prefill_graphs_check import PROMPTS, cached_kv, diff, drafter_layers, random_prompts, recorded_logits  # noqa: E402
from services.common.settings import VerifierSettings  # noqa: E402
from services.verifier.engine import PrefillInput, VerifierEngine  # noqa: E402
from services.verifier.reference import ReferenceModel  # noqa: E402
from services.verifier.sampling import Sampling  # noqa: E402
from services.verifier.server import build_engine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--out", default="bench/results/prefill_replay.json")
    p.add_argument("--commit", default=None)
    args = p.parse_args()
    graphed = build_engine(VerifierSettings(model_path=args.model, device="cuda", dtype="bfloat16",
                                            kv_capacity_tokens=1 << 17, warmup_budgets=()))
    assert graphed.graphs is not None
    padded = VerifierEngine(graphed.model, graphed.model.new_cache(graphed.cache.num_pages, graphed.cache.page_size),
                            graphed.max_context, graphed.prefill_chunk)
    layers = drafter_layers(args.model)
    lengths, prompts = random_prompts(graphed.vocab_size)
    rids = [f"p{i}" for i in range(PROMPTS)]
    logits, feats = [], []
    for engine in (graphed, padded):
        engine.set_feature_layers(layers)
        if engine is padded:
            engine.enable_graphs(capture=False, batch_buckets=graphed.graphs.batch_buckets,
                                 node_buckets=graphed.graphs.node_buckets)
        logits.append(recorded_logits(engine))
        out = engine.prefill([PrefillInput(r, pr, Sampling(), reserve_tokens=len(pr) + 1) for r, pr in zip(rids, prompts)])
        assert all(i.error is None for i in out.items)
        feats.append(out.features.float())
    kv = [diff(cached_kv(graphed, r), cached_kv(padded, r))[0] for r in rids]
    lg = [diff(logits[0][r], logits[1][r])[0] for r in rids]
    rows = [{"row": "replay_vs_padded", "prompts": PROMPTS,
             "bitwise_equal": max(kv) == 0 and max(lg) == 0 and torch.equal(feats[0], feats[1]),
             "logits_max_abs": max(lg), "kv_max_abs": max(kv), "features_max_abs": diff(*feats)[0],
             "first_tokens_equal": sum(graphed._requests[r].pending == padded._requests[r].pending for r in rids)}]
    ref = ReferenceModel.load(Path(args.model))
    truth = [ref.forward(torch.tensor(pr))[0][-1] for pr in prompts]
    rows.append({"row": "reference", **{f"{name}_rel": [round(diff(seen[r].double().cpu(), t)[1], 5) for r, t in zip(rids, truth)]
                                        for name, seen in (("graphs", logits[0]), ("padded", logits[1]))}})
    for row in rows:
        print(row, flush=True)
    write_result(args.out, args.commit, {"model": "/".join(Path(args.model).parts[-2:]), "dtype": "bfloat16",
                                         "moe_config": os.environ[CONFIG_ENV], "prompt_lengths": lengths}, rows)


if __name__ == "__main__":
    main()
