"""`ddtree bench`: the seeds' matrix against a running stack, through the client SDK.

For each context length x concurrency x mode (autoregressive, DDTree at each budget) it sends
`concurrency` requests of `context` prompt tokens at once, `max_tokens` each, and reports aggregate
and per-request tokens/s, p50/p99 time per output token, time to first token, mean acceptance, the
step-time split from the draft's Prometheus page and the scheduler's own loop time and step round
trip from its page (each when its metrics port is given; `--spawn-stack` gives both) and GPU
power/utilisation (NVML, else `nvidia-smi`, when there is a GPU). Writes JSON (BENCHMARKS.md's result-file schema)
after every cell, so a run cut short still leaves its rows, and a PNG plot at the end.

Every cell is bounded (`cell_timeout_s`: its streams are cancelled, which aborts the requests, and
the row says `timed_out` with what arrived by then), and the whole run can be (`time_budget_s`:
cells not started by then are recorded as `skipped`), so one stuck cell never eats a GPU lease.
`stack_spec` sizes a stack so that no cell of the matrix is queued or rejected (`ddtree bench
--spawn-stack`).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench.common import git_commit, read_metrics
from ddtree.v1 import common_pb2
from services.common.launcher import StackSpec, free_port
from services.common.settings import MAX_SECONDS, SchedulerSettings
from services.scheduler.client import AsyncClient, ClientError

__all__ = ["MatrixParams", "Cell", "cell_plan", "full_batch", "run_matrix", "write_results", "local_gpu_name", "stack_spec", "check_fits",
           "load_token_stream", "power_gpu_ids", "PowerSampler"]

ROW_KEYS = ("context", "concurrency", "mode", "budget", "agg_tok_s", "per_req_tok_s", "p50_tpot_ms", "p99_tpot_ms",
            "ttft_ms", "mean_acceptance", "power_w")


@dataclass
class MatrixParams:
    address: str = "127.0.0.1:50051"
    contexts: list[int] = field(default_factory=lambda: [60, 1024])
    concurrencies: list[int] = field(default_factory=lambda: [1, 32, 64, 128])
    budgets: list[int] = field(default_factory=lambda: [8, 16, 32])
    max_tokens: int = 512
    temperature: float = 0.0
    draft_metrics: str = ""        # host:port of the draft's /metrics, for the step-time split
    scheduler_metrics: str = ""    # host:port of the scheduler's /metrics: its own loop time and the step's round trip
    vocab_low: int = 2             # synthetic prompt ids are drawn from [vocab_low, vocab_high)
    vocab_high: int = 256
    seed: int = 0
    prompt_file: str = ""          # JSON {"prompts": [{"ids": [...]}, ...]}: prompts are cut from these tokens
    cell_timeout_s: float = 300.0  # a cell still running after this is cancelled and marked timed_out
    time_budget_s: float = 0.0     # 0 = unbounded; cells not started within it are recorded as skipped
    warmup_tokens: int = 8         # per (context, mode) warm-up request pair before the matrix; 0 = none
    power: bool = True             # sample GPU power; off isolates the sampler's cost (see BENCHMARKS.md)
    power_gpus: list[str] | None = None   # NVML indices / UUIDs sampled (`power_gpu_ids`); None = every GPU
    tls_ca: str = ""               # a scheduler that speaks TLS: the PEM roots to trust
    tls_server_name: str = ""      # the name its certificate holds, where not the address's host
    token: str = field(default="", repr=False)   # its bearer token (never written to the results)

    def client_options(self) -> dict:
        """What a client of this scheduler needs besides its address."""
        return {"tls_ca": self.tls_ca or None, "token": self.token or None,
                "tls_server_name": self.tls_server_name or None}


@dataclass(frozen=True)
class Cell:
    context: int
    concurrency: int
    mode: str          # "autoregressive" | "ddtree"
    budget: int        # 0 for autoregressive


def cell_plan(p: MatrixParams) -> list[Cell]:
    """Context, then concurrency, then AR and each budget: a run cut short by its time budget still
    holds complete AR-vs-DDTree comparisons for the (context, concurrency) points it reached."""
    modes = [("autoregressive", 0)] + [("ddtree", b) for b in p.budgets]
    return [Cell(ctx, conc, mode, b) for ctx in p.contexts for conc in p.concurrencies for mode, b in modes]


# ---- power ------------------------------------------------------------------------------------
def power_gpu_ids(spec: str = "") -> list[str] | None:
    """The GPUs whose power a run samples, as NVML indices or UUIDs: ``spec`` (comma-separated), else
    those ``CUDA_VISIBLE_DEVICES`` names (a stack started from here sees only those; set but empty:
    none), else None (every GPU of the host: on a host shared with other work, name the stack's).
    CUDA numbers GPUs fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, NVML by bus: on a host
    of mixed GPUs, name them by UUID."""
    text = spec or os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]


class PowerSampler:
    """GPU power (W, summed) and utilisation (%, averaged) of ``gpus`` (`power_gpu_ids`; None = every
    GPU) while a cell runs. Power is the energy counter's difference over the cell where NVML has
    one (source ``nvml-energy``): a power reading is an average over the last second, so a sub-second
    cell's samples were mostly the cell before. Else readings every 100 ms: NVML when the bindings
    are installed, else `nvidia-smi` (the GPU image may lack pynvml), else nothing (no GPU, or a GPU
    named that is not there). Utilisation is always such readings (also averaged over a past window);
    between two `mark` calls only the readings taken between them count (the sampler runs over the
    cell's set-up too: its prompts and channel, idle GPU time)."""

    def __init__(self, enabled: bool = True, gpus: list[str] | None = None) -> None:
        self.samples: list[tuple[float, float]] = []   # (watts, utilisation %)
        self._times: list[float] = []                    # when each sample was read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read: Callable[[], tuple[float, float]] | None = None
        self._energy: Callable[[], float] | None = None
        self._span: list[tuple[float, float]] = []   # (seconds, joules) at the cell's start and end
        self.source = "off"
        if enabled:
            for source, reader in (("nvml", _nvml_reader), ("nvidia-smi", _smi_reader)):
                self._read = reader(gpus)
                if self._read is not None:
                    self.source = source
                    break
            self._energy = _nvml_energy(gpus) if self.source == "nvml" else None
            if self._energy is not None:
                self.source = "nvml-energy"

    def __enter__(self) -> PowerSampler:
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            asked = time.perf_counter()   # before the reading: `nvidia-smi` takes up to a few 100 ms
            try:
                sample = self._read()
            except Exception:  # noqa: BLE001 - a failed reading leaves power unreported, never the cell
                return
            self._times.append(asked)
            self.samples.append(sample)
            self._stop.wait(0.1)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mark(self) -> None:
        """The cell's start, then its end (not the set-up around it), with the energy counter there."""
        if len(self._span) < 2:
            self._span.append((time.perf_counter(), self._energy() if self._energy is not None else 0.0))

    def mean(self) -> tuple[float | None, float | None]:
        samples = self.samples
        if len(self._span) == 2:
            (t0, _), (t1, _) = self._span
            inside = [x for t, x in zip(self._times, self.samples) if t0 <= t <= t1]
            # A cell shorter than the 100 ms between readings has none: the first after its start
            # (a past window's average, which holds the cell), not the set-up's.
            after = [x for t, x in zip(self._times, self.samples) if t >= t0][:1]
            samples = inside or after
        util = statistics.mean(u for _, u in samples) if samples else None
        if self._energy is not None and len(self._span) == 2 and self._span[1][0] > self._span[0][0]:
            (t0, e0), (t1, e1) = self._span
            return (e1 - e0) / (t1 - t0), util
        if not samples:
            return None, None
        return statistics.mean(p for p, _ in samples), util


def _nvml_handles(gpus: list[str] | None) -> tuple[object, list] | None:
    """(the bindings, the handles of ``gpus``; None = every GPU), or None where NVML cannot say."""
    if gpus == []:
        return None
    try:
        import pynvml
        pynvml.nvmlInit()
        if gpus:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(int(g)) if g.isdigit() else pynvml.nvmlDeviceGetHandleByUUID(g)
                       for g in gpus]
        else:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - no bindings, no driver, or a GPU named that is not there
        return None
    return (pynvml, handles) if handles else None


def _nvml_reader(gpus: list[str] | None) -> Callable[[], tuple[float, float]] | None:
    found = _nvml_handles(gpus)
    if found is None:
        return None
    nvml, handles = found

    def read() -> tuple[float, float]:
        power = sum(nvml.nvmlDeviceGetPowerUsage(h) for h in handles) / 1000.0
        return power, statistics.mean(nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles)
    return read


def _nvml_energy(gpus: list[str] | None) -> Callable[[], float] | None:
    """Joules the GPUs used since their driver loaded (Volta on), or None where NVML has no counter."""
    found = _nvml_handles(gpus)
    if found is None:
        return None
    nvml, handles = found

    def read() -> float:
        return sum(nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in handles) / 1000.0   # mJ
    try:
        read()
    except Exception:  # noqa: BLE001 - no counter on this GPU
        return None
    return read


def _smi_reader(gpus: list[str] | None) -> Callable[[], tuple[float, float]] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None or gpus == []:
        return None
    cmd = [exe, "--query-gpu=power.draw,utilization.gpu", "--format=csv,noheader,nounits"]
    if gpus:
        cmd.append(f"--id={','.join(gpus)}")

    def read() -> tuple[float, float]:
        lines = subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=True).stdout.split("\n")
        vals = [[float(v) for v in line.split(",")] for line in lines if line.strip()]
        return sum(v[0] for v in vals), statistics.mean(v[1] for v in vals)
    try:
        read()
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None
    return read


