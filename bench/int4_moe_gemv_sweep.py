"""Sweep of the fused INT4 MoE's GEMV small-M path (kernels/int4_moe.py, ``Int4MoEConfig.gemv``).

Sets ``choose_config``'s GEMV thresholds and launch parameters. Per shape (Kimi-K2 TP8 / EP8 per
rank) and token count, in order: the GEMV output (``choose_config``'s GEMV parameters) against
the tensor-core path (``choose_config``'s config with ``gemv=False``) and the fp32 reference; a
grid of gate/up configs and one of down configs, each kernel timed alone (down fed by the best
gate/up's ``h``), so the grid is a sum, not a product; pipelined-load variants (``stages``) of
the fastest few of each; then the best pair and the tensor-core path end to end.

Timing as in int4_moe_bench.py: CUDA-graph replay of R back-to-back calls with R different
random routings, so a call's experts are not L2-resident from the call before. Configs whose
fp32 accumulators alone need more than ``MAX_ACC_REGS`` registers a thread are skipped (certain
spills, slow to compile); configs that fail to compile or run are recorded, not fatal.

    PYTHONPATH=. python bench/int4_moe_gemv_sweep.py --commit SHA   # H200: about 2-3 min
    python bench/int4_moe_gemv_sweep.py --dry-run                     # CPU interpreter, tiny shapes: the logic only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if "--dry-run" in sys.argv:  # before triton's first import: the kernels run in the CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import git_commit  # noqa: E402
from bench.int4_moe_bench import _precompile as _precompile_tensor_cores  # noqa: E402
from bench.int4_moe_bench import (  # noqa: E402
    GROUP,
    SHAPES,
    copy_bandwidth_gbps,
    expert_bytes,
    log,
    rand_int4_stack,
    rand_routing,
    rel_errs,
    time_graph,
)
from kernels.int4_moe import (  # noqa: E402
    Int4MoEConfig,
    choose_config,
    fused_int4_moe,
    int4_moe_gemv,
    int4_moe_gemv_down,
    int4_moe_gemv_gate_up,
    int4_moe_reference,
)

TOKENS = (1, 2, 4, 9, 18, 36, 72)
# (block_n, block_k, warps); each timed with stages 1, then STAGES on the STAGE_TOP fastest of each
# kernel. Stages matter most at M = 1: bytes in flight per loop step are A * I * block_k / 2 for
# gate/up whatever block_n is (1 MB at TP8, block_k 512), below what hides HBM latency.
GU_GRID = [(bn, bk, w) for bn in (4, 8, 16, 32) for bk in (128, 256, 512) for w in (2, 4, 8)]
DN_GRID = [(bn, bk, w) for bn in (8, 16, 32, 64) for bk in (64, 128, 256) for w in (2, 4, 8)]
STAGES = (2, 3)
STAGE_TOP = 3
MAX_ACC_REGS = 128
# --dry-run: tiny shape and grids, wall-clock timing of eager calls; checks the logic, not speed.
DRY_SHAPES = {"tiny": dict(experts=4, hidden=128, inter=64, top_k=2)}
DRY_TOKENS = (1, 3)
DRY_GU_GRID = [(32, 128, 4), (64, 128, 4), (64, 256, 2)]  # the last: skipped for its accumulators
DRY_DN_GRID = [(64, 64, 4), (128, 64, 4)]
DRY_STAGES = (2,)

Timer = Callable[[Sequence[Callable[[], object]], int], float]
Launch = tuple[int, int, int, int]  # block_n, block_k, warps, stages


def acc_regs(kind: str, bn: int, bk: int, warps: int) -> int:
    """fp32 accumulator registers a thread: gate/up holds two [bn, bk] tiles, down one."""
    return (2 if kind == "gu" else 1) * bn * bk // (32 * warps)


def grid_split(kind: str, grid: list[tuple[int, int, int]]) -> tuple[list[tuple[int, int, int]], list[str]]:
    """The configs to time and the names of those skipped for their accumulators."""
    keep = [c for c in grid if acc_regs(kind, *c) <= MAX_ACC_REGS]
    return keep, [launch_key(c + (1,)) for c in grid if c not in keep]


def launch_key(c: Launch) -> str:
    """``block_n x block_k x warps x stages``: the CONFIG_ENV syntax of ``gv=`` / ``gvd=``."""
    return "x".join(map(str, c))


def gemv_cfg(gu: Launch | None = None, dn: Launch | None = None) -> Int4MoEConfig:
    """A GEMV config from launch tuples; the half left out keeps its defaults (a kernel timed alone ignores it)."""
    kw: dict = dict(gemv=True)
    for prefix, c in (("gv", gu), ("gvd", dn)):
        if c is not None:
            kw.update({f"{prefix}_block_n": c[0], f"{prefix}_block_k": c[1], f"{prefix}_warps": c[2], f"{prefix}_stages": c[3]})
    return Int4MoEConfig(**kw)


def wall_us(calls: Sequence[Callable[[], object]], reps: int) -> float:
    """--dry-run timer: wall microseconds per eager call (no GPU, no graphs)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for c in calls:
            c()
        times.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return statistics.median(times)


