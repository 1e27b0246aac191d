"""T-split: the same engine called in one process vs the three-process gRPC stack, C=1.

In-process: the verifier engine and the DFlash proposer called directly, the tree built in between,
no gRPC and no shared buffers. Three-process: `Stack` through the client SDK. Same model, prompts,
budget and greedy decoding; the outputs must match token for token. Also reports which transport
the stack negotiated. Writes bench/results/split-overhead.json (TARGETS.md schema).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.common import git_commit

from services.common.launcher import Stack, StackSpec
from services.common.make_checkpoint import make_random_checkpoint
from services.common.settings import VerifierSettings
from services.draft.dflash import DFlashDrafter
from services.draft.proposer import DFlashProposer
from services.draft.tree import build_trees
from services.scheduler.client import Client
from services.verifier.engine import PrefillInput
from services.verifier.sampling import Sampling
from services.verifier.server import build_engine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def in_process(model: Path, device: str, dtype: str, prompts: list[list[int]], max_tokens: int,
               budget: int) -> tuple[list[list[int]], float, float]:
    """Greedy DDTree with direct calls; returns outputs, tok/s and mean step ms."""
    engine = build_engine(VerifierSettings(model_path=str(model), device=device, dtype=dtype))  # 1 CPU thread, as the stack
    drafter = DFlashDrafter.load(model / "drafter", model, dtype=DTYPES[dtype], device=device)
    proposer = DFlashProposer(drafter)
    engine.set_feature_layers(proposer.target_layer_ids)
    outs, tokens, steps, seconds = [], 0, 0, 0.0
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        proposer.start(rid, prompt)
        t0 = time.perf_counter()
        pre = engine.prefill([PrefillInput(rid, prompt, Sampling(), len(prompt) + max_tokens + 16)])
        proposer.commit(rid, prompt, pre.features)
        out = list(pre.items[0].tokens)
        pending = out[-1]
        while len(out) < max_tokens:
            bonus = torch.tensor([pending], device=device)
            logprobs = proposer.propose([rid], bonus)                                  # [1, B-1, V]
            tree = build_trees(logprobs.float(), budget, bonus)
            n = int(tree.sizes[0])
            res = engine.verify([rid], tree.tokens[0, :n], tree.parents[0, :n], tree.depths[0, :n],
                                tree.sizes[:1])
            item = res.items[0]
            proposer.commit(rid, [pending] + item.tokens[:-1], res.features)
            out += item.tokens
            pending = item.tokens[-1]
            steps += 1
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
        engine.release([rid])
        proposer.drop(rid)
        outs.append(out[:max_tokens])
        tokens += max_tokens
    return outs, tokens / seconds, 1e3 * seconds / max(1, steps)


def three_process(model: Path, device: str, dtype: str, prompts: list[list[int]], max_tokens: int,
                  budget: int) -> tuple[list[list[int]], float, str]:
    env = {f"DDTREE_{s}_DEVICE": device for s in ("VERIFIER", "DRAFT")}
    env.update({f"DDTREE_{s}_DTYPE": dtype for s in ("VERIFIER", "DRAFT")})
    with Stack(StackSpec(model_path=str(model), scheduler_port=0, extra_env=env)) as stack, \
            Client(stack.scheduler_address) as c:
        transport = c.model_info().transport
        c.generate(prompts[0], max_tokens=8, budget=budget, ignore_eos=True)   # warm-up
        t0 = time.perf_counter()
        outs = [c.generate(p, max_tokens=max_tokens, budget=budget, ignore_eos=True).token_ids for p in prompts]
        seconds = time.perf_counter() - t0
    return outs, len(prompts) * max_tokens / seconds, transport


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="", help="checkpoint dir (default: a fresh random one)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--out", default="bench/results/split-overhead.json")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    model = Path(args.model) if args.model else make_random_checkpoint(Path(tempfile.mkdtemp()) / "ckpt")
    prompts = [[3 + (7 * i + 11 * j) % 200 for j in range(24)] for i in range(args.prompts)]
    in_outs, in_tok_s, in_step = in_process(model, args.device, args.dtype, prompts, args.max_tokens, args.budget)
    st_outs, st_tok_s, transport = three_process(model, args.device, args.dtype, prompts, args.max_tokens,
                                                 args.budget)
    same = sum(a == b for a, b in zip(in_outs, st_outs))
    rows = [{"deployment": "in_process", "concurrency": 1, "step_ms": round(in_step, 3), "tok_s": round(in_tok_s, 2)},
            {"deployment": "three_process", "concurrency": 1, "step_ms": None, "tok_s": round(st_tok_s, 2),
             "transport": transport, "identical_outputs": same}]
    for r in rows:
        print(r, flush=True)
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    commit = git_commit(args.commit)
    doc = {"benchmark": "split-overhead", "commit": commit or "unknown", "gpu": gpu, "copy_gbps": None,
           "params": {**{k: v for k, v in vars(args).items() if k not in ("out", "commit")},
                      "model": args.model or "random"}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