# ---- the stack's own numbers --------------------------------------------------------------------
def stage_totals(metrics_address: str) -> dict[str, tuple[float, float]] | None:
    """(sum_ms, count) per stage from a /metrics page (a stage not observed yet is absent); None
    when no page answered."""
    page = read_metrics(metrics_address)
    if not page:
        return None
    out: dict[str, list[float]] = {}
    for key, value in page.items():
        for kind in ("sum", "count"):
            prefix = f"ddtree_step_ms_{kind}{{stage=\""
            if key.startswith(prefix):
                stage = key[len(prefix):].split('"')[0]
                out.setdefault(stage, [0.0, 0.0])[0 if kind == "sum" else 1] = value
    return {k: (v[0], v[1]) for k, v in out.items()}


def stage_split(before: dict[str, tuple[float, float]] | None,
                after: dict[str, tuple[float, float]] | None) -> dict[str, float | None]:
    """Mean ms a step of each stage between two ``stage_totals`` scrapes (None: no step between, or
    a scrape that did not answer: a missing "before" read as zeros gave the stack's lifetime mean)."""
    if before is None or after is None:
        return {f"{stage}_ms": None for stage in (after or before or {})}
    split: dict[str, float | None] = {}
    for stage, (s1, n1) in after.items():
        s0, n0 = before.get(stage, (0.0, 0.0))
        split[f"{stage}_ms"] = (s1 - s0) / (n1 - n0) if n1 > n0 else None
    return split