def short_error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


# ------------------------------------------------------------------------------------------------
# Parallel warm-up compile
# ------------------------------------------------------------------------------------------------


def _precompile(task: tuple[str, str, str, str]) -> str:
    """Worker: run one kernel once on a 2-expert stack with the shape's strides (fills the disk cache).

    ``("tc", ...)`` tasks are int4_moe_bench's (tensor-core gate/up or down, alignment included).
    """
    path, shape_name, kind, spec = task
    if path == "tc":
        return _precompile_tensor_cores((shape_name, kind, spec))
    try:
        sh = SHAPES[shape_name]
        dev = torch.device("cuda")
        g = torch.Generator(device=dev).manual_seed(0)
        cfg = Int4MoEConfig.parse(spec)
        K, I = sh["hidden"], sh["inter"]
        ids = torch.randint(0, 2, (1, 2), device=dev, dtype=torch.int64)  # int64, as rand_routing's
        if kind == "gu":
            w = rand_int4_stack(2, I, K, dev, g)
            int4_moe_gemv_gate_up(torch.randn(1, K, device=dev, dtype=torch.bfloat16), w, w, ids, cfg, GROUP)
        else:
            w = rand_int4_stack(2, K, I, dev, g)
            h = torch.randn(2, I, device=dev, dtype=torch.bfloat16)
            int4_moe_gemv_down(h, w, ids, torch.rand(1, 2, device=dev), cfg, GROUP, torch.bfloat16)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # the main process meets it again and records it
        return f"{task}: {short_error(exc)}"


def parse_grid(text: str) -> list[tuple[int, int, int]]:
    """``"4,8x256,512x2,4"`` (block_n values x block_k values x warps values) -> the product."""
    bns, bks, ws = ([int(v) for v in part.split(",")] for part in text.split("x"))
    return [(bn, bk, w) for bn in bns for bk in bks for w in ws]


def precompile(shapes: list[str], tokens: list[int], gu_grid: list, dn_grid: list, workers: int,
               extra_stages: Sequence[int] = STAGES) -> None:
    """Compile every GEMV config at every stage count (which ones get timed depends on the
    timings) and the tensor-core configs compared against, in worker processes. Gate/up
    specialises the same at TP8 and EP8 (every dim and stride % 16 == 0); down does not (TP8's
    scale row stride is 8)."""
    stages = (1,) + tuple(extra_stages)
    tasks = [("gemv", shapes[0], "gu", gemv_cfg(gu=c + (st,)).spec()) for c in gu_grid for st in stages]
    tasks += [("gemv", s, "dn", gemv_cfg(dn=c + (st,)).spec()) for s in shapes for c in dn_grid for st in stages]
    for s in shapes:
        sh = SHAPES[s]
        for M in tokens:
            spec = dataclasses.replace(choose_config(M, sh["experts"], sh["hidden"], sh["inter"], sh["top_k"]), gemv=False).spec()
            tasks += [("tc", shapes[0], "gu", spec), ("tc", s, "dn", spec)]
    tasks = sorted(set(tasks))
    t0 = time.time()
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        errors = [e for e in pool.map(_precompile, tasks) if e]
    log(f"precompile: {len(tasks)} kernels in {time.time() - t0:.1f} s with {workers} workers; {len(errors)} failed")
    for e in errors[:10]:
        log(f"  {e}")


# ------------------------------------------------------------------------------------------------
# One point
# ------------------------------------------------------------------------------------------------


