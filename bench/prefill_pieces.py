"""Long prompts in pieces on the GPU: what the arrival of long prompts costs the streams already running.

Two stacks of the demo model (`--device` / `--dtype`: CUDA, bfloat16) that differ in `scheduler.max_prefill_tokens` only:
8192, where the demo's longest prompts go whole in one step, and `--piece` (default 256), where they
go in pieces over several steps with the running requests' verify steps between them. In each:

1. alone, at batch 1: each long prompt greedy, DDTree (budget 16) and autoregressive, 16 tokens;
2. under load: `--streams` greedy DDTree streams decode (ignore_eos); once each has streamed, the
   long prompts arrive together. Per running stream, the largest gap between two of its messages
   from the arrival until the last long prompt's first token, and the median gap before the
   arrival; per long prompt, its time to first token.

    python -m bench.prefill_pieces --commit SHA --out bench/results/prefill_pieces-SHA.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from tokenizers import Tokenizer

from bench.common import write_result
from services.common.launcher import Stack, StackSpec
from services.scheduler.client import AsyncClient

MODEL = "models/demo"


def long_prompts(n: int, tokens: int) -> list[list[int]]:
    """``n`` different prompts of ``tokens`` ids each, cut from the demo's held-out texts."""
    tok = Tokenizer.from_file(str(Path(MODEL) / "tokenizer.json"))
    texts = [p["text"] for p in json.loads((Path(MODEL) / "heldout_prompts.json").read_text())["prompts"]]
    ids = tok.encode("\n".join(texts * 50), add_special_tokens=False).ids
    assert len(ids) >= (n + 1) * tokens, f"{len(ids)} ids for {n} prompts of {tokens}"
    return [ids[i * tokens + i:(i + 1) * tokens + i] for i in range(n)]


async def alone(addr: str, prompts: list[list[int]]) -> list[dict]:
    async with AsyncClient(addr) as c:
        rows = []
        for p in prompts:
            dd = await c.generate(p, max_tokens=16, budget=16, ignore_eos=True)
            ar = await c.generate(p, max_tokens=16, mode="autoregressive", ignore_eos=True)
            rows.append(dict(ddtree=dd.token_ids, autoregressive=ar.token_ids))
        return rows


async def under_load(addr: str, streams: int, prompts: list[list[int]], short: list[list[int]], max_tokens: int) -> dict:
    async with AsyncClient(addr) as c:
        stamps: list[list[float]] = [[] for _ in range(streams)]

        async def stream(i: int) -> None:
            async for _ in c.stream(short[i % len(short)], max_tokens=max_tokens, budget=16, ignore_eos=True):
                stamps[i].append(time.perf_counter())

        async def first_token(p: list[int]) -> float:
            t0 = time.perf_counter()
            async for chunk in c.stream(p, max_tokens=4, budget=16, ignore_eos=True):
                if chunk.token_ids:
                    return time.perf_counter() - t0
            raise RuntimeError("no token")

        tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
        while min(len(s) for s in stamps) < 5:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        arrival = time.perf_counter()
        ttft = await asyncio.gather(*[first_token(p) for p in prompts])
        done = arrival + max(ttft)
        await asyncio.sleep(0.3)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def gaps(s: list[float], lo: float, hi: float) -> list[float]:
        return [b - a for a, b in zip(s, s[1:]) if lo <= b and a <= hi]

    during = [max(gaps(s, arrival, done), default=0.0) * 1e3 for s in stamps]
    before = [statistics.median(gaps(s, 0.0, arrival)) * 1e3 for s in stamps]
    return dict(max_gap_during_ms=[round(x, 1) for x in during], median_gap_before_ms=[round(x, 1) for x in before],
                ttft_ms=[round(x * 1e3, 1) for x in ttft])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/prefill_pieces.json")
    ap.add_argument("--piece", type=int, default=256)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--long", type=int, default=4, help="long prompts arriving together")
    ap.add_argument("--tokens", type=int, default=1800, help="tokens a long prompt")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--stream-tokens", type=int, default=1500, help="max_tokens of a running stream")
    args = ap.parse_args()
    prompts = long_prompts(args.long, args.tokens)
    short = [p[:48] for p in long_prompts(args.streams, 48)]
    env = {"DDTREE_VERIFIER_DEVICE": args.device, "DDTREE_DRAFT_DEVICE": args.device,
           "DDTREE_VERIFIER_DTYPE": args.dtype, "DDTREE_DRAFT_DTYPE": args.dtype, "DDTREE_DRAFT_WARMUP_BUDGETS": "16",
           "DDTREE_VERIFIER_RING_SLOT_BYTES": str(64 << 20)}
    rows, outputs = [], {}
    for name, budget in (("whole", 8192), ("pieces", args.piece)):
        spec = StackSpec(model_path=MODEL, scheduler_port=0, startup_timeout_s=400.0,
                         extra_env={**env, "DDTREE_SCHEDULER_MAX_PREFILL_TOKENS": str(budget)})
        with Stack(spec) as stack:
            outputs[name] = asyncio.run(alone(stack.scheduler_address, prompts))
            load = asyncio.run(under_load(stack.scheduler_address, args.streams, prompts, short, args.stream_tokens))
        row = dict(prefill=name, max_prefill_tokens=budget,
                   ddtree_equals_ar_alone=sum(o["ddtree"] == o["autoregressive"] for o in outputs[name]),
                   worst_gap_during_ms=max(load["max_gap_during_ms"]),
                   median_gap_before_ms_all=round(statistics.median(load["median_gap_before_ms"]), 1),
                   ttft_ms_max=max(load["ttft_ms"]), **load)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}), flush=True)
    same = sum(a["ddtree"] == b["ddtree"] for a, b in zip(outputs["whole"], outputs["pieces"]))
    for row in rows:
        row["ddtree_alone_same_as_whole"] = same
    print(json.dumps(dict(ddtree_alone_same_as_whole=same, of=len(prompts))), flush=True)
    write_result(args.out, args.commit,
                 dict(model=MODEL, device=args.device, dtype=args.dtype, piece=args.piece, stream_tokens=args.stream_tokens, streams=args.streams, long_prompts=args.long,
                      long_tokens=args.tokens, stream_prompt_tokens=48, budget=16,
                      note="max_gap_during_ms: per running stream, its largest gap between messages from the long "
                           "prompts' arrival to the last one's first token; alone: each long prompt at batch 1"),
                 rows)


if __name__ == "__main__":
    main()
