"""Mean acceptance length of DDTree with the demo pair on held-out prompts, and losslessness at T=0.

    python -m train.eval_acceptance --model models/demo

In-process, with the serving code itself: ``VerifierEngine`` (prefill, verify, accept, commit on
the paged cache), ``DFlashDrafter`` (context cache + block proposal) and ``build_trees``. For each
held-out prompt it decodes autoregressively (root-only trees) and with DDTree at every budget and
temperature; acceptance length = tokens a verify step gives the output (accepted drafts + the
bonus, cut where the output ends: EOS or max_new, as the server's usage counts them), pooled over all steps
of all prompts. ``identical_to_autoregressive`` counts the prompts whose DDTree output equals the
autoregressive output token for token: greedy at T=0; at T>0 with the same seed, since each token's
noise is keyed by the seed and its index, the output is the same draw whatever the trees. The
autoregressive side runs the same verify path with root-only trees, so for a check independent of
the serving forward, ``--reference-prompts N`` also decodes the first N prompts greedily with
``ReferenceModel`` (float64, no cache, no folded weights) and counts those equal.

Writes bench/results/acceptance-demo.json (and a .png plot when matplotlib is installed).
Held-out prompts: from the held-out files of train.corpus, the text up to and including the first
``def``/``class`` line (at most --prompt-tokens tokens, leading lines dropped to fit); saved once to
<model>/heldout_prompts.json so tests and later runs need no corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from bench.common import copy_gbps_on
from services.draft.dflash import DFlashDrafter
from services.draft.tree import build_trees_from_logits
from services.verifier.engine import PrefillInput, VerifierEngine
from services.verifier.model import TargetModel
from services.verifier.sampling import Sampling
from train.corpus import DEFAULT_DATA_DIR

__all__ = ["Generation", "DemoDecoder", "heldout_prompts", "main"]

BUDGETS = (1, 4, 8, 16, 32, 64)
TEMPERATURES = (0.0, 1.0)
PROMPTS_FILE = "heldout_prompts.json"


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (first = the prefill's sample), cut at max_new / after EOS
    acceptance: list[int]  # tokens emitted per verify step


class DemoDecoder:
    """Target engine + drafter in one process: the draft service's loop without gRPC."""

    def __init__(self, model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 pages: int = 128, page_size: int = 16) -> None:
        self.model = TargetModel.load(model_dir, dtype=dtype, device=device)
        self.drafter = DFlashDrafter.load(model_dir / "drafter", model_dir, dtype=dtype, device=device)
        cfg = self.model.config
        self.eos = set(cfg.eos_token_id)
        self.max_context = cfg.max_position_embeddings
        self.engine = VerifierEngine(self.model, self.model.new_cache(pages, page_size),
                                     max_context=self.max_context, prefill_chunk=512)
        self.engine.set_feature_layers(self.drafter.target_layer_ids)
        self._n = 0

    def generate(self, prompt: list[int], max_new: int, budget: int, sampling: Sampling) -> Generation:
        """``budget`` 0 = autoregressive (root-only trees through the same verify path)."""
        self._n += 1
        rid = f"r{self._n}"
        block = self.drafter.block_size
        out = self.engine.prefill([PrefillInput(rid, list(prompt), sampling, len(prompt) + max_new + block + 1)])
        item = out.items[0]
        if item.error is not None:
            raise RuntimeError(f"prefill failed: {item.error.message}")
        ctx = self.drafter.new_context()
        self.drafter.extend_context(ctx, out.features)
        length, pending = len(prompt), item.tokens[0]
        tokens, accs = [pending], []
        try:
            while len(tokens) < max_new and pending not in self.eos:
                depth = min(block - 1, self.max_context - 1 - length)
                root = torch.tensor([pending])
                if budget == 0 or depth <= 0:
                    t, p, d = root, torch.tensor([-1]), torch.tensor([0])
                else:
                    logits = self.drafter.propose([ctx], root.to(self.drafter.device))  # [1, block-1, V]
                    tree = build_trees_from_logits(logits[:, :depth], budget, root.to(logits.device))
                    n = int(tree.sizes[0])
                    t, p, d = (x[0, :n].cpu() for x in (tree.tokens, tree.parents, tree.depths))
                res = self.engine.verify([rid], t, p, d, torch.tensor([t.numel()]))
                it = res.items[0]
                if it.error is not None:
                    raise RuntimeError(f"verify failed: {it.error.message}")
                self.drafter.extend_context(ctx, res.features)
                length += it.committed
                pending = it.tokens[-1]
                kept = _through_eos(list(it.tokens[:max_new - len(tokens)]), self.eos)   # an EOS inside the path ends it
                tokens.extend(kept)
                accs.append(len(kept))
                if kept[-1] in self.eos:
                    break
        finally:
            self.engine.release([rid])
        return Generation(tokens, accs)


