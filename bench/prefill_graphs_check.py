"""Prompts replayed through the verify graphs equal prompts run eagerly (GPU, demo model, bf16).

Two engines on one GPU: one as ``build_engine`` serves (graphs captured, warm-up run: a step's
prompts replay graph buckets, ``VerifierEngine.prefill``), one eager (``cuda_graphs`` off: the
prompts share eager forwards). The same prefill call of random prompts (1 to 700 tokens: several
graph rounds; some sampling with seeds) runs on both; then greedy decoding, one token a step, on
both. Rows:

* ``prefill``: the first tokens' agreement (greedy, and seeded sampling), the last rows' logits,
  the KV committed and the features, as max abs difference and relative norm;
* ``prefill_same_chunks``: the same against eager forwards in the graphs' chunk size (a third
  engine), which separates what the chunk boundaries change from what the replay does;
* ``noise``: the same figures between the eager engine's call and each prompt run alone on it
  (other forwards, other roundings): what bf16 alone moves;
* ``reference``: each engine's first-token logits against the float64 reference forward of the
  whole prompt (``ReferenceModel``, CPU), prompt by prompt (relative norm of the difference);
* ``decode``: greedy tokens generated after the prompts, equal position by position until the
  first difference (a bf16 rounding flip may change a token, and every one after it).

Usage: python -m bench.prefill_graphs_check [--model models/demo] [--out FILE] [--commit SHA]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import write_result
from services.common.checkpoint import read_config
from services.common.settings import VerifierSettings
from services.draft.config import DraftConfig
from services.verifier.engine import PrefillInput, VerifierEngine
from services.verifier.reference import ReferenceModel
from services.verifier.sampling import Sampling
from services.verifier.server import build_engine

PROMPTS, LONGEST, DECODE = 48, 700, 24


def cached_kv(engine: VerifierEngine, rid: str) -> torch.Tensor:
    """[layers, length, dim]: the request's committed KV."""
    pages, size = engine.cache.page_ids(rid), engine.cache.page_size
    pos = range(engine._requests[rid].length)
    return engine.cache.kv[:, [pages[p // size] for p in pos], [p % size for p in pos]].float()


def recorded_logits(engine: VerifierEngine) -> dict[str, torch.Tensor]:
    """The first-token logits each request's prefill samples from, by request id."""
    seen: dict[str, torch.Tensor] = {}
    posterior = engine._posterior

    def record(logits, reqs, counts, drawn, rows=None):
        if list(counts) == [1] * len(reqs) and rows is None:   # a prefill's last rows
            for r, row in zip(reqs, logits):
                seen[r.request_id] = row.float().clone()
        return posterior(logits, reqs, counts, drawn, rows)

    engine._posterior = record
    return seen


def random_prompts(vocab_size: int) -> tuple[list[int], list[list[int]]]:
    """The checks' prompt lengths (one token, one node bucket, one past it, the longest; then
    random) and token ids: the same in every script and run."""
    g = torch.Generator().manual_seed(0)
    lengths = [1, 129, 130, LONGEST] + torch.randint(1, LONGEST + 1, (PROMPTS - 4,), generator=g).tolist()
    return lengths, [torch.randint(2, vocab_size, (n,), generator=g).tolist() for n in lengths]


def drafter_layers(model: str) -> list[int]:
    """The target layers the model's drafter reads (its features), as a handshake names them."""
    return list(DraftConfig.from_hf(read_config(Path(model) / "drafter")).target_layer_ids)


def diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    return float((a - b).abs().max()), float((a - b).norm() / b.norm().clamp_min(1e-12))


def compare(name: str, a: VerifierEngine, b: VerifierEngine, la: dict, lb: dict, outs: tuple, rids: list[str],
            ids_b: list[str] | None = None) -> dict:
    ids_b = ids_b or rids
    greedy = [i for i, r in enumerate(rids) if a._requests[r].sampling.temperature == 0]
    logits = [diff(la[r], lb[s]) for r, s in zip(rids, ids_b)]
    kv = [diff(cached_kv(a, r), cached_kv(b, s)) for r, s in zip(rids, ids_b)]
    margin = [float(torch.topk(lb[s], 2).values.diff().abs()) for s in ids_b]
    same = [a._requests[r].pending == b._requests[s].pending for r, s in zip(rids, ids_b)]
    return {"row": name, "prompts": len(rids), "greedy_first_equal": sum(same[i] for i in greedy), "greedy": len(greedy),
            "sampled_first_equal": sum(same) - sum(same[i] for i in greedy),
            "differing_first_token_margins": [round(margin[i], 4) for i in range(len(rids)) if not same[i]],
            "logits_max_abs": round(max(d[0] for d in logits), 4), "logits_rel": round(max(d[1] for d in logits), 5),
            "kv_max_abs": round(max(d[0] for d in kv), 4), "kv_rel": round(max(d[1] for d in kv), 5),
            "features_max_abs": round(diff(*outs)[0], 4), "features_rel": round(diff(*outs)[1], 5)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--out", default="bench/results/prefill_graphs.json")
    p.add_argument("--commit", default=None)
    args = p.parse_args()
    common = dict(model_path=args.model, device="cuda", dtype="bfloat16", kv_capacity_tokens=1 << 17)
    graphed = build_engine(VerifierSettings(**common))
    eager = build_engine(VerifierSettings(**common, cuda_graphs=False, warmup_budgets=()))
    assert graphed.graphs is not None and eager.graphs is None
    # eager in the graphs' chunks: what chunk boundaries alone change (a chunk reads the ones
    # before it from the bf16 cache), apart from the replay
    chunked = build_engine(VerifierSettings(**common, cuda_graphs=False, warmup_budgets=(),
                                            prefill_chunk=graphed.graphs.node_buckets[-1]))
    layers = drafter_layers(args.model)
    lengths, prompts = random_prompts(graphed.vocab_size)
    params = [Sampling(temperature=0.8, top_k=40, seed=i) if i % 4 == 3 else Sampling() for i in range(PROMPTS)]
    rids = [f"p{i}" for i in range(PROMPTS)]
    logits, outs = [], []
    for engine in (graphed, eager, chunked):
        engine.set_feature_layers(layers)
        logits.append(recorded_logits(engine))
        out = engine.prefill([PrefillInput(r, pr, s, reserve_tokens=len(pr) + DECODE + 1)
                              for r, pr, s in zip(rids, prompts, params)])
        assert all(i.error is None for i in out.items), [i.error for i in out.items if i.error]
        outs.append(out.features.float())
    rows = [compare("prefill", graphed, eager, logits[0], logits[1], tuple(outs[:2]), rids),
            compare("prefill_same_chunks", graphed, chunked, logits[0], logits[2], (outs[0], outs[2]), rids)]
    ref = ReferenceModel.load(Path(args.model))
    truth = [ref.forward(torch.tensor(pr))[0][-1] for pr in prompts]   # [V] float64 each
    errors = {name: [diff(seen[r].double().cpu(), t)[1] for r, t in zip(rids, truth)]
              for name, seen in (("graphs", logits[0]), ("eager", logits[1]), ("eager_same_chunks", logits[2]))}
    rows.append({"row": "reference", **{f"{name}_rel_max": round(max(e), 5) for name, e in errors.items()},
                 **{f"{name}_rel_median": round(sorted(e)[len(e) // 2], 5) for name, e in errors.items()},
                 **{f"{name}_rel": [round(x, 5) for x in e] for name, e in errors.items()},
                 "graphs_vs_eager_rel": [round(diff(logits[0][r], logits[1][r])[1], 5) for r in rids]})
    alone = [f"a{i}" for i in range(min(16, PROMPTS))]
    feats = torch.cat([eager.prefill([PrefillInput(a, prompts[i], params[i], reserve_tokens=len(prompts[i]) + 1)]).features.float()
                       for i, a in enumerate(alone)])
    rows.append(compare("noise", eager, eager, logits[1], logits[1], (outs[1][:feats.shape[0]], feats), rids[:len(alone)], alone))
    eager.release(alone)
    greedy = [r for r, s in zip(rids, params) if s.temperature == 0]
    tokens: list[list[list[int]]] = []
    for engine in (graphed, eager):
        gen = [[engine._requests[r].pending] for r in greedy]
        for _ in range(DECODE):
            roots = torch.tensor([t[-1] for t in gen])
            n = len(greedy)
            step = engine.verify(greedy, roots, torch.full((n,), -1), torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.int64))
            for t, item in zip(gen, step.items):
                t += item.tokens
        tokens.append(gen)
    agree = []
    for x, y in zip(*tokens):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
        agree.append(k)
    rows.append({"row": "decode", "requests": len(greedy), "tokens_each": DECODE + 1,
                 "all_equal": sum(k == DECODE + 1 for k in agree), "first_difference_at": sorted(agree)})
    for row in rows:
        print(row, flush=True)
    model = "/".join(Path(args.model).parts[-2:])
    write_result(args.out, args.commit, {"model": model, "dtype": "bfloat16", "prompt_lengths": lengths,
                                         "sampled_every": 4, "decode_steps": DECODE, "feature_layers": layers}, rows)


if __name__ == "__main__":
    main()
