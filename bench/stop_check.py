"""Ctrl-C of `ddtree up` with a long request running: the request finishes within the scheduler's
`stop_grace_s` or ends UNAVAILABLE saying the scheduler stopped, it is logged, and every service is
gone.

Why a script: the stop's parts are tested on the CPU one by one (the scheduler's drain, the
launcher's order); this runs them together on a real stack, on the GPU too, where the verifier's
stop (its graphs, TP ranks) takes longer than on the CPU.

    python -m bench.stop_check --device cuda --dtype bfloat16 --commit SHA --out bench/results/stop-check-SHA.json
    python -m bench.stop_check            # CPU, float32: about 30 s
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import git_commit

ROOT = Path(__file__).resolve().parent.parent


def _lines(stream) -> queue.Queue:
    out: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in stream:
            out.put(line)
        out.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return out


def _left(launcher_pid: int) -> list[str]:
    """Processes still running that the launcher started (they carry its pid: DDTREE_PARENT_PID)."""
    mark = f"DDTREE_PARENT_PID={launcher_pid}".encode()
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                left.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120])
        except OSError:
            continue
    return left


def run(args: argparse.Namespace) -> dict:
    from services.scheduler.client import Client, ClientError

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for role in ("VERIFIER", "DRAFT"):
        env[f"DDTREE_{role}_DEVICE"], env[f"DDTREE_{role}_DTYPE"] = args.device, args.dtype
    if args.stop_grace_s is not None:
        env["DDTREE_SCHEDULER_STOP_GRACE_S"] = str(args.stop_grace_s)
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--model", args.model, "--port", "0"],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, log = _lines(up.stdout), []
    address = None
    deadline = time.monotonic() + args.startup_timeout
    while address is None and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        log.append(line)
        m = re.search(r"serving \S+ at (\S+?)[ ;(]", line)
        if m and "Ctrl-C stops" in line:
            address = m.group(1)
    if address is None:
        up.kill()
        raise SystemExit("stop_check: the stack did not come up:\n" + "".join(log[-20:]))
    outcome: dict = {}

    def generate() -> None:
        got = 0   # tokens streamed before the end: how far a cut request came
        try:
            with Client(address) as c:
                for chunk in c.stream(args.prompt, max_tokens=args.max_tokens, ignore_eos=True, mode="autoregressive"):
                    got += len(chunk.token_ids)
                    if chunk.finish_reason:
                        outcome["finish"] = chunk.finish_reason
        except ClientError as exc:
            outcome.update(code=exc.code.name, message=exc.message)
        outcome["tokens"] = got
    client = threading.Thread(target=generate)
    client.start()
    time.sleep(args.after_s)
    t0 = time.monotonic()
    up.send_signal(signal.SIGINT)
    up_rc = up.wait(timeout=args.startup_timeout)
    stopped_s = time.monotonic() - t0
    client.join(timeout=30)
    while (line := lines.get(timeout=5)) is not None:
        log.append(line)
    ends = [line for line in log if "request_end" in line]
    cut = outcome.get("code") == "UNAVAILABLE" and "stopped before this request finished" in outcome.get("message", "")
    row = {"after_s": args.after_s, "up_rc": up_rc, "stopped_s": round(stopped_s, 2), **outcome,
           "request_end_logged": len(ends) == 1, "requests_cut_logged": any("requests_cut_by_stop" in x for x in log),
           "tracebacks": sum("Traceback" in x for x in log), "left": _left(up.pid)}
    row["ok"] = (up_rc == 0 and not row["left"] and row["request_end_logged"] and not row["tracebacks"]
                 and (outcome.get("finish") == "length" or cut))
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt", default="import os")
    p.add_argument("--max-tokens", type=int, default=4000, help="clamped to the context: a request of seconds")
    p.add_argument("--after-s", type=float, default=1.5, help="Ctrl-C this long after the request starts")
    p.add_argument("--stop-grace-s", type=float, default=None, help="scheduler.stop_grace_s (default: the setting's)")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--commit", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    row = run(args)
    gpu = "cpu"
    if args.device.startswith("cuda"):
        import torch
        gpu = torch.cuda.get_device_name(0)
    doc = {"benchmark": Path(args.out).stem if args.out else "stop-check", "commit": git_commit(args.commit or None),
           "gpu": gpu, "copy_gbps": None, "params": {k: v for k, v in vars(args).items() if k != "out"},
           "rows": [row]}
    print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
