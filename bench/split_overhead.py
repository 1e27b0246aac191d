"""T-split: the same engine called in one process vs the three-process gRPC stack, C=1.

In-process: the verifier engine and the DFlash proposer called directly, the tree built in between,
no gRPC and no shared buffers. Three-process: `Stack` through the client SDK. Same model, prompts,
budget and greedy decoding; the outputs must match token for token. Also reports which transport
the stack negotiated. Writes bench/results/split-overhead.json (BENCHMARKS.md's result-file schema).

Fairness: both sides decode the same way (the stack's scheduler never pauses speculation here, as
the in-process loop cannot) and are warmed the same way before anything is timed (one request on
the first prompt, `--warmup-tokens` tokens, same budget: it compiles the per-budget tree kernel and
the verifier's kernels), and both are timed the same way: a request's wall time from sending it to
its last token, tok_s = tokens / wall over all prompts; step_ms = (wall - time to first token) /
verify steps, the steps counted from the acceptance lengths each side reports. The two sides run
alternately, `--reps` passes each, the side that leads swapped every pass (in, three, three, in,
...), so drift (clocks, other load) falls on both alike. A side's row is its median pass by tok_s,
every figure of it from that one pass. ratio = the median over passes of three_process tok_s /
in_process tok_s, each pass against the other side's pass beside it (T-split: >= 0.95).

Both sides draft alike on the GPU: propose and commit from the drafter's graphs, and the trees
built by `TreeGraphs` replays and brought to the host in one copy, as the draft service does
(an eager build took 0.17-0.42 ms more a step on an H100, which lowered the in-process side).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import add_step_sockets_arg, git_commit, measure_copy_gbps, step_sockets_env
from services.common.launcher import Stack, StackSpec
from services.common.make_checkpoint import make_random_checkpoint
from services.common.settings import DraftSettings, VerifierSettings
from services.draft.dflash import DFlashDrafter
from services.draft.proposer import DFlashProposer
from services.draft.tree import build_trees_from_logits
from services.draft.tree_graphs import TreeGraphs, pack_trees, unpack_trees
from services.scheduler.client import Client
from services.verifier.engine import PrefillInput
from services.verifier.sampling import Sampling
from services.verifier.server import build_engine

__all__ = ["Run", "InProcess", "ThreeProcess", "summarise", "main"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEMO = Path("models/demo")
PROMPT_TOKENS = 24   # synthetic prompts (random checkpoint); the demo model uses its held-out prompts


@dataclass
class Run:
    """One request, timed the same way on both sides."""

    tokens: list[int]
    seconds: float    # request sent -> last token
    first_s: float    # request sent -> first token (the prefill's)
    steps: int        # verify steps after the first token


def summarise(runs: Sequence[Run]) -> dict[str, float]:
    """tok_s over whole requests, and the decode part alone (after the first token)."""
    seconds = sum(r.seconds for r in runs)
    decode = sum(r.seconds - r.first_s for r in runs)
    steps = sum(r.steps for r in runs)
    return {"tok_s": sum(len(r.tokens) for r in runs) / seconds,
            "decode_tok_s": sum(len(r.tokens) - 1 for r in runs) / decode if decode > 0 else 0.0,
            "step_ms": 1e3 * decode / max(1, steps),
            "mean_acceptance": (sum(len(r.tokens) - 1 for r in runs) / steps) if steps else 0.0}


class InProcess:
    """Greedy DDTree with direct calls: the engine, the proposer and the tree build, nothing between."""

    def __init__(self, model: Path, device: str, dtype: str, budget: int) -> None:
        # One CPU thread, as each service of the stack has.
        self.engine = build_engine(VerifierSettings(model_path=str(model), device=device, dtype=dtype))
        drafter = DFlashDrafter.load(model / "drafter", model, dtype=DTYPES[dtype], device=device)
        self.proposer = DFlashProposer(drafter)
        self.tree_graphs: TreeGraphs | None = None
        if device.startswith("cuda"):   # as the draft service does: propose, commit and trees from graphs
            ds = DraftSettings()
            if ds.cuda_graphs:
                self.proposer.enable_graphs(ds.graph_rows, ds.graph_context)
                self.proposer.warm_up((1,), (64,))
                out = self.proposer.propose_output
                if out is not None:
                    self.tree_graphs = TreeGraphs(out, capture=True)
                    self.tree_graphs.warm_up([budget])
        self.engine.set_feature_layers(self.proposer.target_layer_ids)
        self.device = device
        self._ids = itertools.count()

    def _tree(self, logits: torch.Tensor, budget: int, root: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One request's tree on the host (tokens, parents, depths, sizes), as the draft service
        builds it: a `TreeGraphs` replay where the propose was one, else eagerly; one copy."""
        depth = self.proposer.block_size - 1
        trees = self.tree_graphs.build(logits, budget, depth, root) if self.tree_graphs is not None else None
        if trees is None:
            batch = build_trees_from_logits(logits, budget, root.to(logits.device), max_depth=depth)
            trees = unpack_trees(pack_trees(batch).cpu(), 1)
        sizes, tokens, parents, depths = trees
        n = int(sizes[0])
        return tokens[0, :n], parents[0, :n], depths[0, :n], sizes[:1]

    def generate(self, prompt: list[int], max_tokens: int, budget: int) -> Run:
        rid = f"r{next(self._ids)}"
        engine, proposer, device = self.engine, self.proposer, self.device
        t0 = time.perf_counter()
        proposer.start(rid, prompt)
        pre = engine.prefill([PrefillInput(rid, prompt, Sampling(), len(prompt) + max_tokens + proposer.block_size)])
        proposer.commit(rid, prompt, pre.features)
        out = list(pre.items[0].tokens)            # a host list: the first token is really there
        first = time.perf_counter() - t0
        pending, steps = out[-1], 0
        while len(out) < max_tokens:
            bonus = torch.tensor([pending])
            logits = proposer.propose([rid], bonus)                                    # [1, B-1, V]
            res = engine.verify([rid], *self._tree(logits, budget, bonus))
            item = res.items[0]
            proposer.commit(rid, [pending] + item.tokens[:-1], res.features)
            out += item.tokens
            pending = item.tokens[-1]
            steps += 1
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        engine.release([rid])
        proposer.drop(rid)
        return Run(out[:max_tokens], seconds, first, steps)


