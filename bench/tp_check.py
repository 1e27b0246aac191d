"""TP=2 against TP=1 on GPUs: the three-process stack, greedy and sampled.

float32: eager verify (the torch expert loop cannot be captured); outputs are expected to be
identical, though sums in another order can still flip a near-exact tie (reported, not asserted).
bfloat16: the fused INT4 MoE and CUDA-graph verify on every rank (all-reduces inside the graphs);
TP=2 sums partial results in another order than TP=1, so in bf16 a sequence can drift after a
near tie: reported as identical count and the length of the common prefix. To tell that drift from
a bug, bf16 rows come with a baseline (TP=1 bf16 against TP=1 float32: how far bf16 rounding alone
carries), and the trained demo pair (held-out prompts, clearer margins than a random checkpoint's
nearly flat logits) repeats both the float32 equality and the bf16 rows.
Writes bench/results/tp-equivalence.json. Needs two GPUs (rank i on cuda:i, NCCL, NVLS off).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from bench.common import copy_gbps_on, git_commit

from services.common.launcher import Stack, StackSpec
from services.common.make_checkpoint import make_random_checkpoint
from services.scheduler.client import Client


def common_prefix(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens two runs share."""
    return [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), min(len(u), len(v))) for u, v in zip(a, b)]


def compare(model: str, dtype: str, graphs: bool, a: list[list[int]], b: list[list[int]], tp: int = 2) -> dict:
    """A TP=2-vs-TP=1 row (tp=1: a bf16-vs-float32 baseline): identical greedy sequences, common prefixes."""
    return {"tp": tp, "model": model, "dtype": dtype, "cuda_graphs": graphs, "prompts": len(a),
            "max_tokens": len(a[0]), "greedy_identical": sum(x == y for x, y in zip(a, b)),
            "common_prefix_tokens": common_prefix(a, b)}


def run(model: Path, tp: int, prompts: list[list[int]], dtype: str = "float32",
        max_tokens: int = 32) -> tuple[list[list[int]], list[int]]:
    env = {"DDTREE_VERIFIER_TP": str(tp), "DDTREE_VERIFIER_DEVICE": "cuda", "DDTREE_DRAFT_DEVICE": "cuda",
           "DDTREE_VERIFIER_DTYPE": dtype, "DDTREE_DRAFT_DTYPE": dtype,
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    with Stack(StackSpec(model_path=str(model), scheduler_port=0, extra_env=env)) as stack, \
            Client(stack.scheduler_address) as c:
        greedy = [c.generate(p, max_tokens=max_tokens, budget=16, ignore_eos=True).token_ids for p in prompts]
        sampled = c.generate(prompts[0], max_tokens=max_tokens, budget=16, temperature=1.0, seed=11, ignore_eos=True)
        return greedy, sampled.token_ids


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/tp-equivalence.json")
    p.add_argument("--commit", default="")
    p.add_argument("--demo", default="models/demo", help="trained checkpoint for the rows with clear margins")
    p.add_argument("--models", default="random,demo", help="which checkpoints: random, demo or both")
    args = p.parse_args()
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    rows: list[dict] = []
    if "random" in args.models:
        model = make_random_checkpoint(Path(tempfile.mkdtemp()) / "ckpt", vocab_size=512, seed=5,
                                       target_overrides={"moe_intermediate_size": 128})
        prompts = [[3 + (7 * i + 11 * j) % 200 for j in range(20)] for i in range(6)]
        g1, s1 = run(model, 1, prompts)
        g2, s2 = run(model, 2, prompts)
        rows.append({"tp": 2, "dtype": "float32", "cuda_graphs": False, "prompts": len(prompts),
                     "greedy_identical": sum(a == b for a, b in zip(g1, g2)), "sampled_identical": s1 == s2})
        b1, _ = run(model, 1, prompts, "bfloat16")
        b2, _ = run(model, 2, prompts, "bfloat16")
        rows.append(compare("random", "bfloat16", True, b1, b2))
        rows.append(compare("random", "bfloat16 vs float32", True, b1, g1, tp=1))
    if "demo" in args.models:
        demo = Path(args.demo)
        held = [p["ids"] for p in json.loads((demo / "heldout_prompts.json").read_text())["prompts"]][:6]
        f1, _ = run(demo, 1, held, "float32", max_tokens=64)
        f2, _ = run(demo, 2, held, "float32", max_tokens=64)
        d1, _ = run(demo, 1, held, "bfloat16", max_tokens=64)
        d2, _ = run(demo, 2, held, "bfloat16", max_tokens=64)
        rows.append(compare("demo", "float32", False, f1, f2))
        rows.append(compare("demo", "bfloat16", True, d1, d2))
        rows.append(compare("demo", "bfloat16 vs float32", True, d1, f1, tp=1))
        rows.append(compare("demo", "bfloat16 (TP=2) vs float32 (TP=1)", True, d2, f1))
    print(rows, flush=True)
    commit = git_commit(args.commit)
    doc = {"benchmark": Path(args.out).stem, "commit": commit or "unknown", "gpu": torch.cuda.get_device_name(0),
           "copy_gbps": copy_gbps_on("cuda"), "params": {"models": {"random": "make-checkpoint, moe_intermediate 128, 6 synthetic prompts, 32 tokens",
                                                    "demo": "the bundled demo pair, first 6 held-out prompts, 64 tokens"},
                                         "dtypes": ["float32", "bfloat16"], "budget": 16,
                                         "rows": "TP=2 against TP=1 unless the dtype says otherwise"}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
