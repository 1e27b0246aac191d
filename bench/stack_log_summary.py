"""A stack log (the services' console output, as ``bench.soak --stack-log`` or ``ddtree bench
--stack-log`` keep it) as a result file: its start-up events and a summary of its request ends.

Why: a stall shows in no per-request check (every answer is right, only late); it shows as a long
time with no request ending anywhere. The summary row has the count of ``request_end`` events, the
longest request, and the longest gap between two request ends and when it began; the start-up
events (weights, warm-ups, graph captures and so on, everything but the per-request events) follow
as rows of their own, with the time each was logged.

Usage: python -m bench.stack_log_summary LOG [--source TEXT] [--commit SHA] --out FILE
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import re
from pathlib import Path

PER_REQUEST = ("request_end", "request_refused", "request_start")
_LINE = re.compile(r"^(\S+Z)\s+\[\s*(\w+)\s*\]\s+(\w+)\s*(.*)$")
_FIELD = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\[[^\]]*\]|\S+)")


def parse_line(line: str) -> dict | None:
    """``{"time", "level", "event", field: value, ...}`` of one console log line, or None."""
    m = _LINE.match(line.strip())
    if m is None:
        return None
    time, level, event, rest = m.groups()
    fields = {k: _machine_free(v.strip("'\"")) for k, v in _FIELD.findall(rest)}
    return {"time": time, "level": level, "event": event, **fields}


def _machine_free(value: str) -> str:
    """An absolute path cut to its last two parts (``models/demo``): where a run kept its files is
    that machine's business."""
    return "/".join(Path(value).parts[-2:]) if value.startswith("/") else value


def summarise(lines: list[str]) -> list[dict]:
    events = [e for e in map(parse_line, lines) if e is not None]
    ends = sorted(_time_of(e) for e in events if e["event"] == "request_end")
    summary: dict = {"row": "request_ends", "count": len(ends)}
    if ends:
        longest = max((e for e in events if e["event"] == "request_end"), key=lambda e: float(e.get("seconds", 0)))
        gap, after = max((((b[0] - a[0]).total_seconds(), a[1]) for a, b in zip(ends, ends[1:])),
                         default=(0.0, ends[0][1]))
        summary.update(longest_request_s=float(longest.get("seconds", 0)), longest_request_mode=longest.get("mode"),
                       longest_request_budget=longest.get("budget"), longest_gap_between_ends_s=round(gap, 3),
                       gap_after=after, first_end=ends[0][1], last_end=ends[-1][1])
    return [summary, *({k: v for k, v in e.items() if k != "level"} for e in events if e["event"] not in PER_REQUEST)]


def _time_of(event: dict) -> tuple[datetime.datetime, str]:
    return datetime.datetime.fromisoformat(event["time"].rstrip("Z")), event["time"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", help="the stack log (.gz read as gzip)")
    p.add_argument("--source", default="", help="what run the log is of (recorded in params)")
    p.add_argument("--commit", default=None)
    p.add_argument("--gpu", default=None, help="the GPU the run had (default: this machine's)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    path = Path(args.log)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    rows = summarise(text.splitlines())
    gpu = args.gpu
    if gpu is None:
        import torch
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    from bench.common import git_commit
    doc = dict(benchmark=Path(args.out).stem, commit=git_commit(args.commit), gpu=gpu, copy_gbps=None,
               params={"source": args.source, "log": path.name}, rows=rows)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(rows[0]))


if __name__ == "__main__":
    main()