# ---- prompts ----------------------------------------------------------------------------------
def load_token_stream(path: str | Path) -> list[int]:
    """All prompts' token ids of a prompt file, concatenated: real text to cut contexts from, so
    acceptance is measured on the kind of input the drafter was trained for."""
    doc = json.loads(Path(path).read_text())
    stream = [int(t) for item in doc["prompts"] for t in item["ids"]]
    if not stream:
        raise ValueError(f"{path}: no token ids in 'prompts'")
    return stream


def _prompt(context: int, index: int, p: MatrixParams, stream: list[int] | None) -> list[int]:
    """Request `index`'s prompt: `context` tokens of the stream (cycling) from an offset of its own,
    or a synthetic pattern without a prompt file. Distinct per request so no two share a prefix."""
    if stream:
        start = (p.seed * 7919 + index * 997) % len(stream)
        return [stream[(start + i) % len(stream)] for i in range(context)]
    span = p.vocab_high - p.vocab_low
    return [p.vocab_low + (p.seed * 7919 + index * 104729 + 31 * i * i + 17 * i) % span for i in range(context)]


# ---- one cell ---------------------------------------------------------------------------------
@dataclass
class _Trace:
    """What one request's stream delivered, updated as chunks arrive (so a cancelled cell still
    has everything that came before the cancellation)."""

    start: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    acceptance: list[int] = field(default_factory=list)
    steps: int = 0         # the server's count (last chunk's usage): verify steps, and those with a tree
    tree_steps: int = 0
    done: bool = False
    error: str | None = None
    arrivals: list[tuple[float, int]] = field(default_factory=list)   # (time, tokens so far) a chunk


