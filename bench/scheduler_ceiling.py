"""The scheduler's own ceiling: a real scheduler in front of a draft that answers every step at once.

Why: the demo model's steps take a few milliseconds, so the scheduler's work per request and step
(detokenizing, stop rules, one gRPC message a stream) is a share of every step; this measures that
share alone. A stand-in draft service (this file, ``--fake-draft PORT``) returns ``--accept``
random tokens a request and step; ``ddtree serve scheduler`` runs in front of it as deployed; the
client is ``AsyncClient`` with ``C`` concurrent streams in this process. Each row gives the
aggregate tokens/s, the scheduler's steps/s, and the scheduler process's CPU time per
request-step (user + system, from /proc), which bounds the step rate one core can drive.

    python -m bench.scheduler_ceiling --commit SHA --out bench/results/scheduler_ceiling-SHA.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _fake_draft(port: int, accept: int) -> None:
    """The stand-in draft: model info, and every step answered at once."""
    from ddtree.v1 import common_pb2, draft_pb2, draft_pb2_grpc
    from services.common.grpc_server import listen, new_server

    class Instant(draft_pb2_grpc.DraftServicer):
        async def GetModelInfo(self, request, context):
            return common_pb2.ModelInfo(model_type="instant", vocab_size=4096, max_context=1 << 20, block_size=16,
                                        max_budget=128, eos_token_id=0, kv_capacity_tokens=1 << 30, kv_page_size=16)

        async def StepStream(self, request_iterator, context):
            async for request in request_iterator:
                res = [draft_pb2.StepResult(request_id=it.request_id,
                                            acceptance_length=0 if it.prompt_token_ids else accept,
                                            token_ids=[random.randrange(5, 4096) for _ in
                                                       range(1 if it.prompt_token_ids else accept)])
                       for it in request.items if not it.prompt_continues]
                yield draft_pb2.StepResponse(results=res, draft_ms=0.0, verify_ms=0.0)

    async def serve() -> None:
        server, _ = new_server([draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name])
        draft_pb2_grpc.add_DraftServicer_to_server(Instant(), server)
        listen(server, f"127.0.0.1:{port}", "draft.port")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(address: str, concurrency: int, tokens: int) -> tuple[int, float]:
    from services.scheduler.client import AsyncClient

    async with AsyncClient(address, wait_for_ready=True, timeout_s=600) as client:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(client.generate("def fibonacci(n):", max_tokens=tokens, ignore_eos=True)
                                      for _ in range(concurrency)))
        return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fake-draft", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--accept", type=int, default=4, help="tokens a request and verify step")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--tokens", type=int, default=1000, help="max_tokens a request")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/scheduler_ceiling.json")
    args = ap.parse_args()
    if args.fake_draft is not None:
        _fake_draft(args.fake_draft, args.accept)
        return
    from bench.common import write_result
    from services.common.launcher import free_port, wait_healthy

    draft_port, port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos"), os.environ.get("PYTHONPATH", "")])}
    draft = subprocess.Popen([sys.executable, "-m", "bench.scheduler_ceiling", "--fake-draft", str(draft_port),
                              "--accept", str(args.accept)], env=env, cwd=ROOT)
    sched = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "scheduler"], cwd=ROOT,
                             env={**env, "DDTREE_SCHEDULER_DRAFT_ADDRESSES": f"127.0.0.1:{draft_port}",
                                  "DDTREE_SCHEDULER_PORT": str(port), "DDTREE_SCHEDULER_MAX_BATCH": "256"},
                             stdout=subprocess.DEVNULL)
    rows = []
    try:
        wait_healthy(f"127.0.0.1:{port}", sched, "scheduler", 60)
        asyncio.run(_load(f"127.0.0.1:{port}", 4, 32))  # warm-up
        for c in args.concurrency:
            cpu0 = _cpu_s(sched.pid)
            tokens, seconds = asyncio.run(_load(f"127.0.0.1:{port}", c, args.tokens))
            cpu = _cpu_s(sched.pid) - cpu0
            request_steps = tokens / args.accept
            rows.append(dict(concurrency=c, accept=args.accept, max_tokens=args.tokens, tokens=tokens,
                             seconds=round(seconds, 3), agg_tok_s=round(tokens / seconds, 1),
                             steps_per_s=round(request_steps / c / seconds, 1),
                             scheduler_cpu_s=round(cpu, 3), scheduler_cpu_us_per_request_step=round(cpu / request_steps * 1e6, 1),
                             scheduler_cpu_share=round(cpu / seconds, 3)))
            print(rows[-1], flush=True)
    finally:
        for proc in (sched, draft):
            proc.terminate()
            proc.wait(timeout=30)
    write_result(args.out, args.commit, dict(cpu_count=os.cpu_count(), client="AsyncClient in the bench process",
                                             draft="a stand-in that answers every step at once"), rows)


if __name__ == "__main__":
    main()
