"""GPU check for issue 6: the cuda_ipc transport with draft and verifier on different GPUs of one
host, and slot and ring lifetime when a peer dies. Needs two GPUs; about two minutes on 2xH200.

    python -m bench.cuda_ipc_check --commit <sha> --out <dir>/cuda-ipc.json

Three parts, each a few rows of the result file (BENCHMARKS.md's result-file schema; rows: check, placement,
transport, passed, detail); the script exits 1 if any row failed.

1. placement: the demo stack (bfloat16) placed four ways. Each must negotiate the transport it
   should, and greedy outputs of the prompts must be identical to the first placement's:
   same GPU and cross (draft on the other GPU): cuda_ipc; reverse (the verifier on the second GPU,
   numbered cuda:0 in its own process by CUDA_VISIBLE_DEVICES, so the peers number the GPUs
   differently and the ring is found by UUID): cuda_ipc; isolated (each process sees only its own
   GPU, so no ring can be mapped): the handshake falls back to shm.
2. draft death: verifier and draft-0 on the first GPU, draft-1 on the second. draft-1 is killed
   mid-stream; the survivors' outputs must be exact, and the verifier's gauges must come back:
   peers 1, no running request, every KV page free, and its GPU memory down by the dead draft's
   ring (freed, not parked in torch's IPC limbo). draft-1 restarted must negotiate cuda_ipc
   again, serve exact outputs, and leave the verifier as it was before the death.
3. dead consumer, in this process: a ring owned on the first GPU, a consumer process on the second
   reading three slots into its own GPU and killed holding them; `release_all` must free every slot,
   the whole ring must be writable and readable again, and closing it must give its memory back.

Exactness: the scheduler runs one request per step (max_batch 1), so every output must equal the
batch-1 reference bit for bit; bf16 GEMMs are not batch-invariant, and a batched comparison could
flag a legitimate last-bit difference as a transport error.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from bench.common import copy_gbps_on, git_commit, parse_metrics
from ddtree.v1 import common_pb2, draft_pb2_grpc
from services.common.auth import internal_token, token_metadata
from services.common.launcher import Stack, StackSpec, free_port
from services.common.transport import bundle_slot, make_reader
from services.scheduler.client import AsyncClient, Client, ClientError

MIB = 1 << 20
RING_SLOTS = 4                 # the verifier's ring: 4 x 8 MiB, what a dead draft must give back
RING_SLOT_BYTES = 8 * MIB
KILL_AFTER_STEPS = 4           # draft-1 dies this many verify steps into its first request
MEMORY_SLACK = 4 * MIB         # a step's transient feature tensors, seen by the gauge


@dataclass(frozen=True)
class Placement:
    name: str
    label: str
    service_env: dict[str, dict[str, str]]
    transport: str             # what the handshake must settle on


def visible_gpus(environ: dict[str, str], count: int) -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES entries, so children can be given subsets."""
    listed = [g.strip() for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def _env(role: str, device: str, visible: str) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": visible, f"DDTREE_{role.upper()}_DEVICE": device}


def placements(gpus: Sequence[str]) -> list[Placement]:
    """Verifier and draft on two GPUs `gpus` (entries of CUDA_VISIBLE_DEVICES), four ways."""
    a, b = gpus[0], gpus[1]
    both, swapped = f"{a},{b}", f"{b},{a}"
    return [
        Placement("same", f"verifier GPU {a} / draft GPU {a}",
                  {"verifier": _env("verifier", "cuda:0", both), "draft": _env("draft", "cuda:0", both)}, "cuda_ipc"),
        Placement("cross", f"verifier GPU {a} / draft GPU {b}",
                  {"verifier": _env("verifier", "cuda:0", both), "draft": _env("draft", "cuda:1", both)}, "cuda_ipc"),
        Placement("reverse", f"verifier GPU {b} (its cuda:0, CUDA_VISIBLE_DEVICES={swapped}) / draft GPU {a}",
                  {"verifier": _env("verifier", "cuda:0", swapped), "draft": _env("draft", "cuda:0", both)},
                  "cuda_ipc"),
        Placement("isolated", f"verifier sees only GPU {a} / draft sees only GPU {b}",
                  {"verifier": _env("verifier", "cuda:0", a), "draft": _env("draft", "cuda:0", b)}, "shm"),
    ]


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return parse_metrics(resp.read().decode())


def wait_until(read: Callable[[], dict], ok: Callable[[dict], bool], timeout_s: float) -> tuple[dict, bool]:
    """Polls `read` until `ok`; returns the last reading and whether it was ok."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = read()
        except OSError:
            value = {}
        if value and ok(value):
            return value, True
        if time.monotonic() > deadline:
            return value, False
        time.sleep(0.1)


def load_prompts(model: str, n: int, max_len: int) -> list[list[int]]:
    """Held-out prompts of the demo model, as token ids cut to `max_len`."""
    doc = json.loads((Path(model) / "heldout_prompts.json").read_text())
    return [p["ids"][:max_len] for p in doc["prompts"][:n]]


def base_env(args: argparse.Namespace, verifier_metrics_port: int) -> dict[str, str]:
    return {
        "DDTREE_VERIFIER_DTYPE": "bfloat16", "DDTREE_DRAFT_DTYPE": "bfloat16",
        "DDTREE_DRAFT_WARMUP_BUDGETS": str(args.budget),
        "DDTREE_VERIFIER_RING_SLOTS": str(RING_SLOTS), "DDTREE_VERIFIER_RING_SLOT_BYTES": str(RING_SLOT_BYTES),
        "DDTREE_VERIFIER_METRICS_PORT": str(verifier_metrics_port),
        "DDTREE_SCHEDULER_MAX_BATCH": "1",        # exactness is batch-1 bit equality (module doc)
        "DDTREE_SCHEDULER_DEFAULT_BUDGET": str(args.budget),
    }


def greedy(address: str, prompts: Sequence[list[int]], args: argparse.Namespace) -> list[list[int]]:
    with Client(address, timeout_s=120.0) as c:
        return [c.generate(p, max_tokens=args.max_tokens, budget=args.budget, ignore_eos=True).token_ids
                for p in prompts]


def draft_transport(stack: Stack, name: str) -> str:
    """What one draft replica negotiated with the verifier (its own ModelInfo, asked with the
    stack's internal token)."""
    draft = next(s for s in stack.services if s.name == name)
    with grpc.insecure_channel(draft.address) as ch:
        return draft_pb2_grpc.DraftStub(ch).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10,
                                                         metadata=token_metadata(internal_token(draft.env))).transport


def _norm_uuid(uuid: object) -> str:
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return text.lower().removeprefix("gpu-")


def gpu_mib_by_service(pids: dict[str, int]) -> dict | str:
    """MiB each service holds on each GPU (this script's cuda:N), from NVML: where each one really
    runs, independent of its settings. Best effort: containers often hide other processes' pids."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no NVML here: say so in the row
        return f"not observed ({type(exc).__name__})"
    index = {_norm_uuid(getattr(torch.cuda.get_device_properties(i), "uuid", "")): i
             for i in range(torch.cuda.device_count())}
    out: dict[str, dict[str, int]] = {name: {} for name in pids}
    try:
        for n in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(n)
            local = index.get(_norm_uuid(pynvml.nvmlDeviceGetUUID(handle)))
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                for name, pid in pids.items():
                    if proc.pid == pid and local is not None:
                        out[name][f"cuda:{local}"] = (proc.usedGpuMemory or 0) // MIB
    finally:
        pynvml.nvmlShutdown()
    return out if any(out.values()) else "not observed (no matching pids; a container's pid namespace?)"


def _row(check: str, placement: str, transport: str | None, passed: bool, **detail) -> dict:
    return {"check": check, "placement": placement, "transport": transport, "passed": bool(passed), "detail": detail}


def _spec(args: argparse.Namespace, env: dict[str, str], service_env: dict, replicas: int = 1) -> StackSpec:
    return StackSpec(model_path=args.model, scheduler_port=0, draft_replicas=replicas, extra_env=env,
                     service_env=service_env, startup_timeout_s=300.0, log_path=args.stack_log)


# ---- 1. placements ---------------------------------------------------------------------------
def run_placement(args: argparse.Namespace, pl: Placement, prompts: list[list[int]]) -> tuple[dict, list | None]:
    """One stack placed as `pl`: its transport and greedy outputs (None when it did not serve)."""
    t0 = time.monotonic()
    try:
        with Stack(_spec(args, base_env(args, free_port()), pl.service_env)) as stack:
            with Client(stack.scheduler_address, timeout_s=60.0) as c:
                transport = c.model_info().transport
            outputs = greedy(stack.scheduler_address, prompts, args)
            usage = gpu_mib_by_service({"verifier": stack.process("verifier").pid,
                                        "draft": stack.process("draft").pid})
    except (RuntimeError, OSError, ClientError, grpc.RpcError) as exc:
        return _row("placement", pl.label, None, False, error=repr(exc)[-400:]), None
    row = _row("placement", pl.label, transport, transport == pl.transport, expected_transport=pl.transport,
               gpu_mib=usage, seconds=round(time.monotonic() - t0, 1))
    return row, outputs


def compare_outputs(row: dict, outputs: list | None, reference: list | None) -> dict:
    """Adds how many prompts match the reference placement; a placement passes only if all do."""
    same = sum(o == r for o, r in zip(outputs, reference)) if outputs is not None and reference is not None else 0
    row["detail"]["identical_outputs"] = same
    row["detail"]["prompts"] = len(reference or [])
    row["passed"] = row["passed"] and reference is not None and same == len(reference)
    return row


# ---- 2. draft death --------------------------------------------------------------------------
_VERIFY_STEPS = 'ddtree_step_ms_count{stage="verify"}'


async def _kill_mid_stream(stack: Stack, prompts: list[list[int]], args: argparse.Namespace,
                           draft1_port: int) -> tuple[list, float, bool]:
    """All prompts streamed at once; draft-1 killed KILL_AFTER_STEPS verify steps into this work."""
    done_before = scrape(draft1_port).get(_VERIFY_STEPS, 0)
    async with AsyncClient(stack.scheduler_address) as client:
        async def one(p: list[int]) -> list[int]:
            toks: list[int] = []
            async for chunk in client.stream(p, max_tokens=args.max_tokens, budget=args.budget, ignore_eos=True):
                toks += chunk.token_ids
            return toks

        tasks = [asyncio.create_task(one(p)) for p in prompts]
        _, busy = await asyncio.to_thread(
            wait_until, lambda: scrape(draft1_port),
            lambda m: m.get(_VERIFY_STEPS, 0) >= done_before + KILL_AFTER_STEPS, 60.0)
        stack.process("draft-1").kill()
        killed = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, time.monotonic() - killed, busy


def _idle(m: dict, peers: int, pages: float) -> bool:
    return (m.get("ddtree_transport_peers") == peers and m.get("ddtree_running_requests") == 0
            and m.get("ddtree_kv_pages_free") == pages)


def _gauges(m: dict) -> dict:
    keys = ("ddtree_transport_peers", "ddtree_running_requests", "ddtree_kv_pages_free", "ddtree_ring_slots_in_use",
            "ddtree_gpu_memory_allocated_bytes")
    return {k.removeprefix("ddtree_"): m.get(k) for k in keys}


def run_draft_death(args: argparse.Namespace, prompts: list[list[int]], reference: list | None) -> list[dict]:
    a, b = args.gpus[0], args.gpus[1]
    label = f"verifier GPU {a}, draft-0 GPU {a}, draft-1 GPU {b} (killed, restarted)"
    vport, d1port = free_port(), free_port()
    both = f"{a},{b}"
    service_env = {"verifier": _env("verifier", "cuda:0", both), "draft": {"CUDA_VISIBLE_DEVICES": both},
                   "draft-0": {"DDTREE_DRAFT_DEVICE": "cuda:0"},
                   "draft-1": {"DDTREE_DRAFT_DEVICE": "cuda:1", "DDTREE_DRAFT_METRICS_PORT": str(d1port)}}
    ring_bytes = RING_SLOTS * RING_SLOT_BYTES
    try:
        with Stack(_spec(args, base_env(args, vport), service_env, replicas=2)) as stack:
            transports = {n: draft_transport(stack, n) for n in ("draft-0", "draft-1")}
            start, _ = wait_until(lambda: scrape(vport), lambda m: m.get("ddtree_transport_peers") == 2, 30.0)
            pages0 = start.get("ddtree_kv_pages_free")
            expected = reference if reference is not None else greedy(stack.scheduler_address, prompts, args)
            warm = asyncio.run(_burst(stack.scheduler_address, prompts, args))   # both replicas, every graph used
            before, settled0 = wait_until(lambda: scrape(vport), lambda m: _idle(m, 2, pages0), 30.0)

            results, took, busy = asyncio.run(_kill_mid_stream(stack, prompts, args, d1port))
            failed = [r for r in results if isinstance(r, BaseException)]
            ok = [(i, r) for i, r in enumerate(results) if not isinstance(r, BaseException)]
            after, settled1 = wait_until(lambda: scrape(vport), lambda m: _idle(m, 1, pages0), 30.0)
            mem_drop = (before.get("ddtree_gpu_memory_allocated_bytes", 0)
                        - after.get("ddtree_gpu_memory_allocated_bytes", 0))

            stack.restart("draft-1")
            time.sleep(1.5)   # the scheduler's probe brings the replica back
            transport_back = draft_transport(stack, "draft-1")
            again = asyncio.run(_burst(stack.scheduler_address, prompts, args))
            d1_steps = scrape(d1port).get(_VERIFY_STEPS, 0)   # a fresh process: its steps since the restart
            back, settled2 = wait_until(lambda: scrape(vport), lambda m: _idle(m, 2, pages0), 30.0)
            mem_back = (back.get("ddtree_gpu_memory_allocated_bytes", 0)
                        - before.get("ddtree_gpu_memory_allocated_bytes", 0))
    except (RuntimeError, ClientError, grpc.RpcError, OSError) as exc:
        return [_row("draft_death", label, None, False, error=repr(exc)[-400:])]

    survivors_exact = all(r == expected[i] for i, r in ok)
    unavailable = all(isinstance(e, ClientError) and e.code == grpc.StatusCode.UNAVAILABLE for e in failed)
    rows = [
        _row("draft_death_survivors_exact", label, transports["draft-1"],
             busy and failed and ok and unavailable and survivors_exact and took < 30
             and warm == expected and set(transports.values()) == {"cuda_ipc"},
             transports=transports, killed_after_verify_steps=KILL_AFTER_STEPS, draft1_was_busy=busy,
             failed=len(failed), failed_all_unavailable=unavailable, survivors=len(ok),
             survivors_exact=survivors_exact, seconds_to_finish_after_kill=round(took, 2),
             warm_burst_exact=warm == expected),
        _row("draft_death_verifier_freed", label, transports["draft-1"],
             settled0 and settled1 and after.get("ddtree_ring_slots_in_use", 99) <= 1
             and mem_drop >= ring_bytes - MEMORY_SLACK,
             before=_gauges(before), after_death=_gauges(after), kv_pages_at_start=pages0,
             ring_bytes=ring_bytes, gpu_memory_freed_bytes=mem_drop),
        _row("draft_restart_serves", label, transport_back,
             transport_back == "cuda_ipc" and again == expected and d1_steps > 0 and settled2
             and abs(mem_back) <= MEMORY_SLACK,
             restarted_verify_steps=d1_steps, outputs_exact=again == expected, after_restart=_gauges(back),
             gpu_memory_vs_before_bytes=mem_back),
    ]
    return rows


async def _burst(address: str, prompts: list[list[int]], args: argparse.Namespace) -> list[list[int]]:
    async with AsyncClient(address, timeout_s=120.0) as client:
        outs = await asyncio.gather(*(client.generate(p, max_tokens=args.max_tokens, budget=args.budget,
                                                      ignore_eos=True) for p in prompts))
    return [o.token_ids for o in outs]


# ---- 3. dead consumer (in process) -------------------------------------------------------------
def _consume(ring: str, slot_bytes: int, slots: int, messages: list[bytes], device: str, conn, hold: bool) -> None:
    """Consumer process: map the ring, copy each slot into our own GPU, report, then hold or exit."""
    torch.cuda.set_device(device)
    reader = make_reader("cuda_ipc", ring, slot_bytes, slots)
    views = [reader.read(common_pb2.TensorBundle.FromString(m))["x"] for m in messages]   # on the owner's GPU
    mine = [v.to(device, copy=True) for v in views]                                        # explicit cross-GPU copy
    torch.cuda.synchronize(device)
    conn.send({"sums": [float(t.float().sum()) for t in mine], "ring_device": str(reader.device),
               "copy_device": str(mine[0].device)})
    if hold:
        signal.pause()   # keeps its views, and so its slots, until killed
    reader.close()


def _consumer_round(ring: str, slot_bytes: int, slots: int, messages: list[bytes], device: str,
                    hold: bool) -> tuple[dict, mp.Process]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consume, args=(ring, slot_bytes, slots, messages, device, child, hold))
    proc.start()
    deadline = time.monotonic() + 120
    while not parent.poll(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"the consumer process exited with code {proc.exitcode} before answering")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the consumer process did not answer in 120 s")
    return parent.recv(), proc


def run_dead_consumer(args: argparse.Namespace) -> list[dict]:
    from services.common.cuda_ipc import CudaIpcWriter

    owner, consumer = "cuda:0", "cuda:1"
    label = f"ring on GPU {args.gpus[0]} / consumer on GPU {args.gpus[1]} (killed holding 3 slots)"
    slots, slot_bytes, n = 4, MIB, 4096
    payloads = [torch.full((n,), i + 1, dtype=torch.bfloat16, device=owner) for i in range(slots)]  # [n] each
    want = [float(n * (i + 1)) for i in range(slots)]
    torch.cuda.synchronize(owner)
    gc.collect()
    base = torch.cuda.memory_allocated(owner)
    try:
        writer = CudaIpcWriter(slot_bytes, slots, owner)
        ring_bytes = torch.cuda.memory_allocated(owner) - base
        first = [writer.write({"x": p}).SerializeToString() for p in payloads[:3]]
        held = writer.slots_in_use
        got, proc = _consumer_round(writer.ring_name, writer.slot_bytes, slots, first, consumer, hold=True)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        writer.release_all()                      # what the verifier does when a draft's stream ends
        freed = writer.slots_in_use == 0
        again = [writer.write({"x": p}) for p in payloads]   # RingFull here would mean a leaked slot
        reread, proc2 = _consumer_round(writer.ring_name, writer.slot_bytes, slots,
                                        [b.SerializeToString() for b in again], consumer, hold=False)
        proc2.join(30)
        writer.release(bundle_slot(b) for b in again)
        writer.close()
        del writer, again
        gc.collect()
        torch.cuda.synchronize(owner)
        left = torch.cuda.memory_allocated(owner) - base
    except (RuntimeError, ValueError, OSError, EOFError) as exc:
        return [_row("dead_consumer", label, "cuda_ipc", False, error=repr(exc)[-400:])]
    read_ok = got["sums"] == want[:3] and got["ring_device"] == owner and got["copy_device"] == consumer
    return [
        _row("dead_consumer_slots_released", label, "cuda_ipc", held == 3 and read_ok and freed,
             held_when_killed=held, consumer_exit=proc.exitcode, consumer_read_exact=read_ok,
             consumer_saw_ring_on=got["ring_device"], consumer_copied_to=got["copy_device"],
             free_after_release_all=freed),
        _row("dead_consumer_ring_reusable", label, "cuda_ipc", reread["sums"] == want and proc2.exitcode == 0,
             slots_rewritten=slots, new_consumer_read_exact=reread["sums"] == want),
        _row("dead_consumer_ring_memory_freed", label, "cuda_ipc", ring_bytes >= slots * slot_bytes and left == 0,
             ring_bytes=ring_bytes, bytes_left_after_close=left),
    ]


# ---- main ------------------------------------------------------------------------------------
def write_results(path: Path, rows: list[dict], args: argparse.Namespace, commit: str) -> None:
    params = {"model": args.model, "dtype": "bfloat16", "prompts": args.prompts, "prompt_tokens": args.prompt_len,
              "max_tokens": args.max_tokens, "budget": args.budget, "scheduler_max_batch": 1,
              "verifier_ring": {"slots": RING_SLOTS, "slot_bytes": RING_SLOT_BYTES}, "gpus": args.gpus}
    doc = {"benchmark": path.stem, "commit": commit, "gpu": torch.cuda.get_device_name(0), "copy_gbps": copy_gbps_on("cuda"),
           "params": params, "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))


def print_table(rows: list[dict]) -> None:
    print(f"{'check':<34} {'transport':<9} {'ok':<4} placement", flush=True)
    for r in rows:
        print(f"{r['check']:<34} {str(r['transport']):<9} {'yes' if r['passed'] else 'NO':<4} {r['placement']}",
              flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=48, help="prompt tokens (held-out prompts, cut)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--commit", default="", help="commit to record (the device copy of the repo has no .git)")
    p.add_argument("--out", default="bench/results/cuda-ipc.json")
    p.add_argument("--stack-log", default=None, help="the services' output (default: --out with .log)")
    args = p.parse_args(argv)
    out = Path(args.out)
    args.stack_log = args.stack_log or str(out.with_suffix(".log"))
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))   # unwind: stop the stacks
    if torch.cuda.device_count() < 2:
        print(f"cuda_ipc_check: needs 2 GPUs, this process sees {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    args.gpus = visible_gpus(dict(os.environ), torch.cuda.device_count())
    commit = git_commit(args.commit)
    prompts = load_prompts(args.model, args.prompts, args.prompt_len)
    rows: list[dict] = []

    rows += run_dead_consumer(args)
    write_results(out, rows, args, commit)
    reference = None
    for pl in placements(args.gpus):
        row, outputs = run_placement(args, pl, prompts)
        if pl.name == "same":
            reference = outputs
        rows.append(compare_outputs(row, outputs, reference))
        print(f"placement {pl.name}: transport {row['transport']}, passed {row['passed']}", flush=True)
        write_results(out, rows, args, commit)
    rows += run_draft_death(args, prompts, reference)
    write_results(out, rows, args, commit)
    print_table(rows)
    print(f"wrote {out}", flush=True)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