async def _stream_one(client: AsyncClient, prompt: list[int], cell: Cell, max_tokens: int, p: MatrixParams,
                      seed: int, trace: _Trace) -> None:
    try:
        async for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=p.temperature, seed=seed,
                                         budget=cell.budget, mode=cell.mode, ignore_eos=True):
            now = time.perf_counter()
            trace.first = trace.first if trace.first is not None else now
            trace.last = now
            trace.tokens += len(chunk.token_ids)
            trace.arrivals.append((now, trace.tokens))
            trace.acceptance += chunk.acceptance_lengths
            if chunk.usage is not None:
                trace.steps, trace.tree_steps = chunk.usage.steps, chunk.usage.tree_steps
        trace.done = True
    except ClientError as exc:
        trace.error = f"{exc.code.name}: {exc.message}"


async def _run_cell(p: MatrixParams, cell: Cell, max_tokens: int, stream: list[int] | None,
                    timeout_s: float, power: PowerSampler | None = None) -> dict:
    """All `concurrency` requests at once, bounded by `timeout_s`; `power` marked at the clock's
    start and end."""
    prompts = [_prompt(cell.context, i, p, stream) for i in range(cell.concurrency)]
    async with AsyncClient(p.address, **p.client_options()) as client:
        await client.model_info()   # the channel connected before the clock starts, as a serving client's is
        if power is not None:
            power.mark()
        t0 = time.perf_counter()
        traces = [_Trace(start=t0) for _ in range(cell.concurrency)]
        jobs = [_stream_one(client, prompts[i], cell, max_tokens, p, p.seed + i, traces[i])
                for i in range(cell.concurrency)]
        running: list[float] = []
        watch = asyncio.ensure_future(_watch_running(p.scheduler_metrics, running)) if p.scheduler_metrics else None
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.gather(*jobs), timeout=timeout_s)
        except asyncio.TimeoutError:
            timed_out = True   # the streams are cancelled: the scheduler aborts their requests
        finally:
            if watch is not None:
                watch.cancel()
        wall = time.perf_counter() - t0
        if power is not None:
            power.mark()
    stats = _cell_stats(traces, wall, timed_out)
    stats["running_max"], stats["running_readings"] = running_max(running), len(running)
    return stats


def running_max(readings: list[float]) -> int | None:
    """The most requests the scheduler ran at once in a cell: below the concurrency, its batch
    (max_batch, the KV cache) ran the cell in waves. Read every 200 ms from the cell's start (0
    before the first admission): a short cell's peak may fall between readings, so readings that
    never saw a request running say nothing (None). Not more often: the scheduler renders its whole
    /metrics page for each read, on the interpreter that runs its step loop."""
    return int(max(readings)) if readings and max(readings) > 0 else None


async def _watch_running(address: str, seen: list[float], interval_s: float = 0.2) -> None:
    """The scheduler's running requests, read from its /metrics page while a cell runs."""
    while True:
        value = (await asyncio.to_thread(read_metrics, address)).get("ddtree_running_requests")
        if value is not None:
            seen.append(value)
        await asyncio.sleep(interval_s)