def _through_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS, as an output ends."""
    end = next((j for j, tok in enumerate(tokens) if tok in eos), len(tokens) - 1)
    return tokens[:end + 1]


def reference_agreement(model_dir: Path, prompts: list[dict], max_new: int, eos: set[int],
                        ar: list[Generation] | None) -> dict | None:
    """The greedy autoregressive outputs against ``ReferenceModel``'s greedy decode (float64, the
    whole sequence each token, no cache): the DDTree outputs are compared with the former, which
    shares the serving forward, so a bug in that forward would pass unseen without this."""
    if ar is None or not prompts:
        return None
    from services.verifier.reference import ReferenceModel

    ref = ReferenceModel.load(model_dir)
    equal = 0
    for p, g in zip(prompts, ar):
        equal += int(g.tokens == _through_eos(ref.greedy(list(p["ids"]), max_new), eos))
    return {"prompts": len(prompts), "equal": equal, "reference": "ReferenceModel, float64"}


def heldout_prompts(model_dir: Path, data_dir: Path, count: int, max_tokens: int) -> list[dict]:
    """``count`` held-out prompts [{"path", "text", "ids"}] (cached in <model>/heldout_prompts.json)."""
    cached = model_dir / PROMPTS_FILE
    if cached.is_file():
        prompts = json.loads(cached.read_text())["prompts"]
        if len(prompts) >= count:
            return prompts[:count]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stream = np.load(data_dir / "heldout.npy")
    files = json.loads((data_dir / "heldout_files.json").read_text())
    prompts = []
    # A pseudo-random but fixed sample: files in order of their path's sha256 (sorted by path, the
    # first twenty would be mostly near-identical generated codecs from encodings/).
    files = sorted(files, key=lambda f: hashlib.sha256(("prompt:" + f["path"]).encode()).hexdigest())
    for f in files:
        ids = stream[f["start"]: f["start"] + f["length"]].astype(np.int64).tolist()
        text = tok.decode(ids)
        lines = text.splitlines(keepends=True)
        end = next((i for i, line in enumerate(lines) if line.startswith(("def ", "class "))), None)
        if end is None:
            continue
        # Whole lines only: drop leading lines until the prompt fits in max_tokens.
        start = 0
        while start < end and len(tok.encode("".join(lines[start: end + 1])).ids) > max_tokens:
            start += 1
        pids = tok.encode("".join(lines[start: end + 1])).ids[-max_tokens:]
        prompts.append({"path": f["path"], "text": tok.decode(pids), "ids": pids})
        if len(prompts) == count:
            break
    cached.write_text(json.dumps({"source": "held-out files of train.corpus: text up to the first def/class line",
                                  "max_tokens": max_tokens, "prompts": prompts}, indent=1) + "\n")
    return prompts


def _git_commit(explicit: str | None) -> str:
    """HEAD's sha read from .git (no git process), or ``explicit``/$BENCH_COMMIT when given."""
    if explicit:
        return explicit
    git = Path(".git")
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return "unknown"


