"""What every benchmark script shares: the commit stamp, the copy-bandwidth ceiling, graph timing."""

from __future__ import annotations

import argparse
import http.client
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["git_commit", "measure_copy_gbps", "graph_replay_us", "replay_ms", "eager_us", "wall_ms",
           "parse_metrics", "read_metrics", "result_file", "add_out_argument"]


def git_commit(explicit: str | None = None) -> str:
    """`explicit` when given (the device copy of the repo has no .git), else this checkout's HEAD
    (not the working directory's repository: a bench run from another checkout recorded its HEAD),
    else "unknown"."""
    if explicit:
        return explicit
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out if re.fullmatch(r"[0-9a-f]{40}", out) else "unknown"   # outside a repo git echoes "HEAD"


def measure_copy_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written, median of 20 copies."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / sorted(times)[len(times) // 2] / 1e9


def graph_replay_us(calls: Sequence[Callable[[], object]], reps: int = 20, warmup: int = 1) -> float:
    """Microseconds per call: all `calls` captured back to back in one CUDA graph, median of `reps` replays.

    Warm-up runs on a side stream first (compiles, allocator), as graph capture requires.
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    us = replay_ms(graph, reps) * 1e3 / len(calls)
    del graph
    return us


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    """Milliseconds per replay of a captured graph (CUDA events), median of `reps` after one."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def wall_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """Wall milliseconds of a whole call, host work included, synchronised around each (any
    device); median of `reps` after one warm-up call."""
    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def host_us(fn: Callable[[], object], reps: int, sync: Callable[[], object] | None = None, warmup: int = 20) -> float:
    """Median host microseconds of ``reps`` single calls (a call's own time, not a loop's mean),
    after ``warmup`` calls; ``sync``, when given, runs after each call outside the clock."""
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if sync is not None:
            sync()
    return round(sorted(times)[len(times) // 2] * 1e6, 2)


def eager_us(calls: Sequence[Callable[[], object]], reps: int = 3) -> float:
    """Microseconds per call, run eagerly (for host-syncing references) after one warm-up round;
    median of `reps` rounds."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for c in calls:
            c()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def kernel_times(fn: Callable[[], object], reps: int = 10) -> dict[str, float]:
    """Microseconds a call of each kernel ``fn`` launches (torch.profiler, eager), summed by name."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us:
            out[e.key[:80]] = round(us / reps, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def copy_gbps_on(device: str) -> float | None:
    """A result file's ``copy_gbps`` (the GPU's copy bandwidth, measured in the same
    run): measured now on ``device``'s GPU, or None for a run on the CPU."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    with torch.cuda.device(torch.device(device)):
        return round(measure_copy_gbps(), 1)


def result_file(value: str) -> Path:
    """An ``--out`` argument: a ``.json`` file, whose name without ``.json`` is the benchmark's.

    Refused at parse time, before a GPU run of minutes, so a directory (these scripts once took
    one) or a misspelt name does not fail at the first write or leave a file the schema rejects.
    """
    path = Path(value)
    if path.suffix != ".json" or path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is not a .json file to write the result to "
                                         "(e.g. bench/results/NAME.json; NAME is the benchmark's name)")
    return path


def add_out_argument(ap: argparse.ArgumentParser, benchmark: str) -> None:
    """``--out``, a :func:`result_file`, by default ``bench/results/<benchmark>.json``."""
    ap.add_argument("--out", type=result_file, help="the result file; its name without .json is the benchmark's",
                    default=str(Path(__file__).resolve().parent / "results" / f"{benchmark}.json"))


def write_result(out: str, commit: str | None, params: dict, rows: list, device: str = "cuda") -> None:
    """Write one ``bench/results`` file in the result-file schema (BENCHMARKS.md, "Result files"):
    ``benchmark`` is the file's name without ``.json``, the GPU's name and copy bandwidth measured
    now ("cpu" and None for a ``device`` that is not CUDA), the commit (``git_commit``), the params
    and the rows."""
    import json
    from pathlib import Path

    on_gpu = str(device).startswith("cuda")
    doc = dict(benchmark=Path(out).stem, commit=git_commit(commit),
               gpu=torch.cuda.get_device_name(torch.device(device)) if on_gpu else "cpu",
               copy_gbps=copy_gbps_on(device), params=params, rows=rows)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}, labels as the page writes them."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out[m.group(1)] = float(m.group(2))
    return out


def read_metrics(address: str) -> dict[str, float]:
    """A service's /metrics page at host:port, parsed; {} when there is none or it does not answer."""
    if not address:
        return {}
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            return parse_metrics(resp.read().decode())
    except (OSError, http.client.HTTPException):   # (InvalidURL: a port such as "9l00"; a garbled answer)
        return {}


def add_step_sockets_arg(parser) -> None:
    """``--step-sockets``: what a benchmark's stack sends its step messages on (README,
    `verifier.step_socket` / `draft.step_socket`); `step_sockets_env` turns it into settings."""
    parser.add_argument("--step-sockets", choices=("on", "off", "verifier"), default="on",
                        help="the stack's step messages on Unix sockets or on gRPC streams; verifier: the "
                             "draft -> verifier hop only")


def step_sockets_env(choice: str) -> dict[str, str]:
    return {"DDTREE_VERIFIER_STEP_SOCKET": str(choice != "off").lower(),
            "DDTREE_DRAFT_STEP_SOCKET": str(choice == "on").lower()}