def full_batch(traces: list[_Trace]) -> tuple[float | None, float | None]:
    """(tok/s, seconds) of the cell while every one of its requests still ran: from the start to
    the first request's last token. A cell is one burst that runs down (no request replaces one that
    ended): DDTree requests end apart, as their acceptance differs, and ``agg_tok_s`` counts the
    thinning batch at the end too, where autoregressive ones end together. None where a request
    delivered nothing."""
    if not traces or any(not t.arrivals for t in traces):
        return None, None
    start = min(t.start for t in traces)
    end = min(t.last for t in traces if t.last is not None)
    if end <= start:
        return None, None
    tokens = sum(t.arrivals[bisect.bisect_right(t.arrivals, (end, math.inf)) - 1][1]
                 for t in traces if t.arrivals[0][0] <= end)
    return tokens / (end - start), end - start


def _cell_stats(traces: list[_Trace], wall: float, timed_out: bool) -> dict:
    """Row figures from the traces, partial ones included; None where nothing was measured.

    TPOT = (last token - first token) / (tokens - 1) of one request: decode speed without prefill.
    """
    tokens = sum(t.tokens for t in traces)
    per_req = [t.tokens / (t.last - t.start) for t in traces if t.last is not None and t.last > t.start]
    tpots = sorted((t.last - t.first) / (t.tokens - 1) for t in traces
                   if t.first is not None and t.last is not None and t.tokens > 1)
    ttfts = [t.first - t.start for t in traces if t.first is not None]
    acc = [a for t in traces for a in t.acceptance]
    # A step the scheduler ran without a tree (speculation paused) accepts 1: the tree steps' own mean
    # is what T-speedup's bar needs (0.8 x acceptance x AR), which the pooled mean lowers.
    counted = [t for t in traces if t.steps and len(t.acceptance) == t.steps]
    tree_steps = sum(t.tree_steps for t in counted)
    errors = [t.error for t in traces if t.error]
    status = "timed_out" if timed_out else "error" if errors else "ok"
    full_tok_s, full_s = full_batch(traces)
    return {
        "agg_tok_s": tokens / wall if wall > 0 else None,
        "full_batch_tok_s": full_tok_s,
        "full_batch_s": full_s,
        "per_req_tok_s": statistics.mean(per_req) if per_req else None,
        "p50_tpot_ms": 1e3 * statistics.median(tpots) if tpots else None,
        # One mean a request: the nearest rank, which is the slowest request below 100 of them.
        "p99_tpot_ms": 1e3 * tpots[math.ceil(0.99 * len(tpots)) - 1] if tpots else None,
        "tpot_samples": len(tpots),
        "ttft_ms": 1e3 * statistics.mean(ttfts) if ttfts else None,
        "mean_acceptance": statistics.mean(acc) if acc else None,
        "tree_step_acceptance": (sum(sum(t.acceptance) - (t.steps - t.tree_steps) for t in counted) / tree_steps
                                 if tree_steps else None),
        # Steps of the cell's requests verified with a tree: under 1 in a DDTree cell where the
        # scheduler paused speculation (its mean_acceptance then counts those steps as 1).
        "tree_step_share": (sum(t.tree_steps for t in traces) / steps) if (steps := sum(t.steps for t in traces)) else None,
        "wall_s": wall,
        "tokens": tokens,
        "completed": sum(t.done for t in traces),
        "status": status,
        "error": errors[0] if errors else None,
    }


def _empty_row(cell: Cell, status: str) -> dict:
    row = {k: None for k in ROW_KEYS}
    row.update(context=cell.context, concurrency=cell.concurrency, mode=cell.mode, budget=cell.budget or None,
               status=status, tokens=0, completed=0)
    return row


# ---- the matrix ---------------------------------------------------------------------------------
def _warm_up(p: MatrixParams, stream: list[int] | None, deadline: float) -> None:
    """Two short requests per (context, mode) before anything is timed: kernels compile on first
    use per shape and budget, and that belongs to no cell."""
    if p.warmup_tokens <= 0:
        return
    cells = dict.fromkeys(Cell(c.context, min(2, max(p.concurrencies)), c.mode, c.budget) for c in cell_plan(p))
    for cell in cells:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        asyncio.run(_run_cell(p, cell, p.warmup_tokens, stream, min(p.cell_timeout_s, left)))