class ThreeProcess:
    """The stack through the client SDK; streaming, so the first token's arrival is seen."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def generate(self, prompt: list[int], max_tokens: int, budget: int) -> Run:
        t0 = time.perf_counter()
        first, tokens, steps = None, [], 0
        for chunk in self.client.stream(prompt, max_tokens=max_tokens, budget=budget, ignore_eos=True):
            first = first if first is not None else time.perf_counter() - t0
            tokens += chunk.token_ids
            steps += len(chunk.acceptance_lengths)   # one per verify step; the prefill reports none
        return Run(tokens, time.perf_counter() - t0, first or 0.0, steps)


Generate = Callable[[list[int], int, int], Run]


def passes(sides: dict[str, Generate], prompts: list[list[int]], max_tokens: int, budget: int, reps: int,
           warmup_tokens: int) -> dict[str, list[list[Run]]]:
    """Warm each side on the first prompt, then `reps` alternating passes over all prompts, the
    order reversed every other pass (A B, B A, A B, ...): a side that always went first would take
    any drift between the two alone."""
    for gen in sides.values():
        gen(prompts[0], warmup_tokens, budget)
    out: dict[str, list[list[Run]]] = {name: [] for name in sides}
    names = list(sides)
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            out[name].append([sides[name](p, max_tokens, budget) for p in prompts])
    return out


def median_pass(runs: list[list[Run]]) -> dict[str, float]:
    """The median pass by tok_s (the lower of the middle two for an even count), every figure
    from that one pass: a median taken figure by figure could mix passes into a row no pass had."""
    per = sorted((summarise(r) for r in runs), key=lambda s: s["tok_s"])
    return per[(len(per) - 1) // 2]


def paired_ratio(stack: list[list[Run]], inproc: list[list[Run]]) -> float:
    """The median over passes of the stack's tok_s over the in-process tok_s of the same round
    (the two ran beside each other, so a slow spell of the machine falls on both)."""
    return statistics.median(summarise(a)["tok_s"] / summarise(b)["tok_s"] for a, b in zip(stack, inproc))


def load_prompts(model: Path, count: int) -> list[list[int]]:
    """The model's held-out prompts when it ships them (demo), else short synthetic ones."""
    held = model / "heldout_prompts.json"
    if held.is_file():
        prompts = [list(p["ids"]) for p in json.loads(held.read_text())["prompts"]][:count]
        if prompts:
            return prompts
    return [[3 + (7 * i + 11 * j) % 200 for j in range(PROMPT_TOKENS)] for i in range(count)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(DEMO) if (DEMO / "config.json").is_file() else "",
                   help="checkpoint dir (default: models/demo when present, else a fresh random one)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup-tokens", type=int, default=8)
    add_step_sockets_arg(p)
    p.add_argument("--out", default="bench/results/split-overhead.json")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    model = Path(args.model) if args.model else make_random_checkpoint(Path(tempfile.mkdtemp()) / "ckpt")
    prompts = load_prompts(model, args.prompts)
    env = {f"DDTREE_{s}_DEVICE": args.device for s in ("VERIFIER", "DRAFT")}
    env.update({f"DDTREE_{s}_DTYPE": args.dtype for s in ("VERIFIER", "DRAFT")})
    env["DDTREE_DRAFT_WARMUP_BUDGETS"] = str(args.budget)
    env.update(step_sockets_env(args.step_sockets))
    # The same engine work on both sides: the scheduler's pause of speculation that does not pay
    # (scheduler.spec_min_acceptance) has no in-process twin, and its autoregressive steps would
    # count as steps of one token against the stack.
    env["DDTREE_SCHEDULER_SPEC_MIN_ACCEPTANCE"] = "0"
    with Stack(StackSpec(model_path=str(model), scheduler_port=0, extra_env=env, startup_timeout_s=300.0)) as stack, \
            Client(stack.scheduler_address) as client:
        transport = client.model_info().transport
        inproc = InProcess(model, args.device, args.dtype, args.budget)
        sides: dict[str, Generate] = {"in_process": inproc.generate, "three_process": ThreeProcess(client).generate}
        runs = passes(sides, prompts, args.max_tokens, args.budget, args.reps, args.warmup_tokens)
    same = sum(all(a.tokens == b.tokens for a, b in zip(col_in, col_st))
               for col_in, col_st in zip(zip(*runs["in_process"]), zip(*runs["three_process"])))
    stats = {name: median_pass(r) for name, r in runs.items()}
    ratios = {name: paired_ratio(r, runs["in_process"]) for name, r in runs.items()}
    rows = []
    for name, s in stats.items():
        row = {"deployment": name, "concurrency": 1, "step_ms": round(s["step_ms"], 3), "tok_s": round(s["tok_s"], 2),
               "decode_tok_s": round(s["decode_tok_s"], 2), "mean_acceptance": round(s["mean_acceptance"], 3),
               "ratio": round(ratios[name], 4),
               "tok_s_passes": [round(summarise(r)["tok_s"], 2) for r in runs[name]]}
        if name == "three_process":
            row.update(transport=transport, identical_outputs=same)
        rows.append(row)
        print(row, flush=True)
    on_gpu = args.device.startswith("cuda")
    gpu = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    copy_gbps = round(measure_copy_gbps(), 1) if on_gpu else None
    doc = {"benchmark": Path(args.out).stem, "commit": git_commit(args.commit), "gpu": gpu, "copy_gbps": copy_gbps,
           "params": {**{k: v for k, v in vars(args).items() if k not in ("out", "commit", "model")},
                      "model": args.model or "random", "prompt_lengths": [len(q) for q in prompts]},
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
