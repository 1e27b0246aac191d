"""`ddtree bench`: the seeds' matrix against a running stack, through the client SDK.

For each context length x concurrency x mode (autoregressive, DDTree at each budget) it sends
`concurrency` requests of `context` prompt tokens at once, `max_tokens` each, and reports aggregate
and per-request tokens/s, p50/p99 time per output token, time to first token, mean acceptance, the
step-time split from the services' Prometheus pages (when their metrics ports are given) and GPU
power/utilisation sampled through NVML (when there is a GPU). Writes JSON (TARGETS.md schema) and
a PNG plot.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench.common import git_commit
from services.scheduler.client import AsyncClient

__all__ = ["MatrixParams", "run_matrix", "write_results"]


@dataclass
class MatrixParams:
    address: str = "127.0.0.1:50051"
    contexts: list[int] = field(default_factory=lambda: [60, 1024])
    concurrencies: list[int] = field(default_factory=lambda: [1, 32, 64, 128])
    budgets: list[int] = field(default_factory=lambda: [8, 16, 32])
    max_tokens: int = 512
    temperature: float = 0.0
    draft_metrics: str = ""        # host:port of the draft's /metrics, for the step-time split
    vocab_low: int = 2             # prompt token ids are drawn from [vocab_low, vocab_high)
    vocab_high: int = 256
    seed: int = 0


class PowerSampler:
    """Samples GPU power (W) and utilisation (%) every 100 ms through NVML, if there is a GPU."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVML, no GPU: power is simply not reported
            self._handles = []
            self._nvml = None

    def __enter__(self) -> PowerSampler:
        if self._handles:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        nv = self._nvml
        while not self._stop.is_set():
            power = sum(nv.nvmlDeviceGetPowerUsage(h) for h in self._handles) / 1000.0
            util = statistics.mean(nv.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles)
            self.samples.append((power, util))
            self._stop.wait(0.1)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mean(self) -> tuple[float | None, float | None]:
        if not self.samples:
            return None, None
        return statistics.mean(p for p, _ in self.samples), statistics.mean(u for _, u in self.samples)


def _stage_totals(metrics_address: str) -> dict[str, tuple[float, float]]:
    """(sum_ms, count) per stage from a /metrics page."""
    if not metrics_address:
        return {}
    page = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    out: dict[str, list[float]] = {}
    for line in page.splitlines():
        for kind in ("sum", "count"):
            prefix = f"ddtree_step_ms_{kind}{{stage=\""
            if line.startswith(prefix):
                stage = line[len(prefix):].split('"')[0]
                out.setdefault(stage, [0.0, 0.0])[0 if kind == "sum" else 1] = float(line.split()[-1])
    return {k: (v[0], v[1]) for k, v in out.items()}


def _prompt(context: int, index: int, p: MatrixParams) -> list[int]:
    span = p.vocab_high - p.vocab_low
    return [p.vocab_low + (p.seed * 7919 + index * 104729 + 31 * i * i + 17 * i) % span for i in range(context)]


async def _one_cell(p: MatrixParams, context: int, concurrency: int, mode: str, budget: int) -> dict:
    async with AsyncClient(p.address) as client:
        async def one(i: int) -> dict:
            start = time.perf_counter()
            first = None
            stamps: list[tuple[float, int]] = []
            acc: list[int] = []
            async for chunk in client.stream(_prompt(context, i, p), max_tokens=p.max_tokens,
                                             temperature=p.temperature, seed=p.seed + i, budget=budget,
                                             mode=mode, ignore_eos=True):
                now = time.perf_counter()
                first = first if first is not None else now
                stamps.append((now, len(chunk.token_ids)))
                acc += chunk.acceptance_lengths
            tokens = sum(n for _, n in stamps)
            end = stamps[-1][0]
            tpot = (end - first) / max(1, tokens - 1)
            return {"ttft": first - start, "tokens": tokens, "seconds": end - start, "tpot": tpot, "acc": acc}

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    tpots = sorted(r["tpot"] for r in results)
    acc = [a for r in results for a in r["acc"]]
    return {
        "agg_tok_s": sum(r["tokens"] for r in results) / wall,
        "per_req_tok_s": statistics.mean(r["tokens"] / r["seconds"] for r in results),
        "p50_tpot_ms": 1e3 * tpots[len(tpots) // 2],
        "p99_tpot_ms": 1e3 * tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))],
        "ttft_ms": 1e3 * statistics.mean(r["ttft"] for r in results),
        "mean_acceptance": statistics.mean(acc) if acc else 0.0,
        "wall_s": wall,
    }


def run_matrix(p: MatrixParams, progress: bool = True) -> list[dict]:
    cells = [(ctx, conc, "autoregressive", 0) for ctx in p.contexts for conc in p.concurrencies]
    cells += [(ctx, conc, "ddtree", b) for ctx in p.contexts for conc in p.concurrencies for b in p.budgets]
    rows = []
    for ctx, conc, mode, budget in tqdm(cells, desc="bench", disable=not progress):
        before = _stage_totals(p.draft_metrics)
        with PowerSampler() as power:
            row = asyncio.run(_one_cell(p, ctx, conc, mode, budget))
        after = _stage_totals(p.draft_metrics)
        split = {}
        for stage, (s1, n1) in after.items():
            s0, n0 = before.get(stage, (0.0, 0.0))
            split[f"{stage}_ms"] = (s1 - s0) / (n1 - n0) if n1 > n0 else None
        watts, util = power.mean()
        rows.append({"context": ctx, "concurrency": conc, "mode": mode, "budget": budget or None, **row,
                     "step_split_ms": split, "power_w": watts, "gpu_util": util})
    return rows


def _gpu_name() -> str:
    try:
        import torch
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def write_results(rows: list[dict], params: MatrixParams, out_json: Path, name: str = "matrix-demo",
                  copy_gbps: float | None = None) -> None:
    out_json = Path(out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "commit": git_commit(), "gpu": _gpu_name(), "copy_gbps": copy_gbps,
           "params": asdict(params), "rows": rows}
    out_json.write_text(json.dumps(doc, indent=2))
    _plot(rows, out_json.with_suffix(".png"))


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r["context"] == ctx:
                label = "AR" if r["mode"] == "autoregressive" else f"DDTree b{r['budget']}"
                series.setdefault(label, []).append((r["concurrency"], r["agg_tok_s"]))
        for label, pts in series.items():
            pts.sort()
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("aggregate tok/s")
        ax.set_title(f"context {ctx}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