def _plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for temp in result["params"]["temperatures"]:
        rows = [r for r in result["rows"] if r["temperature"] == temp]
        ax.plot([r["budget"] for r in rows], [r["mean_acceptance"] for r in rows], marker="o", label=f"T={temp:g}")
    ax.set_xscale("log", base=2)
    budgets = result["params"]["budgets"]
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("tree budget (draft nodes)")
    ax.set_ylabel("mean acceptance length (tokens / verify step)")
    p = result["params"]
    ax.set_title(f"DDTree, demo pair, {p['prompts']} held-out prompts, {p['max_new_tokens']} new tokens")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("models/demo"))
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    ap.add_argument("--out", type=Path, default=Path("bench/results/acceptance-demo.json"))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--temperatures", default=",".join(map(str, TEMPERATURES)))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    ap.add_argument("--reference-prompts", type=int, default=3,
                    help="prompts whose greedy autoregressive output is also checked against the float64 reference")
    args = ap.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]

    torch.manual_seed(args.seed)
    prompts = heldout_prompts(args.model, args.data, args.prompts, args.prompt_tokens)
    dec = DemoDecoder(args.model, device=args.device)
    t0 = time.time()
    sampling = {temp: [Sampling(temperature=temp, seed=args.seed * 1000 + i if temp > 0 else None)
                       for i in range(len(prompts))] for temp in temperatures}
    ar = {temp: [dec.generate(p["ids"], args.max_new, 0, sampling[temp][i]) for i, p in enumerate(prompts)]
          for temp in temperatures}
    print(f"autoregressive: {len(prompts)} prompts x {len(temperatures)} temperatures ({time.time() - t0:.0f}s)",
          flush=True)
    checked = reference_agreement(args.model, prompts[:args.reference_prompts], args.max_new, dec.eos,
                                  ar[0.0] if 0.0 in ar else None)
    rows = []
    for temp in temperatures:
        for budget in budgets:
            accs: list[int] = []
            same = 0
            for i, p in enumerate(prompts):
                g = dec.generate(p["ids"], args.max_new, budget, sampling[temp][i])
                accs.extend(g.acceptance)
                same += int(g.tokens == ar[temp][i].tokens)
            row = {"budget": budget, "temperature": temp, "prompts": len(prompts),
                   "mean_acceptance": round(sum(accs) / max(1, len(accs)), 4), "verify_steps": len(accs),
                   "identical_to_autoregressive": same}
            rows.append(row)
            print(f"budget {budget:3d} T={temp:g}: mean acceptance {row['mean_acceptance']:.3f} over {len(accs)} steps"
                  f", identical to AR {same}/{len(prompts)} ({time.time() - t0:.0f}s)", flush=True)
    result = {
        "benchmark": args.out.stem,
        "commit": _git_commit(args.commit),
        "gpu": "cpu" if args.device == "cpu" else torch.cuda.get_device_name(torch.device(args.device)),
        "copy_gbps": copy_gbps_on(args.device),   # every GPU result file's (a quality figure here)
        "params": {
            "model": str(args.model), "prompts": len(prompts), "prompt_source": "held-out split, up to the first def/class",
            "max_new_tokens": args.max_new, "budgets": budgets, "temperatures": temperatures,
            "block_size": dec.drafter.block_size, "target_layer_ids": list(dec.drafter.target_layer_ids),
            "dtype": "float32", "device": args.device, "top_p": 1.0, "top_k": 0, "seed": args.seed,
            "acceptance": "tokens a verify step gives the output (accepted draft tokens + 1, cut at EOS or "
                          "max_new_tokens), pooled over steps",
            "stop": "EOS or max_new_tokens",
            "identical_to_autoregressive": "T=0: greedy; T>0: the same seed a prompt (keyed noise)",
            "autoregressive_equals_float64_reference": checked,
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plotted = _plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out}" + (f" and {args.out.with_suffix('.png')}" if plotted else " (no matplotlib: no plot)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
