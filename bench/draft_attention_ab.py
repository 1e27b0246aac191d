"""The drafter's context attention, one layer, on the GPU: K/V heads repeated for every query head
(``repeat_interleave``, served before) against the query heads stacked on their KV head
(``services.draft.dflash.grouped_attention``, served now). Both take the context cat with the
block's keys, as the propose does. Reports the time of each (CUDA events, median of 20), the
largest difference against a float32 reference, and the bytes the repeat wrote.

    python -m bench.draft_attention_ab --commit <sha> --out <dir>/draft-attention-ab.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import write_result
from services.draft.dflash import grouped_attention

# (heads, kv_heads, head_dim): the demo drafter's, and two Qwen3-style drafters' of larger targets
HEADS = [(8, 4, 32), (32, 8, 128), (64, 8, 128)]
BATCHES = [8, 32]
CONTEXTS = [1024, 4096]
BLOCK = 16


def repeated(q, ctx_k, kb, ctx_v, vb, mask):
    """The served code before: every query head's own copy of its KV head."""
    R, B, H, hd = q.shape
    groups = H // kb.shape[2]
    k = torch.cat([ctx_k, kb], dim=1).repeat_interleave(groups, dim=2)
    v = torch.cat([ctx_v, vb], dim=1).repeat_interleave(groups, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2).reshape(R, B, H * hd)


def stacked(q, ctx_k, kb, ctx_v, vb, mask):
    return grouped_attention(q, torch.cat([ctx_k, kb], dim=1), torch.cat([ctx_v, vb], dim=1), mask)


def _median_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(sorted(times)[len(times) // 2], 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for heads, kv_heads, hd in HEADS:
        for batch in BATCHES:
            for context in CONTEXTS:
                rnd = lambda *shape: torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
                q = rnd(batch, BLOCK, heads, hd)
                ctx_k, ctx_v = rnd(batch, context, kv_heads, hd), rnd(batch, context, kv_heads, hd)
                kb, vb = rnd(batch, BLOCK, kv_heads, hd), rnd(batch, BLOCK, kv_heads, hd)
                lens = torch.randint(context // 2, context + 1, (batch,), generator=g, device="cuda")
                valid = torch.arange(context, device="cuda")[None, :] < lens[:, None]
                mask = torch.cat([valid, torch.ones(batch, BLOCK, dtype=torch.bool, device="cuda")], 1)[:, None, None, :]
                inputs = (q, ctx_k, kb, ctx_v, vb, mask)
                want = repeated(*(t.float() if t.is_floating_point() else t for t in inputs))
                row = dict(heads=heads, kv_heads=kv_heads, head_dim=hd, batch=batch, context=context, block=BLOCK,
                           repeat_mb=round(2 * batch * (context + BLOCK) * heads * hd * 2 / 1e6, 1))
                for name, fn in (("repeated", repeated), ("stacked", stacked)):
                    row[f"{name}_err"] = round((fn(*inputs).float() - want).abs().max().item(), 5)
                    row[f"{name}_ms"] = _median_ms(lambda: fn(*inputs))
                row["speedup"] = round(row["repeated_ms"] / row["stacked_ms"], 2)
                rows.append(row)
                print(row, flush=True)
    write_result(args.out, args.commit, dict(heads=HEADS, batches=BATCHES, contexts=CONTEXTS, block=BLOCK,
                                             dtype="bfloat16"), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
