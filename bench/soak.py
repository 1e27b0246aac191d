"""Soak: a stack under a random mix of requests for a while, every answer checked as it comes and
the stack's state checked after.

Why: the tests check each rule alone, on small checkpoints; a server breaks where rules meet under
load: a cancel while a long prompt is prefilled in pieces, a deadline in a step that also admits, a
budget-128 tree beside an autoregressive request, an abort racing the last token. Each worker sends
one request after another, each of a kind drawn at random (`KINDS`), and checks the answer against
the rules the README states for it (finish reason, token count, acceptance lengths, stop strings,
which error codes may come). No request answered anywhere for longer than ``--max-stall-s`` (5 s)
during the load is a finding too: right answers can all be late. After the load, once the
scheduler is idle, every gauge that counts
something held (KV pages, ring slots, transport peers, running and queued requests, KV reserved) must be back
where it stood before the load, and the scheduler's request counters must have moved by what the
clients saw.

It also measures what the README says of repeated requests: probe requests (greedy DDTree, greedy
autoregressive, seeded sampling with DDTree and autoregressively) are run alone before the load,
again and again during it, and alone after it; each run is compared token for token with the
first, and DDTree's first with autoregressive decoding's, greedy and seeded. Writes `bench/results/NAME.json`
(BENCHMARKS.md's result-file schema: one row per request kind, per probe, and the state check).

    python -m bench.soak --model models/demo --device cuda --dtype bfloat16 --duration 240 \
        --concurrency 48 --out bench/results/soak-demo.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import copy_gbps_on, git_commit, read_metrics
from bench.matrix import MatrixParams, load_token_stream, stack_spec
from services.common.config_files import read_config
from services.common.launcher import Stack, free_port
from services.scheduler.client import AsyncClient, ClientError, Completion

__all__ = ["KINDS", "SoakParams", "Soak", "Probe", "run_soak", "held_state", "main"]

# Request kinds and their weights in the mix: `Soak._request` builds each, `Soak.one` sends and checks it.
KINDS = {"greedy": 6, "sampled": 4, "autoregressive": 2, "stop": 2, "long": 2, "token_ids": 1, "cancel": 2,
         "deadline": 1, "abort": 1, "invalid": 1, "duplicate_id": 1}
BUDGETS = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)   # 0: the server's default
# Gauges that count something a request holds: idle before the load, they must read the same after it.
HELD = ("ddtree_kv_pages_free", "ddtree_ring_slots_in_use", "ddtree_transport_peers", "ddtree_running_requests",
        "ddtree_queue_depth", "ddtree_kv_tokens_reserved")


@dataclass
class SoakParams:
    duration_s: float = 60.0
    concurrency: int = 16
    max_tokens: int = 160          # the largest max_tokens a request draws
    long_context: int = 1024       # the longest prompt of kind "long"
    seed: int = 0
    probe_tokens: int = 64
    probe_every_s: float = 2.0     # a probe request is sent this often during the load
    max_stall_s: float = 5.0       # longer than this with no request answered is a finding (0: not checked)
    kinds: tuple[str, ...] = ()    # the request kinds of the mix (KINDS' weights); () = all


@dataclass
class Probe:
    """A request run alone and under load; every output is compared with its first alone run."""

    name: str
    kwargs: dict
    prompt: list[int]
    outputs: list[tuple[str, list[int]]] = field(default_factory=list)   # (when, token ids)
    errors: list[str] = field(default_factory=list)   # runs that failed: "when: CODE: message"

    async def run(self, client: AsyncClient, when: str) -> None:
        """One run; a failed one is recorded, not raised: a replica that died under the load (what
        a soak looks for) ended the soak with a traceback and no result file."""
        try:
            out = await client.generate(self.prompt, **self.kwargs)
        except ClientError as exc:
            self.errors.append(f"{when}: {exc.code.name}: {exc.message[:200]}")
            return
        self.outputs.append((when, out.token_ids))

    def row(self) -> dict:
        first = self.outputs[0][1] if self.outputs else None
        runs = Counter(when for when, _ in self.outputs)
        same = Counter(when for when, ids in self.outputs if ids == first)
        parted = [_first_difference(first, ids) for when, ids in self.outputs if ids != first]
        return {"probe": self.name, "kwargs": self.kwargs, "runs": dict(runs), "equal_to_first": dict(same),
                "first_difference_at": parted, "errors": self.errors}


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- metrics ----------------------------------------------------------------------------------
def held_state(pages: dict[str, dict[str, float]]) -> dict[str, float]:
    """The `HELD` gauges of each service's page, as service:name."""
    return {f"{svc}:{k}": v for svc, page in pages.items() for k, v in page.items() if k.split("{")[0] in HELD}


