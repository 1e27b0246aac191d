"""Where a step's time goes inside and between the three services, from stamps every process notes.

Runs a stack benchmark (default `bench.step_split`: a fresh stack, C=1 requests one after another)
with `bench/step_probe_hook` first on PYTHONPATH and DDTREE_STEP_PROBE_DIR set: every process of
it stamps the entry and exit of the functions of a step's path (the hook's `STEP_PATH`), and the
stamps of all processes merge on one clock. Reported, as medians over the run's steps:
* `durations`: each stamped function's time, per process role (`d.pack` in the draft, ...);
* `gaps`: the time between two events that follow each other in the merged timeline, for every
  pair seen at least `--least` times: the hops between processes and the host work between the
  stamped functions (`d.verify>` -> `sock.write>` in the draft: building the verifier's request).
Why: the Prometheus split (`bench.step_split`) has a service's stages, not the code between them,
and at C=1 a step is a chain of such pieces across three processes (BENCHMARKS.md, T-split).
The stamps cost about a microsecond each; compare runs of this tool with each other only. Stamps pair
by role, not by process or step: the stack must run one process a role and one step at a time (as
the default does: `bench.step_split`, C=1, one draft replica, `verifier.tp` 1).

    python -m bench.step_probe --out bench/results/step-probe-cpu.json -- --requests 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.common import write_result

__all__ = ["load_stamps", "durations", "gaps", "main"]

HOOK = Path(__file__).resolve().parent / "step_probe_hook"
ROLES = ("scheduler", "draft", "verifier", "main")
Stamp = tuple[float, str, str]   # (clock, role, label + ">" or "<")


def load_stamps(folder: Path, roles: Sequence[str] = ROLES) -> list[Stamp]:
    """Every process's stamps, merged in clock order."""
    out: list[Stamp] = []
    for path in folder.glob("*-*.json"):
        role = path.name.split("-", 1)[0]
        if role in roles:
            out += [(t, role, label) for label, t in json.loads(path.read_text())["stamps"]]
    out.sort()
    return out


def durations(stamps: Sequence[Stamp]) -> list[dict]:
    """Median microseconds from each label's entry to its exit, per role (nested calls of one
    label pair innermost first)."""
    open_: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    spans: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for t, role, label in stamps:
        key = (role, label[:-1])
        if label.endswith(">"):
            open_[key].append(t)
        elif open_[key]:
            spans[key].append((t - open_[key].pop()) * 1e6)
    return [{"role": role, "label": label, "count": len(v), "median_us": round(statistics.median(v), 1)}
            for (role, label), v in sorted(spans.items())]


def gaps(stamps: Sequence[Stamp], least: int) -> list[dict]:
    """Median microseconds between consecutive events, for pairs seen at least ``least`` times,
    most frequent first (a step's chain), then by time."""
    seen: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for (t0, r0, a), (t1, r1, b) in zip(stamps, stamps[1:]):
        if "main" not in (r0, r1):
            seen[(f"{r0[0]}:{a}", f"{r1[0]}:{b}")].append((t1 - t0) * 1e6)
    rows = [{"from": a, "to": b, "count": len(v), "median_us": round(statistics.median(v), 1)}
            for (a, b), v in seen.items() if len(v) >= least]
    return sorted(rows, key=lambda r: (-r["count"], -r["median_us"]))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module", default="bench.step_split", help="the stack benchmark to run under the probe")
    ap.add_argument("--least", type=int, default=20, help="a gap is listed when seen at least this often")
    ap.add_argument("--keep", default="", help="folder to keep the raw stamps in (default: a temporary one)")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default="", help="result file (BENCHMARKS.md's schema)")
    ap.add_argument("args", nargs="*", help="after --: the benchmark's own arguments")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "DDTREE_STEP_PROBE_DIR": str(folder),
               "PYTHONPATH": os.pathsep.join([str(HOOK), *filter(None, [os.environ.get("PYTHONPATH")])])}
        subprocess.run([sys.executable, "-m", args.module, *args.args], env=env, check=True)
        stamps = load_stamps(folder)
    if not stamps:
        raise SystemExit("no stamps: did the benchmark start a stack?")
    spans, chain = durations(stamps), gaps(stamps, args.least)
    for r in spans:
        print(f"{r['role']:9s} {r['label']:12s} n={r['count']:6d} {r['median_us']:10.1f} us")
    print("--- gaps")
    for r in chain:
        print(f"{r['from']:16s} -> {r['to']:16s} n={r['count']:6d} {r['median_us']:10.1f} us")
    if args.out:
        device = next((a.split("=", 1)[1] for a in args.args if a.startswith("--device=")), None)
        if device is None and "--device" in args.args:
            device = args.args[args.args.index("--device") + 1]
        # the GPU's name and copy bandwidth are measured here, after the stack is gone
        write_result(args.out, args.commit, {"module": args.module, "args": args.args, "least": args.least},
                     [{"kind": "duration", **r} for r in spans] + [{"kind": "gap", **r} for r in chain],
                     device=device or "cpu")

if __name__ == "__main__":
    main()
