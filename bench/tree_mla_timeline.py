"""Where a CTA of the Gluon tree-MLA kernel spends its time, tile by tile, from SM clock stamps.

Why: Nsight's counters (``bench/tree_mla_ncu.py``) say no unit is saturated at batch 32 x 4096 and
the warps mostly wait, but not on what. A traced build of ``kernels/tree_mla_hopper.py``
(``tree_mla_hopper(trace=...)``) stamps each partition's SM clock around every wait of its loop.
For a tile ``j`` a consumer warpgroup owns (phases in ``PHASES``, stamps 0-5 of its slot):

* ``kv_wait``: j's keys not landed yet;
* ``p_wait``: issue of j's logits, then the other warpgroup's P of tile j-1;
* ``mma_wait``: its half of ``P V`` for j-1 issued (after the accumulator's rescale) and, with
  j's logits, finished;
* ``softmax``: j's masks, max, exponentials and sums, P and the row statistics published;
* ``own_pv``: its half of ``P V`` for j;
* ``period``: loop top to loop top (two tiles), ``handoff``: j's P published to the other
  warpgroup seeing it; for the loader, ``free_wait`` (the ring slot still in use), ``issue`` (the
  copies issued) and ``landed_to_use`` (issue to a consumer past ``kv_wait``);
* per CTA: cycles from start to end, the global timer's start and end (waves, overlap);
* per kernel of the served call (``served_kernels_us``, torch.profiler, eager): the split kernel
  against the split merge.

Each point also runs the builds in ``VARIANTS`` (keyword arguments of ``tree_mla_hopper``: the
A/B hook for a schedule change): the output against the float32 reference, the traced output bit
for bit against the untraced one, and CUDA-graph replay times over input copies larger than L2.

    python -m bench.tree_mla_timeline --commit SHA --out bench/results/tree_mla_timeline.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

from bench.common import graph_replay_us, kernel_times, write_result
from bench.tree_mla_bench import ROTATE_BYTES, rel_err, rotating_cases
from kernels import tree_mla_hopper as hop
from kernels.tree_mla import tree_mla_reference

SHAPES = ((32, 4096, 8), (32, 4096, 9), (32, 16384, 8), (32, 4096, 17), (128, 4096, 9), (1, 4096, 9))  # batch, context, nodes
HEADS = 8
TILES = 160  # key tiles traced a CTA (a split of 4096 / 4 keys is 32 tiles of 32)
# Builds compared: keyword arguments of ``tree_mla_hopper``. tree_mla_timeline_ablations.json (commit
# 0b090eb) also ran two ablations that commit's kernel had (wrong output, timing only): no softmax
# arithmetic, no logits products; tree_mla_timeline_keys64.json (1d86c91) the other tile shape,
# dict(block_n=64, num_stages=2) (cycles then per pair of 64-key tiles); tree_mla_timeline_seesaw.json
# (93774c0) a schedule that commit had, schedule="seesaw" (its stamps: logits waited, row maxes
# swapped, P published, the other's P seen, both halves of P V done).
VARIANTS: dict[str, dict] = {"served": {}}
PHASES = dict(kv_wait=(0, 1), p_wait=(1, 2), mma_wait=(2, 3), softmax=(3, 4), own_pv=(4, 5))  # stamps


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 1) if xs else None


def phases(trace: torch.Tensor, n_tiles: list[int], stamps: dict[str, tuple[int, int]] = PHASES) -> dict:
    """Median cycles of each phase over every CTA's steady-state tiles (the first and last two left
    out). ``trace``: ``tree_mla_hopper``'s ``[CTAs, 3, tiles + 1, TRACE_EVENTS]`` stamps; ``n_tiles``:
    the key tiles of each CTA."""
    tr, tiles = trace.cpu().tolist(), trace.shape[2] - 1
    out: dict[str, list[float]] = {k: [] for k in list(stamps) + ["period", "handoff", "free_wait", "issue", "landed_to_use"]}
    for cta, n in enumerate(n_tiles):
        n = min(n, tiles)
        loader = tr[cta][0]
        for role in (0, 1):
            ev = tr[cta][1 + role]
            for j in range(2 + role, n - 2, 2):
                e = ev[j]
                for name, (a, b) in stamps.items():
                    out[name].append(e[b] - e[a])
                if j + 2 < n - 2:
                    out["period"].append(ev[j + 2][0] - e[0])
                out["handoff"].append(tr[cta][2 - role][j + 1][2] - e[4])  # tile j's P published -> seen
                out["landed_to_use"].append(e[1] - loader[j][1])  # slot freed and copies issued -> keys in use
        for t in range(2, n - 2):
            out["free_wait"].append(loader[t][1] - loader[t][0])
            if t + 1 < n:
                out["issue"].append(loader[t + 1][0] - loader[t][1])
    return {k: _median(v) for k, v in out.items()}


def cta_spans(trace: torch.Tensor, n_ctas: int) -> dict:
    """Per-CTA clock and wall-clock spans from the consumers' start / end stamps."""
    head = trace[:n_ctas, 1, -1].cpu()  # consumer 0: clock start, end, timer start, end, q landed
    cycles = (head[:, 1] - head[:, 0]).double()
    ns = (head[:, 3] - head[:, 2]).double()
    start = head[:, 2] - head[:, 2].min()
    return dict(cta_cycles_median=round(cycles.median().item(), 0), cta_us_median=round(ns.median().item() / 1e3, 2),
                ghz=round((cycles.sum() / ns.sum()).item(), 3),
                q_wait_cycles_median=round((head[:, 4] - head[:, 0]).double().median().item(), 0),
                kernel_span_us=round((head[:, 3].max() - head[:, 2].min()).item() / 1e3, 2),
                last_start_us=round(start.max().item() / 1e3, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_timeline.json")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, context, nodes in SHAPES:
        cases = rotating_cases(batch, context, nodes, HEADS)
        first = cases[0]
        rows_a_req = nodes * HEADS
        m_tiles = -(-rows_a_req // hop.BLOCK_M)
        splits = hop.choose_splits(batch, m_tiles, rows_a_req, context, 512, 64, sms)
        n_ctas = m_tiles * splits * batch

        def tiles_of(block_n: int) -> list[int]:
            """Key tiles of each CTA, in the kernel's split of the prefix."""
            chunk = _cdiv(_cdiv(context, splits), block_n) * block_n
            n_prefix = [max(0, min(chunk, context - s * chunk)) for s in range(splits)]
            return [_cdiv(n_prefix[s], block_n) + (_cdiv(nodes, block_n) if s == splits - 1 else 0)
                    for _ in range(batch) for s in range(splits) for _ in range(m_tiles)]

        want = tree_mla_reference(first.q_latent, first.q_pe, first.kv_cache, first.new_kv, first.host_meta, first.scale)
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=HEADS, rows=rows_a_req, m_tiles=m_tiles,
                   splits=splits, ctas=n_ctas, tiles_a_cta=max(tiles_of(32)))
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for name, kw in VARIANTS.items():
            got = hop.tree_mla_hopper(*first.args(), **kw)
            trace = torch.full((n_ctas, 3, TILES + 1, hop.TRACE_EVENTS), -1, dtype=torch.int64, device="cuda")
            torch.empty(ROTATE_BYTES, dtype=torch.uint8, device="cuda").fill_(1)  # the traced call finds a cold L2
            traced = hop.tree_mla_hopper(*first.args(), trace=trace, **kw)
            torch.cuda.synchronize()
            row[name] = dict(
                rel_err=round(rel_err(got, want), 6), traced_equals_untraced=bool(torch.equal(traced, got)),
                stamps_written=bool((trace[:, 1:, TILES, :5] >= 0).all().item()),
                traced_us=round(graph_replay_us([lambda c=c, t=trace, kw=kw: hop.tree_mla_hopper(*c.args(), trace=t, **kw)
                                                 for c in cases]), 2),
                **cta_spans(trace, n_ctas),
                cycles=phases(trace, tiles_of(kw.get("block_n", 32))))
            del trace
        for rnd in range(2):
            for name in (list(VARIANTS) if rnd == 0 else list(VARIANTS)[::-1]):
                kw = VARIANTS[name]
                times[name].append(graph_replay_us([lambda c=c, kw=kw: hop.tree_mla_hopper(*c.args(), **kw) for c in cases]))
        for name in VARIANTS:
            row[name]["us"] = round(min(times[name]), 2)
            row[name]["us_rounds"] = [round(x, 2) for x in times[name]]
        turn = itertools.count()  # eager calls rotating over the copies, as the replays do
        row["served_kernels_us"] = kernel_times(lambda cs=cases: hop.tree_mla_hopper(*cs[next(turn) % len(cs)].args()))
        rows.append(row)
        print(json.dumps(row), flush=True)
        del cases
        torch.cuda.empty_cache()
    write_result(args.out, args.commit,
                 dict(heads=HEADS, page_size=64, traced_tiles=TILES, phases=PHASES,
                      variants={k: v or "served" for k, v in VARIANTS.items()},
                      cycles="medians of SM clock differences over every CTA's tiles but its first and last two",
                      timing="whole tree_mla_hopper call, CUDA-graph replay rotating over input copies > L2; min of two "
                             "rounds, variants interleaved (second round reversed); traced builds timed once"),
                 rows)


if __name__ == "__main__":
    main()
