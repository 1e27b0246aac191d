"""Run Nsight Compute on a target process and read its raw counters: what the ``*_ncu.py`` scripts share.

Why a module: the counters a script asks for must exist in the installed ``ncu`` (an unknown name
fails the whole run), and the CSV it prints needs the same parsing everywhere. ``available_metrics``
asks ``ncu`` which base names it knows, ``profile`` keeps those and returns one dict a launch.
ncu replays each launch with its own clock control unless told ``--clock-control none`` (METHOD:
leave the clocks alone), and serialises launches, so ``gpu__time_duration`` is one launch's time
under the profiler, not a graph-replayed time.
"""

from __future__ import annotations

import csv
import io
import subprocess

__all__ = ["STALLS", "stall_metrics", "available_metrics", "profile"]

# smsp__average_warp_latency_issue_stalled_<reason>.ratio: cycles a warp spent in that state per issued instruction
STALLS = ("barrier", "wait", "long_scoreboard", "short_scoreboard", "math_pipe_throttle", "dispatch_stall",
          "not_selected", "selected", "mio_throttle", "lg_throttle", "no_instruction", "branch_resolving",
          "sleeping", "membar", "drain", "tex_throttle", "imc_miss", "misc")


def stall_metrics(reasons: tuple[str, ...] = STALLS) -> list[str]:
    """The per-instruction stall metrics of ``reasons``."""
    return [f"smsp__average_warp_latency_issue_stalled_{s}.ratio" for s in reasons]


def available_metrics(ncu: str) -> set[str]:
    """Base metric names (before the first ``.``) this ``ncu`` knows for the GPU it sees."""
    proc = subprocess.run([ncu, "--query-metrics", "--csv"], capture_output=True, text=True, timeout=120)
    names = set()
    for line in proc.stdout.splitlines():
        first = line.split(",", 1)[0].strip().strip('"')
        if "__" in first:
            names.add(first)
    return names


def profile(ncu: str, target: list[str], metrics: list[str], *, kernel_regex: str | None = None,
            nvtx_include: str | None = None, launch_skip: int = 0, launch_count: int | None = None) -> list[dict]:
    """Raw counters of the chosen launches of ``target`` (a command line), one dict a launch with
    ``kernel`` (its name) and each metric as a float (``None`` where ncu printed none); counters this
    ``ncu`` does not list are left out (``available_metrics``), and units go under ``<metric>.unit``."""
    known = available_metrics(ncu)  # hardware counters; launch__* attributes are not listed there
    keep = [m for m in metrics if not known or m.startswith("launch__") or m.split(".", 1)[0] in known]
    cmd = [ncu, "--csv", "--page", "raw", "--clock-control", "none", "--metrics", ",".join(keep)]
    if kernel_regex:
        cmd += ["--kernel-name", f"regex:{kernel_regex}"]
    if nvtx_include:
        cmd += ["--nvtx", "--nvtx-include", nvtx_include]
    if launch_skip:
        cmd += ["--launch-skip", str(launch_skip)]
    if launch_count:
        cmd += ["--launch-count", str(launch_count)]
    proc = subprocess.run(cmd + target, capture_output=True, text=True, timeout=500)
    lines = proc.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if proc.returncode != 0 or start is None:
        raise RuntimeError(f"ncu failed ({proc.returncode}): {proc.stdout[-1500:]} {proc.stderr[-1500:]}")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    units, launches = rows[0], rows[1:]  # the first row after the header holds the units
    out = []
    for row in launches:
        rec: dict = dict(kernel=row.get("Kernel Name", ""))
        for m in keep:
            val = row.get(m, "").replace(",", "")
            try:
                rec[m] = float(val)
            except ValueError:
                rec[m] = val or None
            if units.get(m):
                rec[m + ".unit"] = units[m]
        out.append(rec)
    return out