def run_matrix(p: MatrixParams, progress: bool = True,
               on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Runs every cell of `cell_plan(p)`; `on_row(rows)` after each (incremental result files)."""
    deadline = time.monotonic() + p.time_budget_s if p.time_budget_s > 0 else float("inf")
    stream = load_token_stream(p.prompt_file) if p.prompt_file else None
    rows: list[dict] = []
    for flag, address in (("--draft-metrics", p.draft_metrics), ("--scheduler-metrics", p.scheduler_metrics)):
        if address and not read_metrics(address):   # else every row's split is {} without a word
            print(f"ddtree bench: no /metrics page answers at {flag} {address}: its splits stay empty", file=sys.stderr)
    _warm_up(p, stream, deadline)
    if time.monotonic() >= deadline:
        print(f"ddtree bench: the warm-up took the whole time budget ({p.time_budget_s:g} s): every cell is skipped "
              "(a larger --time-budget, or --warmup-tokens 0)", file=sys.stderr)
    for cell in tqdm(cell_plan(p), desc="bench", disable=not progress):
        left = deadline - time.monotonic()
        if left <= 0:
            rows.append(_empty_row(cell, "skipped"))
        else:
            before, sched_before = stage_totals(p.draft_metrics), stage_totals(p.scheduler_metrics)
            with PowerSampler(p.power, p.power_gpus) as power:   # the last cell is cut at the deadline, so the run ends by it
                stats = asyncio.run(_run_cell(p, cell, p.max_tokens, stream, min(p.cell_timeout_s, left), power))
            watts, util = power.mean()
            rows.append({"context": cell.context, "concurrency": cell.concurrency, "mode": cell.mode,
                         "budget": cell.budget or None, **stats,
                         "step_split_ms": stage_split(before, stage_totals(p.draft_metrics)),
                         "scheduler_split_ms": stage_split(sched_before, stage_totals(p.scheduler_metrics)),
                         "power_w": watts, "gpu_util": util, "power_source": power.source})
            if stats["status"] == "timed_out":
                time.sleep(1.0)   # let the scheduler retire the aborted requests before the next cell
        if on_row is not None:
            on_row(rows)
    return rows


# ---- sizing a stack for the matrix --------------------------------------------------------------


def _kv_tokens_per_request(p: MatrixParams, block_size: int, page_size: int) -> int:
    """What the scheduler reserves for the largest request (prompt + output + one block), rounded up
    to whole pages as the verifier's cache hands them out."""
    need = max(p.contexts) + p.max_tokens + block_size
    return -(-need // page_size) * page_size


def stack_spec(p: MatrixParams, model: str, device: str, dtype: str, log_path: str | None = None,
               page_size: int = 16, draft_replicas: int = 1) -> tuple[StackSpec, str, str]:
    """A stack that runs every cell unqueued: batch and queue hold the largest concurrency, the KV
    cache all its requests at the largest context, and the verifier's shared-buffer slots the
    features of one step (the scheduler admits at most `max_prefill_tokens` prompt tokens a step,
    plus every request's tree; the verifier sends features in the model's dtype; a slot too small falls back to
    inline gRPC bytes, slow). Returns the spec and the draft's and the scheduler's metrics addresses."""
    from services.draft.config import DraftConfig

    drafter = DraftConfig.from_hf(json.loads((Path(model) / "drafter" / "config.json").read_text()))
    conc = max(p.concurrencies)
    kv_tokens = conc * _kv_tokens_per_request(p, drafter.block_size, page_size)
    rows = min(conc * max(p.contexts), SchedulerSettings().max_prefill_tokens) + conc * (max(p.budgets, default=0) + 1)
    feature_bytes = rows * drafter.num_features * (4 if dtype == "float32" else 2)   # the model's dtype on the wire
    metrics_port, scheduler_metrics_port = free_port(), free_port()
    env = {
        "DDTREE_VERIFIER_DEVICE": device, "DDTREE_DRAFT_DEVICE": device,
        "DDTREE_VERIFIER_DTYPE": dtype, "DDTREE_DRAFT_DTYPE": dtype,
        "DDTREE_VERIFIER_PAGE_SIZE": str(page_size),
        "DDTREE_VERIFIER_KV_CAPACITY_TOKENS": str(kv_tokens),
        "DDTREE_VERIFIER_RING_SLOT_BYTES": str(max(8 << 20, feature_bytes + (1 << 20))),
        "DDTREE_SCHEDULER_MAX_BATCH": str(conc),
        "DDTREE_SCHEDULER_MAX_QUEUE": str(max(256, 2 * conc)),
        # (at most the setting's bound: a --cell-timeout past it was refused as this variable, unset by the user)
        "DDTREE_SCHEDULER_STEP_TIMEOUT_S": str(min(MAX_SECONDS, max(60.0, p.cell_timeout_s))),
        "DDTREE_DRAFT_METRICS_PORT": str(metrics_port),
        "DDTREE_SCHEDULER_METRICS_PORT": str(scheduler_metrics_port),
        "DDTREE_DRAFT_WARMUP_BUDGETS": ",".join(str(b) for b in p.budgets) or "8",
    }
    spec = StackSpec(model_path=model, scheduler_port=0, extra_env=env, startup_timeout_s=300.0, log_path=log_path,
                     draft_replicas=draft_replicas)
    return spec, f"127.0.0.1:{metrics_port}", f"127.0.0.1:{scheduler_metrics_port}"


def check_fits(info: common_pb2.ModelInfo, p: MatrixParams) -> None:
    """Raises ValueError unless the largest request fits the model's context and the largest
    concurrency fits the KV cache (otherwise the scheduler would shorten outputs or queue)."""
    longest = max(p.contexts) + p.max_tokens
    if longest > info.max_context - info.block_size:
        raise ValueError(f"context {max(p.contexts)} + {p.max_tokens} new tokens needs {longest + info.block_size} "
                         f"positions; the model has {info.max_context}")
    if not p.prompt_file and p.vocab_high > info.vocab_size:   # every request refused INVALID_ARGUMENT, cell by cell
        raise ValueError(f"--vocab-high {p.vocab_high}: synthetic prompt ids would pass the model's vocabulary of "
                         f"{info.vocab_size}")
    per_req = _kv_tokens_per_request(p, info.block_size, max(1, info.kv_page_size))
    need = max(p.concurrencies) * per_req
    if need > info.kv_capacity_tokens:
        raise ValueError(f"{max(p.concurrencies)} requests of {per_req} KV tokens need {need}; the cache holds "
                         f"{info.kv_capacity_tokens} (raise verifier.kv_capacity_tokens)")


# ---- results ----------------------------------------------------------------------------------
def local_gpu_name() -> str:
    """This machine's first GPU by name, or "cpu" without one."""
    try:
        import torch
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def write_results(rows: list[dict], params: MatrixParams, out_json: Path, copy_gbps: float | None = None,
                  commit: str | None = None, extra: dict | None = None, plot: bool = True,
                  gpu: str | None = None) -> None:
    """The result file (``benchmark``: its name without ``.json``); `extra` goes into
    params (how the stack was configured); `gpu`: what served the run (the verifier's device, as
    its model info says), by default this machine's GPU."""
    out_json = Path(out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": out_json.stem, "commit": git_commit(commit), "gpu": gpu or local_gpu_name(), "copy_gbps": copy_gbps,
           "params": {**{k: v for k, v in asdict(params).items() if k != "token"}, **(extra or {})}, "rows": rows}
    tmp = out_json.with_suffix(".json.part")
    try:
        tmp.write_text(json.dumps(doc, indent=2))
        tmp.replace(out_json)   # a reader (or a kill) never sees half a file
    finally:
        tmp.unlink(missing_ok=True)
    if plot:
        _plot(rows, out_json.with_suffix(".png"))


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no {path.name}: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return
    rows = [r for r in rows if r.get("agg_tok_s") is not None and r.get("status") == "ok"]   # not a cut-short cell
    contexts = sorted({r["context"] for r in rows})
    if not contexts:
        return
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