def time_grid(kind: str, grid: list[tuple[int, int, int]], stages: Sequence[int], run: Callable[[Launch], list],
              timer: Timer, reps: int, failed: dict[str, str]) -> tuple[dict[str, float], Launch | None]:
    """Times ``run(launch)``'s calls for each grid config at stages 1, then the ``STAGE_TOP``
    fastest at each of ``stages``. Returns every timing by ``launch_key`` and the fastest launch
    (None when none ran)."""
    times: dict[Launch, float] = {}

    def one(c: Launch) -> None:
        try:
            times[c] = timer(run(c), reps)
        except Exception as exc:  # compile (registers, shared memory) or launch failure
            failed[f"{kind} {launch_key(c)}"] = short_error(exc)

    for c in grid:
        one(c + (1,))
    if not times:
        return {}, None
    for c in sorted(times, key=times.get)[:STAGE_TOP]:
        for st in stages:
            one(c[:3] + (st,))
    best = min(times, key=times.get)
    return {launch_key(c): round(t, 2) for c, t in times.items()}, best


def sweep_point(name: str, sh: dict, M: int, W: dict, gen: torch.Generator, timer: Timer, grids: dict,
                copy_gbps: float | None, routings: int, grid_reps: int, final_reps: int) -> dict:
    """One (shape, M) row: correctness, both grids, the best pair and the tensor-core path end to end."""
    dev = W["gate"].packed.device
    E, K, I, k = sh["experts"], sh["hidden"], sh["inter"], sh["top_k"]
    wg, wu, wd = W["gate"], W["up"], W["down"]
    x = (torch.randn(M, K, device=dev, generator=gen) * 0.5).to(torch.bfloat16)  # [M, K]
    routes = [rand_routing(M, E, k, dev, gen) for _ in range(routings)]
    touched = statistics.mean(int(torch.unique(ids).numel()) for ids, _ in routes)
    mean_bytes = touched * sum(expert_bytes(W[p]) for p in ("gate", "up", "down"))
    chosen = choose_config(M, E, K, I, k)
    tc_cfg = dataclasses.replace(chosen, gemv=False)  # the tensor-core path at this M
    default_cfg = dataclasses.replace(chosen, gemv=True)  # choose_config's GEMV parameters

    # Correctness on the first routing: GEMV against the tensor-core path and the fp32 reference.
    ids0, tw0 = routes[0]
    ref = int4_moe_reference(x, wg, wu, wd, ids0, tw0, GROUP, compute_dtype=torch.float32)
    out_tc = fused_int4_moe(x, wg, wu, wd, ids0, tw0, GROUP, tc_cfg)
    out_gv = int4_moe_gemv(x, wg, wu, wd, ids0, tw0, GROUP, default_cfg)
    rel_default, max_rel_default = rel_errs(out_gv, out_tc)
    rel_ref, _ = rel_errs(out_gv, ref)
    rel_tc_ref, _ = rel_errs(out_tc, ref)
    log(f"  {name} M={M}: GEMV vs tensor cores rel {rel_default:.2e} (max {max_rel_default:.2e}); "
        f"vs fp32 reference: GEMV {rel_ref:.2e}, tensor cores {rel_tc_ref:.2e}")
    del ref

    failed: dict[str, str] = {}
    gu_grid, gu_skipped = grid_split("gu", grids["gu"])
    dn_grid, dn_skipped = grid_split("dn", grids["dn"])

    def gate_up_calls(c: Launch) -> list:
        cfg = gemv_cfg(gu=c)
        return [lambda ids=ids: int4_moe_gemv_gate_up(x, wg, wu, ids, cfg, GROUP) for ids, _ in routes]

    gu_times, gu_best = time_grid("gu", gu_grid, grids["stages"], gate_up_calls, timer, grid_reps, failed)
    assert gu_best is not None, f"no gate/up config ran: {failed}"
    hs = [int4_moe_gemv_gate_up(x, wg, wu, ids, gemv_cfg(gu=gu_best), GROUP) for ids, _ in routes]  # [A, I] each

    def down_calls(c: Launch) -> list:
        cfg = gemv_cfg(dn=c)
        return [lambda h=h, ids=ids, tw=tw: int4_moe_gemv_down(h, wd, ids, tw, cfg, GROUP) for h, (ids, tw) in zip(hs, routes)]

    dn_times, dn_best = time_grid("dn", dn_grid, grids["stages"], down_calls, timer, grid_reps, failed)
    assert dn_best is not None, f"no down config ran: {failed}"

    best_cfg = gemv_cfg(gu=gu_best, dn=dn_best)
    rel_best, max_rel_best = rel_errs(int4_moe_gemv(x, wg, wu, wd, ids0, tw0, GROUP, best_cfg), out_tc)

    def end_to_end(fn, cfg) -> float:
        return timer([lambda i=i, t=t: fn(x, wg, wu, wd, i, t, GROUP, cfg) for i, t in routes], final_reps)

    gemv_us = end_to_end(int4_moe_gemv, best_cfg)
    default_us = end_to_end(int4_moe_gemv, default_cfg)
    tc_us = end_to_end(fused_int4_moe, tc_cfg)
    gbps = mean_bytes / (gemv_us * 1e-6) / 1e9
    return dict(
        shape=f"{name} {E}x{K}x{I} top{k}",
        tokens=M,
        assignments=M * k,
        experts_touched=round(touched, 1),
        bytes_activated=int(mean_bytes),
        tensor_core_us=round(tc_us, 2),
        gemv_us=round(gemv_us, 2),
        gemv_default_us=round(default_us, 2),
        speedup_vs_tensor_cores=round(tc_us / gemv_us, 3),
        gbps=round(gbps, 1),
        frac_of_copy=round(gbps / copy_gbps, 3) if copy_gbps else None,
        gate_up_us=gu_times[launch_key(gu_best)],
        down_us=dn_times[launch_key(dn_best)],
        gv=launch_key(gu_best),
        gvd=launch_key(dn_best),
        config=best_cfg.spec(),
        default_config=default_cfg.spec(),
        tensor_core_config=tc_cfg.spec(),
        rel_err_vs_tensor_cores=rel_best,
        max_rel_err_vs_tensor_cores=max_rel_best,
        rel_err_default_vs_tensor_cores=rel_default,
        rel_err_vs_reference=rel_ref,
        tensor_core_rel_err_vs_reference=rel_tc_ref,
        routings_per_graph=len(routes),
        gate_up=gu_times,
        down=dn_times,
        failed=failed,
        skipped_for_registers=gu_skipped + dn_skipped,
    )