# ---- one request --------------------------------------------------------------------------------
class Soak:
    def __init__(self, p: SoakParams, stream: list[int], vocab: int, context_limit: int, default_budget: int,
                 eos_ids: frozenset[int] = frozenset()) -> None:
        self.p, self.stream, self.vocab, self.default_budget, self.eos_ids = p, stream, vocab, default_budget, eos_ids
        self.mix = {k: w for k, w in KINDS.items() if not p.kinds or k in p.kinds}
        self.context_limit = context_limit   # prompt + output where output stops ("length")
        self.sent: Counter = Counter()
        self.ok: Counter = Counter()
        self.expected_errors: Counter = Counter()
        self.findings: dict[str, list[str]] = defaultdict(list)   # kind -> what broke a rule
        self.tokens: Counter = Counter()
        self.seconds: dict[str, list[float]] = defaultdict(list)   # kind -> wall time of each answered request
        self.finishes: Counter = Counter()   # finish reasons of the requests that ran to an end
        self.seq = 0
        self.also_ran = 0   # second requests of kind duplicate_id that ran (their first had ended)
        self.answered_at: list[float] = []   # time.monotonic() of every answer, error or not (run_soak's workers)

    def _prompt(self, rng: random.Random, n: int) -> list[int]:
        start = rng.randrange(len(self.stream))
        return [self.stream[(start + i) % len(self.stream)] for i in range(n)]

    def _find(self, kind: str, what: str) -> None:
        if len(self.findings[kind]) < 20:
            self.findings[kind].append(what)

    def _check_done(self, kind: str, out: Completion, kw: dict) -> None:
        """The rules of a request that ran to its end."""
        n, max_tokens, budget, mode = len(out.token_ids), kw["max_tokens"], kw["budget"], kw["mode"]
        if out.finish_reason not in ("length", "stop"):
            self._find(kind, f"finish_reason {out.finish_reason!r}")
        if out.finish_reason == "stop" and kw["ignore_eos"] and not kw.get("stop") and not kw.get("stop_token_ids"):
            self._find(kind, "finish 'stop' with ignore_eos and no stop rule")
        # An end-of-sequence id (unless ignored) or a stop token ends the output: it can only be the last.
        enders = set(kw.get("stop_token_ids", ())) | (set() if kw["ignore_eos"] else set(self.eos_ids))
        if enders & set(out.token_ids[:-1]):
            self._find(kind, f"a stop or end-of-sequence id {sorted(enders & set(out.token_ids[:-1]))} inside the output")
        if out.token_ids and out.token_ids[-1] in enders and out.finish_reason != "stop":
            self._find(kind, f"ended on stop id {out.token_ids[-1]} with finish_reason {out.finish_reason!r}")
        if not 1 <= n <= max_tokens:
            self._find(kind, f"{n} tokens for max_tokens {max_tokens}")
        if out.usage is None or out.usage.completion_tokens != n:
            self._find(kind, f"usage {out.usage} for {n} tokens")
        if sum(out.acceptance_lengths) != n - 1:
            self._find(kind, f"acceptance lengths add to {sum(out.acceptance_lengths)} for {n} tokens")
        top = 1 if mode == "autoregressive" else (budget or self.default_budget) + 1
        if any(not 1 <= a <= top for a in out.acceptance_lengths):
            self._find(kind, f"acceptance lengths {sorted(set(out.acceptance_lengths))} at budget {budget} ({mode})")
        prompt = out.usage.prompt_tokens if out.usage else 0
        if out.finish_reason == "length" and n < max_tokens and prompt + n < self.context_limit:
            self._find(kind, f"finish 'length' after {n} of {max_tokens} tokens ({prompt}-token prompt)")

    def _request(self, kind: str, rng: random.Random) -> tuple[list[int] | str, dict, set[str]]:
        """A request of this kind: its prompt, its arguments, and the error codes it may get."""
        kw: dict = dict(max_tokens=rng.randint(1, self.p.max_tokens), budget=rng.choice(BUDGETS),
                        mode="autoregressive" if kind == "autoregressive" else "ddtree",
                        ignore_eos=rng.random() < 0.7)
        prompt: list[int] | str = self._prompt(rng, rng.randint(8, 96))
        allowed: set[str] = set()
        if kind == "sampled":
            kw.update(temperature=rng.uniform(0.5, 1.5), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]),
                      seed=rng.randrange(1 << 30))
        elif kind == "stop":
            prompt = rng.choice(["def f(x):\n", "import os\n", "class A:\n    def __init__(self):\n"])
            kw.update(stop=[rng.choice(["\n", "return", "(", "self"])], ignore_eos=False)
            if rng.random() < 0.5:   # and a stop token: one of the prompt's, so it is likely to come
                kw.update(stop_token_ids=[rng.choice(self._prompt(rng, 16))])
        elif kind == "long":
            prompt = self._prompt(rng, rng.randint(self.p.long_context // 2, self.p.long_context))
        elif kind == "token_ids":
            prompt = [rng.randrange(2, self.vocab) for _ in range(rng.randint(1, 64))]
        elif kind == "deadline":
            kw.update(timeout_s=rng.uniform(0.05, 1.0), max_tokens=self.p.max_tokens)
            allowed = {"DEADLINE_EXCEEDED"}
        elif kind == "invalid":
            kw.update(rng.choice([dict(budget=129), dict(temperature=-1.0), dict(max_tokens=0), dict(top_p=1.5)]))
            allowed = {"INVALID_ARGUMENT"}
        elif kind in ("abort", "duplicate_id"):
            kw.update(request_id=f"soak-{self.p.seed}-{self.seq}")
        return prompt, kw, allowed

    def _ended(self, kind: str, out: Completion, kw: dict) -> None:
        """A request that ran to its end (or was aborted): checked and counted."""
        if out.finish_reason != "aborted" or kind != "abort":
            self._check_done(kind, out, kw)
        if kind == "stop" and kw["stop"][0] in out.text:
            self._find(kind, f"stop string {kw['stop'][0]!r} in the text")
        self.finishes[out.finish_reason] += 1
        self.tokens[kind] += len(out.token_ids)

    async def one(self, client: AsyncClient, rng: random.Random) -> None:
        """One request of a kind drawn from the mix, sent, and its answer checked."""
        kind = rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
        self.seq += 1
        self.sent[kind] += 1
        prompt, kw, allowed = self._request(kind, rng)
        t0 = time.perf_counter()
        try:
            if kind == "cancel":   # leave the stream after some tokens: the server aborts the request
                got, leave_at = 0, rng.randint(1, max(1, kw["max_tokens"] // 2))
                async with client.stream(prompt, **kw) as s:
                    async for chunk in s:
                        got += len(chunk.token_ids)
                        if got >= leave_at:
                            break
                self.tokens[kind] += got
            elif kind == "duplicate_id":   # a second request under the id of one still running is refused
                first = asyncio.create_task(client.generate(prompt, **kw))
                await asyncio.sleep(rng.uniform(0.0, 0.1))
                try:
                    self._ended(kind, await client.generate(prompt, **kw), kw)   # the first had ended: the id is free
                    self.also_ran += 1
                except ClientError as exc:
                    if exc.code.name != "ALREADY_EXISTS":
                        raise
                    self.expected_errors[kind] += 1
                self._ended(kind, await first, kw)
            elif kind == "abort":
                task = asyncio.create_task(client.generate(prompt, **kw))
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                await client.abort(kw["request_id"])
                self._ended(kind, await task, kw)   # aborted, or it had ended before the abort came
            else:
                out = await client.generate(prompt, **kw)
                if kind == "invalid":
                    self._find(kind, f"{kw} was accepted")
                    return
                self._ended(kind, out, kw)
        except ClientError as exc:
            if exc.code.name in allowed:
                self.expected_errors[kind] += 1
            else:
                self._find(kind, f"{exc.code.name}: {exc.message[:200]}")
            return
        self.ok[kind] += 1
        self.seconds[kind].append(time.perf_counter() - t0)

    def check_stalls(self, start: float) -> tuple[float, float]:
        """The longest time from ``start`` (the load's, monotonic) with no request answered, and
        when it began (seconds into the load); longer than ``max_stall_s`` is a finding. Every
        answer can be right and still late: a kernel compiled on a request stalled every request
        of its replica for 23 s, and no per-request check saw it. Answers are not told apart by
        draft replica, so with several the others' answers can hide one replica's stall (the
        per-kind ``max`` seconds still show it)."""
        times = sorted(t for t in self.answered_at if t >= start)
        gap, at = max(((b - a, a - start) for a, b in zip([start, *times], times)), default=(0.0, 0.0))
        if self.p.max_stall_s and gap > self.p.max_stall_s:
            self._find("all", f"no request was answered for {gap:.1f} s, from {at:.1f} s into the load "
                              f"(more than {self.p.max_stall_s:g} s: a compile on a request, a blocked loop?)")
        return round(gap, 3), round(at, 3)

    def check_counted(self, counted: int, ran: int) -> None:
        """The scheduler's count of ended requests against the requests that ran. A request whose
        deadline passed before the scheduler took the call (a busy host: its event loop not run
        for longer than the deadline) is dropped by gRPC unseen, uncounted, and its client saw
        DEADLINE_EXCEEDED: at most that many may be missing."""
        expired = self.expected_errors["deadline"]
        if not ran - expired <= counted <= ran:
            self._find("all", f"the scheduler counted {counted} ended requests; {ran} ran, {expired} of them past "
                              f"their deadline at the client (uncounted only if it passed before the scheduler "
                              f"took it)")

    def rows(self) -> list[dict]:
        """One row a kind, and one ("all") for what no one kind broke. `seconds`: the answered
        requests' wall times (a stall, e.g. a kernel compiled on first use, shows in the max)."""
        def spread(xs: list[float]) -> dict | None:
            xs = sorted(xs)
            return {"p50": statistics.median(xs), "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))], "max": xs[-1]} if xs else None
        return [{"kind": k, "sent": self.sent[k], "answered": self.ok[k], "expected_errors": self.expected_errors[k],
                 "findings": self.findings.get(k, []), "tokens": self.tokens[k], "seconds": spread(self.seconds[k])}
                for k in [*KINDS, "all"]]


# ---- the run ------------------------------------------------------------------------------------
async def _probe_all(client: AsyncClient, probes: list[Probe], when: str) -> None:
    for pr in probes:
        await pr.run(client, when)


async def _idle(scheduler_metrics: str, within_s: float = 60.0) -> None:
    """Until the scheduler runs and queues nothing and has every ended request's release answered
    (its KV reservations back to 0): the last request's answer reaches its client before the step
    that releases it."""
    by = time.monotonic() + within_s
    while time.monotonic() < by:
        page = read_metrics(scheduler_metrics)
        busy = [k for k, v in page.items()
                if k.split("{")[0] in ("ddtree_running_requests", "ddtree_queue_depth", "ddtree_kv_tokens_reserved")
                and v != 0]
        if page and not busy:
            return
        await asyncio.sleep(0.2)


async def run_soak(address: str, p: SoakParams, stream: list[int], metrics: dict[str, str],
                   log=print) -> dict:
    """The load against a running stack; `metrics` maps service name -> its /metrics address."""
    async with AsyncClient(address, timeout_s=300.0) as client:
        info = await client.model_info()
        soak = Soak(p, stream, info.vocab_size, info.max_context - info.block_size, info.default_budget,
                    frozenset(info.eos_token_ids))
        rng = random.Random(p.seed)
        n = p.probe_tokens
        base = dict(max_tokens=n, ignore_eos=True)
        short = soak._prompt(rng, 48)   # greedy DDTree and greedy AR of one prompt: the same tokens
        sampled = soak._prompt(rng, 48)   # seeded DDTree and seeded AR of one prompt: the same tokens too
        seeded = dict(base, temperature=1.0, seed=1234)
        probes = [Probe("greedy_b16", dict(base, budget=16), short),
                  Probe("greedy_autoregressive", dict(base, mode="autoregressive"), short),
                  Probe("sampled_b16_seed", dict(seeded, budget=16), sampled),
                  Probe("greedy_b64_long", dict(base, budget=64), soak._prompt(rng, p.long_context)),
                  Probe("sampled_autoregressive_seed", dict(seeded, mode="autoregressive"), sampled)]
        await _probe_all(client, probes, "alone")   # warms the budgets up too
        await _probe_all(client, probes, "alone")
        await _idle(metrics["scheduler"])
        before = {svc: read_metrics(addr) for svc, addr in metrics.items()}
        t0 = time.monotonic()
        deadline = t0 + p.duration_s

        async def worker(i: int) -> None:
            wrng = random.Random(p.seed * 1000 + i)
            while time.monotonic() < deadline:
                await soak.one(client, wrng)
                soak.answered_at.append(time.monotonic())

        async def prober() -> None:
            k = 0
            while time.monotonic() + p.probe_every_s < deadline:
                await asyncio.sleep(p.probe_every_s)
                await probes[k % len(probes)].run(client, "under_load")
                k += 1

        memory: list[dict] = []   # each service's GPU memory every 15 s: growth that never levels off is a leak

        async def progress() -> None:
            while time.monotonic() + 15 < deadline:
                await asyncio.sleep(15)
                pages = {svc: read_metrics(addr) for svc, addr in metrics.items()}
                memory.append({"t_s": round(time.monotonic() - t0, 1),
                               **{svc: page.get("ddtree_gpu_memory_allocated_bytes") for svc, page in pages.items()}})
                log(f"soak: {time.monotonic() - t0:5.0f} s, {sum(soak.sent.values())} requests, "
                    f"{sum(len(v) for v in soak.findings.values())} findings")

        await asyncio.gather(*(worker(i) for i in range(p.concurrency)), prober(), progress())
        wall = time.monotonic() - t0
        stall = soak.check_stalls(t0)
        await _idle(metrics["scheduler"])
        await _probe_all(client, probes, "alone_after")
        await _idle(metrics["scheduler"])   # idle again: what a request held is given back
        after = {svc: read_metrics(addr) for svc, addr in metrics.items()}
    held_before, held_after = held_state(before), held_state(after)
    state = {"held_before": held_before, "held_after": held_after,
             "held_differs": sorted(k for k in held_before.keys() | held_after.keys()
                                    if held_before.get(k) != held_after.get(k))}
    # The scheduler's count of requests by how they ended, against what the clients saw.
    ended = {k.split('status="')[1].split('"')[0]: after["scheduler"].get(k, 0) - before["scheduler"].get(k, 0)
             for k in after["scheduler"] if k.startswith("ddtree_requests_total{")}
    state["scheduler_requests_by_status"] = ended
    state["client_finishes"] = dict(soak.finishes)
    # Every request that reached a decode (all but the invalid ones, the probes after the first two
    # rounds included) is counted once by how it ended.
    ran = (sum(soak.sent.values()) - soak.sent["invalid"] + soak.also_ran
           + sum(len(pr.outputs) - 2 for pr in probes))
    state["requests_counted"] = [sum(ended.values()), ran]
    state["deadline_exceeded_at_the_client"] = soak.expected_errors["deadline"]
    soak.check_counted(sum(ended.values()), ran)
    state["gpu_memory_allocated_bytes"] = {svc: [before[svc].get("ddtree_gpu_memory_allocated_bytes"),
                                                 after[svc].get("ddtree_gpu_memory_allocated_bytes")] for svc in metrics}
    state["gpu_memory_over_time"] = memory
    state["longest_time_without_an_answer_s"], state["longest_time_without_an_answer_from_s"] = stall
    # Greedy DDTree against greedy autoregressive decoding of the same prompt, each alone.
    ddtree, ar = probes[0].outputs[0][1], probes[1].outputs[0][1]
    state["greedy_ddtree_equals_autoregressive"] = ddtree == ar
    state["greedy_ddtree_parts_from_autoregressive_at"] = None if ddtree == ar else _first_difference(ddtree, ar)
    # The same of a seeded sampled request: its draws are keyed by token index, not by its trees.
    ddtree, ar = probes[2].outputs[0][1], probes[4].outputs[0][1]
    state["seeded_ddtree_equals_autoregressive"] = ddtree == ar
    state["seeded_ddtree_parts_from_autoregressive_at"] = None if ddtree == ar else _first_difference(ddtree, ar)
    requests = sum(soak.sent.values())
    log(f"soak: {requests} requests in {wall:.0f} s ({sum(soak.tokens.values())} tokens), "
        f"{sum(len(v) for v in soak.findings.values())} findings, held state differs: {state['held_differs']}")
    return {"wall_s": wall, "requests": requests, "kinds": soak.rows(), "probes": [pr.row() for pr in probes],
            "state": state}


def _synthetic_stream(vocab: int, n: int = 8192, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=16, help="clients sending requests at once")
    ap.add_argument("--max-batch", type=int, default=0, help="scheduler.max_batch (default: half the clients, so "
                    "some wait in the queue)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--long-context", type=int, default=1024)
    ap.add_argument("--prefill-tokens", type=int, default=512, help="scheduler.max_prefill_tokens (small: long "
                    "prompts go in pieces)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1, help="verifier tensor-parallel ranks")
    ap.add_argument("--draft-replicas", type=int, default=1)
    ap.add_argument("--kinds", nargs="+", default=[], choices=list(KINDS), help="only these request kinds")
    ap.add_argument("--max-stall-s", type=float, default=SoakParams.max_stall_s,
                    help="longer than this with no request answered is a finding (0: not checked)")
    ap.add_argument("--commit", default="")
    ap.add_argument("--stack-log", default=None)
    ap.add_argument("--out", default="soak-local.json")
    args = ap.parse_args(argv)
    p = SoakParams(duration_s=args.duration, concurrency=args.concurrency, max_tokens=args.max_tokens,
                   long_context=args.long_context, seed=args.seed, kinds=tuple(args.kinds), max_stall_s=args.max_stall_s)
    prompts = Path(args.model) / "heldout_prompts.json"
    vocab = read_config(Path(args.model))["vocab_size"]   # a multimodal wrapper's: its text_config's
    stream = load_token_stream(prompts) if prompts.is_file() else _synthetic_stream(vocab, seed=args.seed)
    mp = MatrixParams(contexts=[p.long_context], concurrencies=[p.concurrency + 1], budgets=list(BUDGETS),
                      max_tokens=max(p.max_tokens, p.probe_tokens))
    spec, draft_metrics, scheduler_metrics = stack_spec(mp, args.model, args.device, args.dtype, args.stack_log)
    verifier_metrics = f"127.0.0.1:{free_port()}"
    spec.extra_env.update({
        "DDTREE_VERIFIER_METRICS_PORT": verifier_metrics.split(":")[1],
        "DDTREE_SCHEDULER_MAX_BATCH": str(args.max_batch or max(1, p.concurrency // 2)),
        "DDTREE_SCHEDULER_MAX_PREFILL_TOKENS": str(args.prefill_tokens),
        "DDTREE_DRAFT_WARMUP_BUDGETS": "8,16,32",
        "DDTREE_VERIFIER_TP": str(args.tp),
    })
    metrics = {"scheduler": scheduler_metrics, "draft": draft_metrics, "verifier": verifier_metrics}
    if args.draft_replicas > 1:   # each replica its own metrics page
        spec.draft_replicas = args.draft_replicas
        del metrics["draft"]
        for i in range(args.draft_replicas):
            port = draft_metrics.split(":")[1] if i == 0 else str(free_port())
            spec.service_env[f"draft-{i}"] = {"DDTREE_DRAFT_METRICS_PORT": port}
            metrics[f"draft-{i}"] = f"127.0.0.1:{port}"
    print(f"soak: starting the stack on {args.model} ({args.device}, {args.dtype})", file=sys.stderr, flush=True)
    with Stack(spec) as stack:
        metrics = {name: stack.metrics_address(name) for name in metrics}   # as they listen: one may have moved
        result = asyncio.run(run_soak(stack.scheduler_address, p, stream, metrics,
                                      log=lambda m: print(m, file=sys.stderr, flush=True)))
    gpu = "cpu"
    if args.device.startswith("cuda"):
        import torch
        gpu = torch.cuda.get_device_name(0)
    params = {**vars(args), "soak": vars(p), "env": {k: v for k, v in spec.extra_env.items() if "PORT" not in k}}
    for key in ("out", "stack_log"):   # file names only: where a run wrote them is that machine's business
        params[key] = Path(params[key]).name if params[key] else None
    rows = ([{"row": "kind", **r} for r in result["kinds"]] + [{"row": "probe", **r} for r in result["probes"]]
            + [{"row": "state", **result["state"]}])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": out.stem, "commit": git_commit(args.commit or None), "gpu": gpu,
                               "copy_gbps": copy_gbps_on(args.device), "params": params, "wall_s": result["wall_s"],
                               "requests": result["requests"], "rows": rows}, indent=2))
    findings = sum(len(r["findings"]) for r in result["kinds"]) + sum(len(r["errors"]) for r in result["probes"])
    bad_state = result["state"]["held_differs"]
    for r in result["kinds"]:   # what broke, where a run's output is all one sees of it (CI)
        for what in r["findings"]:
            print(f"soak: finding ({r['kind']}): {what}", file=sys.stderr)
    for r in result["probes"]:
        for what in r["errors"]:
            print(f"soak: probe error ({r['probe']}): {what}", file=sys.stderr)
    print(f"soak: wrote {out}; {findings} findings; held state differs: {bad_state or 'no'}", file=sys.stderr)
    return 0 if not findings and not bad_state else 1


if __name__ == "__main__":
    sys.exit(main())