def crossover(rows: list[dict]) -> dict[str, int]:
    """Per shape: the most assignments up to which the GEMV path wins at every swept M (0: never)."""
    out: dict[str, int] = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        last = 0
        for r in sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["tokens"]):
            if r["gemv_us"] >= r["tensor_core_us"]:
                break
            last = r["assignments"]
        out[shape] = last
    return out


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "int4_moe_gemv.json"))
    ap.add_argument("--commit", default=os.environ.get("DDTREE_COMMIT"))
    ap.add_argument("--shapes", default="tp8,ep8")
    ap.add_argument("--tokens", default=None, help=f"comma-separated token counts (default {TOKENS})")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shape and grids: checks the logic only")
    ap.add_argument("--gu-grid", default=None, help='gate/up grid "BNs x BKs x WARPs", e.g. "2,4x512,1024x1,2"')
    ap.add_argument("--dn-grid", default=None, help="down grid, same syntax")
    ap.add_argument("--stages", default=None, help=f"comma-separated stage counts tried on the fastest (default {STAGES})")
    args = ap.parse_args()
    import triton

    if args.dry_run:
        shapes_def, default_tokens = DRY_SHAPES, DRY_TOKENS
        grids = dict(gu=DRY_GU_GRID, dn=DRY_DN_GRID, stages=DRY_STAGES)
        dev, timer, gpu, copy_gbps = torch.device("cpu"), wall_us, "cpu (TRITON_INTERPRET=1)", None
        shapes = list(DRY_SHAPES)
    else:
        assert torch.cuda.is_available(), "needs a CUDA GPU (or --dry-run)"
        shapes_def, default_tokens = SHAPES, TOKENS
        grids = dict(gu=parse_grid(args.gu_grid) if args.gu_grid else GU_GRID,
                     dn=parse_grid(args.dn_grid) if args.dn_grid else DN_GRID,
                     stages=tuple(int(v) for v in args.stages.split(",")) if args.stages else STAGES)
        dev, timer, gpu = torch.device("cuda"), time_graph, torch.cuda.get_device_name()
        shapes = args.shapes.split(",")
        log(f"gpu {gpu}; torch {torch.__version__}; triton {triton.__version__}")
        copy_gbps = copy_bandwidth_gbps()
        log(f"copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(default_tokens)
    if not args.dry_run and args.workers > 1:
        precompile(shapes, tokens, grid_split("gu", grids["gu"])[0], grid_split("dn", grids["dn"])[0], args.workers,
                   grids["stages"])
    result = dict(
        benchmark=Path(args.out).stem,
        commit=git_commit(args.commit),
        gpu=gpu,
        copy_gbps=round(copy_gbps, 1) if copy_gbps else None,
        params=dict(
            shapes={s: shapes_def[s] for s in shapes}, tokens=tokens, group_size=GROUP, scale_dtype="bfloat16",
            act_dtype="bfloat16", routing="uniform random top-k, distinct experts per token",
            weights="random int32 words (all nibbles) and random bf16 scales",
            timing="CUDA graph replay of R calls with R different routings, median of replays" if not args.dry_run
            else "wall clock of eager calls in the CPU interpreter (logic check only)",
            bytes="INT4 words + bf16 scales of gate, up, down of the experts each call touches",
            gate_up_grid=[launch_key(c + (1,)) for c in grids["gu"]], down_grid=[launch_key(c + (1,)) for c in grids["dn"]],
            stages_on_fastest=dict(stages=list(grids["stages"]), configs=STAGE_TOP), max_acc_regs=MAX_ACC_REGS,
            tensor_core="fused_int4_moe with choose_config's config, gemv=False",
            torch=torch.__version__, triton=triton.__version__,
        ),
        rows=[],
    )
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=dev).manual_seed(1234)
    t_start = time.time()
    for name in shapes:
        sh = shapes_def[name]
        W = {
            "gate": rand_int4_stack(sh["experts"], sh["inter"], sh["hidden"], dev, gen),
            "up": rand_int4_stack(sh["experts"], sh["inter"], sh["hidden"], dev, gen),
            "down": rand_int4_stack(sh["experts"], sh["hidden"], sh["inter"], dev, gen),
        }
        for M in tokens:
            t0 = time.time()
            if args.dry_run:
                routings, grid_reps, final_reps = 2, 1, 1
            else:
                routings, grid_reps, final_reps = (16 if M <= 9 else 8), 5, 10
            row = sweep_point(name, sh, M, W, gen, timer, grids, copy_gbps, routings, grid_reps, final_reps)
            result["rows"].append(row)
            out_path.write_text(json.dumps(result, indent=1))
            log(
                f"{name} M={M:3d}: GEMV {row['gemv_us']:8.2f} us (gu {row['gv']} {row['gate_up_us']:.2f}, "
                f"dn {row['gvd']} {row['down_us']:.2f}; default {row['gemv_default_us']:.2f})  tensor cores "
                f"{row['tensor_core_us']:8.2f} us  x{row['speedup_vs_tensor_cores']:.2f}  {row['gbps']:6.0f} GB/s  "
                f"err {row['rel_err_vs_tensor_cores']:.1e}  {len(row['failed'])} failed  [{time.time() - t0:.1f} s]"
            )
        del W
    result["gemv_wins_up_to_assignments"] = crossover(result["rows"])
    out_path.write_text(json.dumps(result, indent=1))
    log(f"\ndone in {time.time() - t_start:.0f} s; {out_path}")
    log("shape                      tokens assign touched  tc_us  gemv_us  default   x_tc   GB/s  frac  gv           gvd")
    for r in result["rows"]:
        log(
            f"{r['shape']:26s} {r['tokens']:6d} {r['assignments']:6d} {r['experts_touched']:7.1f} {r['tensor_core_us']:6.1f} "
            f"{r['gemv_us']:8.2f} {r['gemv_default_us']:8.2f} {r['speedup_vs_tensor_cores']:6.2f} {r['gbps']:6.0f} "
            f"{r['frac_of_copy'] or 0:5.2f}  {r['gv']:12s} {r['gvd']}"
        )
    for shape, a in result["gemv_wins_up_to_assignments"].items():
        log(f"{shape}: GEMV faster at every swept M up to {a} assignments (choose_config's threshold)")


if __name__ == "__main__":
    main()
