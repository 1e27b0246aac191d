"""Tensor-parallel verifier on the CPU (gloo): TP=2 and TP=4 give TP=1's tokens; a dead rank is reported."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import services.verifier.ranks as ranks_module
from ddtree.v1 import verifier_pb2, verifier_pb2_grpc
from services.common.grpc_server import ServiceError
from services.common.launcher import Stack, StackSpec, free_port
from services.common.make_checkpoint import make_random_checkpoint
from services.common.settings import RANK0_SETTINGS_ENV as SETTINGS_ENV
from services.common.settings import SettingsError, VerifierSettings
from services.common.transport import InlineWriter
from services.scheduler.client import AsyncClient, Client, ClientError
from services.verifier import server
from services.verifier.model import expected_tensors, load_checkpoint
from services.verifier.parallel import TensorParallel, load_rank_slice, split_rule
from services.verifier.ranks import (_NOOP, _STOP, EngineGroup, GroupFailed, first_exit, settings_from_json,
                                     settings_json, spawn_workers, stop_workers, watch_workers, worker_loop)
from services.verifier.server import _end_start_up
from tests.stack_fixtures import PROMPTS, StackStarts, internal_metadata

# moe_intermediate 128 / tp 4 = 32: each rank's INT4 down_proj slice is one whole quantization group.
OVERRIDES = {"moe_intermediate_size": 128}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("tp") / "ckpt", vocab_size=512, seed=5,
                                  target_overrides=OVERRIDES)


def _tp_spec(ckpt, tp: int) -> StackSpec:
    return StackSpec(model_path=str(ckpt), scheduler_port=0, extra_env={"DDTREE_VERIFIER_TP": str(tp)})


@pytest.fixture(scope="module", autouse=True)
def starts(request, ckpt):
    """The dead-rank test's own TP=2 stack, started as the module starts (alongside the equality
    test's three), not after them; see ``StackStarts``."""
    starts = StackStarts(request, {"test_dead_rank_makes_the_group_unhealthy_without_hanging": lambda: _tp_spec(ckpt, 2)})
    yield starts
    starts.close()


def _split_dim(name: str) -> int | None:
    """Where each weight is cut across ranks (Megatron's split, as the module doc says), or None
    where every rank holds all of it: an independent reading of the rules, by name."""
    if name == "lm_head.weight" or name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight",
                                                  "self_attn.kv_b_proj.weight")):
        return 0
    if name.endswith("self_attn.o_proj.weight"):
        return 1
    if ".mlp." in name and ("gate_proj.weight" in name or "up_proj.weight" in name):
        return 0
    if ".mlp." in name and "down_proj.weight" in name:
        return 1
    return None


@pytest.mark.parametrize("size", [2, 4])
def test_every_rank_gets_its_own_equal_share_of_each_split_weight(ckpt, size):
    """Each rank holds its 1/size chunk (in rank order) of every split weight, the whole of every
    replicated one, and an INT4 `weight_shape` that is its slice's dense shape. (Reassembling the
    pieces alone could not tell a rank that got everything from one that got its share.)"""
    config, full = load_checkpoint(ckpt)
    parts = [load_rank_slice(ckpt, config, expected_tensors(config), r, size) for r in range(size)]
    for name, tensor in full.items():
        if name.endswith(".weight_shape"):
            dense = tensor.tolist()
            dense[0 if ("gate_proj" in name or "up_proj" in name) else 1] //= size
            assert all(p[name].tolist() == dense for p in parts), name
            continue
        dim = _split_dim(name)
        for r, p in enumerate(parts):
            want = tensor if dim is None else torch.chunk(tensor, size, dim=dim)[r]
            assert p[name].shape == want.shape and torch.equal(p[name], want), (name, r)


def test_attention_splits_take_whole_heads_when_the_head_widths_differ(ckpt):
    """DeepSeek-V3's head widths differ (qk_nope 128, qk_rope 64, v 128); the test checkpoints use
    one width for all three, which would hide a rule using the wrong one."""
    config, _ = load_checkpoint(ckpt)
    cfg = dataclasses.replace(config, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)
    H = cfg.num_attention_heads
    q = split_rule("model.layers.0.self_attn.q_b_proj.weight", cfg, (H * 24, 32))
    kv = split_rule("model.layers.0.self_attn.kv_b_proj.weight", cfg, (H * 40, 32))
    o = split_rule("model.layers.0.self_attn.o_proj.weight", cfg, (64, H * 24))
    assert (q.dim, q.unit, q.count) == (0, 24, H)      # qk_nope + qk_rope rows a head
    assert (kv.dim, kv.unit, kv.count) == (0, 40, H)   # qk_nope + v rows a head
    assert (o.dim, o.unit, o.count) == (1, 24, H)      # v columns a head


def test_tp2_and_tp4_equal_tp1_and_outlast_idle_time_and_bad_input(ckpt):
    """The three stacks start side by side (each starts its own services in order, as always): a
    start is mostly one process importing at a time, so two cores start three stacks in about the
    time of the slowest. Each is queried and stopped as before. TP=2 is first left idle longer
    than its collectives' timeout, and every stack gets a second draft's bad input between two
    rounds of queries: the group stays up and in step, and its own draft's outputs are unchanged.
    At every TP, greedy DDTree gives the group's own greedy autoregressive tokens."""
    tps = (1, 2, 4)
    stacks = {tp: Stack(_tp_spec(ckpt, tp)) for tp in tps}
    # The workers wait for rank 0's next call in a collective that times out like any other (an
    # idle minute killed the group): rank 0 keeps an idle group awake.
    idle_timeout_s = 8   # not less: its steps and start-up run under the same timeout on two busy cores
    stacks[2].spec.extra_env["DDTREE_VERIFIER_TP_TIMEOUT_S"] = str(idle_timeout_s)
    results = {}
    with contextlib.ExitStack() as started:
        for stack in stacks.values():
            started.callback(stack.stop)   # a stack whose start failed has stopped its own services
        with ThreadPoolExecutor(len(tps)) as pool:
            for done in [pool.submit(stack.start) for stack in stacks.values()]:
                done.result()
        ready = time.monotonic()
        for tp, stack in stacks.items():
            if tp == 2:
                time.sleep(max(0.0, ready + idle_timeout_s + 2 - time.monotonic()))
            results[tp] = asyncio.run(_query(stack.scheduler_address))
            assert results[tp][0] == results[tp][2], f"tp={tp}: greedy DDTree must be the same group's greedy decoding"
            asyncio.run(_bad_input(stack.address("verifier"), ckpt, internal_metadata(stack)))
            assert asyncio.run(_query(stack.scheduler_address)) == results[tp], f"tp={tp}"
            with Client(stack.scheduler_address) as c:
                assert c.model_info().tp_size == tp
            verifier = stack.process("verifier")
            stack.stop()
            assert verifier.returncode == 0, f"tp={tp}: an orderly stop must not read as a rank dying"
    assert results[2] == results[1] and results[4] == results[1]


async def _query(address: str) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Greedy DDTree, one sampled request, and greedy autoregressive decoding of the same prompts."""
    async with AsyncClient(address) as client:
        greedy = await asyncio.gather(*(client.generate(p, max_tokens=16, budget=8, ignore_eos=True)
                                        for p in PROMPTS[:6]))
        sampled = await client.generate(PROMPTS[0], max_tokens=16, temperature=1.0, seed=3, budget=8, ignore_eos=True)
        ar = await asyncio.gather(*(client.generate(p, max_tokens=16, mode="autoregressive", ignore_eos=True)
                                    for p in PROMPTS[:6]))
        return [g.token_ids for g in greedy], sampled.token_ids, [a.token_ids for a in ar]


async def _bad_input(verifier: str, ckpt, token: tuple[tuple[str, str], ...]) -> None:
    """A second draft (as a misconfigured replica or a bug would) names a layer the target lacks,
    then sends tree bundles that cannot be split into its trees: each gets a clear status for its
    own trees, and its stream and other request go on (before, a TP group's worker ranks re-raised
    the refusal and the group ended; at TP=1 the stream ended UNKNOWN, freeing the draft's requests)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    layers = json.loads((ckpt / "drafter" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    hello = verifier_pb2.HandshakeRequest(draft_id="second", feature_layer_ids=layers, hidden_size=cfg["hidden_size"],
                                          vocab_size=cfg["vocab_size"], transports=["inline"])
    async with grpc.aio.insecure_channel(verifier) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        wrong = verifier_pb2.HandshakeRequest()
        wrong.CopyFrom(hello)
        wrong.feature_layer_ids[:] = [cfg["num_hidden_layers"]]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Handshake(wrong, metadata=token)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "outside the target" in info.value.details()
        await stub.Handshake(hello, metadata=token)
        call = stub.VerifyStream(metadata=(("draft-id", "second"), *token))
        await call.write(verifier_pb2.VerifyRequest(sequence=1, prefills=[
            verifier_pb2.PrefillItem(request_id=r, token_ids=[5, 6, 7], reserve_tokens=64) for r in ("x", "y")]))
        pending = {item.request_id: item.token_ids[0] for item in (await call.read()).prefills}
        t = torch.tensor
        bad_bundles = [
            {"tokens": t([pending["x"], 9]), "parents": t([-1, 0]), "depths": t([0, 1]), "sizes": t([3])},
            {"tokens": t([pending["x"], 9, 9]), "parents": t([-1, 0]), "depths": t([0, 1, 1]), "sizes": t([3])},
            {"tokens": t([[pending["x"]]]), "parents": t([[-1]]), "depths": t([[0]]), "sizes": t([1])},
            {"tokens": t([pending["x"]]), "parents": t([-1])},
        ]
        for seq, trees in enumerate(bad_bundles, start=2):
            await call.write(verifier_pb2.VerifyRequest(sequence=seq, verify_ids=["x"], trees=InlineWriter().write(trees)))
            answer = await call.read()
            assert [(v.request_id, v.error_code) for v in answer.verifies] == \
                [("x", grpc.StatusCode.INVALID_ARGUMENT.value[0])], (seq, answer.verifies)
        good = {"tokens": t([pending["y"]]), "parents": t([-1]), "depths": t([0]), "sizes": t([1])}
        await call.write(verifier_pb2.VerifyRequest(sequence=9, verify_ids=["y"], trees=InlineWriter().write(good)))
        (item,) = (await call.read()).verifies
        assert item.error_code == 0 and len(item.token_ids) == 1
        await call.done_writing()


def _listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket tables")
def test_rank_zeros_store_listens_on_loopback_only():
    """torch's store server binds every interface whatever host it is told, and takes no token:
    anyone who reached a TP verifier's host could fake a rank's check-in or fill rank 0's memory."""
    from services.verifier.parallel import master_store

    store = master_store(2)
    try:
        assert _listening_addresses(store.port) == ["0100007F"]   # 127.0.0.1, and no "*" beside it
        worker = torch.distributed.TCPStore("127.0.0.1", store.port, 2, is_master=False,
                                            timeout=datetime.timedelta(seconds=10))
        worker.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store


def test_rank_watchdog_reports_a_death_and_stays_quiet_once_disarmed():
    deaths: list[str] = []
    armed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    watch_workers([armed], deaths.append, interval_s=0.01)
    armed.wait(timeout=10)
    deadline = time.monotonic() + 5
    while not deaths and time.monotonic() < deadline:
        time.sleep(0.01)
    assert deaths == ["verifier rank 1 exited with code 3"]

    deaths.clear()
    quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    watch_workers([quiet], deaths.append, interval_s=0.01).set()   # disarmed before the stop
    stop_workers([quiet], grace_s=10.0)
    time.sleep(0.1)
    assert quiet.returncode == 0 and deaths == []


def test_a_worker_that_exited_cleanly_still_counts_as_gone():
    """A worker rank that left with code 0 (its loop ended) is as gone as one that crashed: the
    group cannot run without it."""
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    clean = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        clean.wait(timeout=30)
        assert first_exit([alive, clean]) == "verifier rank 2 exited with code 0"
    finally:
        alive.kill()
        alive.wait()


def test_a_worker_whose_rank_0_died_before_it_asked_for_the_death_signal_exits():
    """A SIGTERM to rank 0 in its first seconds (its signal handler comes later) left the worker,
    then importing, running with no group to join: it waited for it for minutes."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    t0 = time.monotonic()
    worker = subprocess.run([sys.executable, "-m", "services.verifier.ranks", "--rank", "1", "--init-method",
                             "tcp://127.0.0.1:9", "--parent-pid", str(gone.pid)],
                            capture_output=True, text=True, timeout=120)
    assert worker.returncode == 1 and f"rank 0 (pid {gone.pid}) is gone" in worker.stderr, worker.stderr[-2000:]
    assert time.monotonic() - t0 < 60


def test_stop_workers_escalates_to_sigterm_then_sigkill():
    script = ("import signal, sys, time\n"
              "if sys.argv[1] == 'deaf': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "print('ready', flush=True); time.sleep(60)")
    procs = [subprocess.Popen([sys.executable, "-c", script, mode], stdout=subprocess.PIPE, text=True)
             for mode in ("stuck", "deaf")]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"   # its SIGTERM handling is in place
    t0 = time.monotonic()
    stop_workers(procs, grace_s=0.2, kill_after_s=0.5)
    assert [p.returncode for p in procs] == [-signal.SIGTERM, -signal.SIGKILL]
    assert time.monotonic() - t0 < 10


def test_stop_workers_gives_a_terminated_worker_kill_after_s_to_finish():
    """The SIGKILL comes kill_after_s after the SIGTERM (grace_s + kill_after_s from the start), so
    a worker that cleans up for a moment on SIGTERM exits by itself."""
    script = ("import signal, sys, time\n"
              "def bye(*a):\n    time.sleep(0.3); sys.exit(5)\n"
              "signal.signal(signal.SIGTERM, bye)\n"
              "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    stop_workers([proc], grace_s=1.0, kill_after_s=0.8)
    assert proc.returncode == 5


def _worker_ranks(pid: int) -> list[int]:
    """The verifier's worker-rank child processes (not e.g. its shared-memory resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        kids = [int(x) for x in fh.read().split()]
    return [k for k in kids if b"services.verifier.ranks" in open(f"/proc/{k}/cmdline", "rb").read()]


def test_dead_rank_makes_the_group_unhealthy_without_hanging(ckpt, starts):
    with starts.take("test_dead_rank_makes_the_group_unhealthy_without_hanging", _tp_spec(ckpt, 2)) as stack:
        verifier = stack.process("verifier")
        (worker,) = _worker_ranks(verifier.pid)

        async def scenario():
            async with AsyncClient(stack.scheduler_address) as client:
                got = 0
                with pytest.raises(ClientError) as info:
                    async for chunk in client.stream(PROMPTS[0], max_tokens=400, mode="autoregressive",
                                                     ignore_eos=True):
                        got += 1
                        if got == 3:
                            os.kill(worker, signal.SIGKILL)
                            t0 = time.monotonic()
                return info.value, time.monotonic() - t0

        err, took = asyncio.run(scenario())
        assert err.code == grpc.StatusCode.UNAVAILABLE and took < 10, (err, took)
        assert "verifier rank 1 exited with code -9" in err.message, err.message   # not "rank 0's ... failed"
        verifier.wait(timeout=15)                 # rank 0 ends the group instead of hanging
        assert verifier.returncode != 0
        with grpc.insecure_channel(stack.address("verifier")) as ch:
            with pytest.raises(grpc.RpcError):    # nothing answers for the dead group any more
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)


def test_rank_0_waits_a_moment_for_the_exit_of_a_rank_that_broke_a_collective() -> None:
    """The reset connection reaches rank 0 while the dead rank is still being torn down: its exit
    is polled for a moment, so the failure names it."""

    polls = iter([None] * 5 + ["verifier rank 1 exited with code -9"])
    tp = TensorParallel(0, 1, peers_gone=lambda: next(polls))
    assert tp.peer_gone() is None   # no wait: one look
    assert tp.peer_gone(wait_s=5.0) == "verifier rank 1 exited with code -9"
    assert TensorParallel(0, 1).peer_gone(wait_s=5.0) is None   # no workers to ask: at once


def test_rank_0_gives_up_on_ranks_that_never_check_in_with_deadline_exceeded():
    """Workers that never join (or never finish loading) within the limit fail the start with
    DEADLINE_EXCEEDED naming how many ranks arrived, not UNAVAILABLE ("a rank died")."""
    class Store:
        def __init__(self):
            self.counts = {}

        def add(self, key, n):
            self.counts[key] = self.counts.get(key, 0) + n
            return self.counts[key]

        def set(self, key, value):
            raise AssertionError("no go without every rank")

    tp = TensorParallel(0, 1, peers_gone=lambda: None)
    tp.size, tp._store = 3, Store()
    t0 = time.monotonic()
    with pytest.raises(ServiceError) as info:
        tp._meet("loaded", datetime.timedelta(seconds=0.2))
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "1 of 3 ranks loaded" in info.value.message
    assert time.monotonic() - t0 < 5


def _align_rank(rank: int, size: int, port: int, join_lag_s: float, load_lag_s: float, timeout_s: float,
                out) -> None:
    time.sleep(join_lag_s)   # this rank's process starts later (a busy host)
    tp = TensorParallel(rank, size, f"tcp://127.0.0.1:{port}", backend="gloo", timeout_s=timeout_s)
    time.sleep(load_lag_s)   # this rank's weights take longer to load
    tp.align()
    try:
        got = tp.broadcast(("call", rank) if rank == 0 else None)   # the first call, under the timeout
        out.put((rank, got))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, repr(exc)[:200]))
    tp.close()


def test_ranks_that_start_and_load_at_different_speeds_meet_before_their_first_timed_call():
    """The collectives' timeout (`verifier.tp_timeout_s`) bounds neither the start nor the load.
    It did both: the rendezvous waited that long for the workers to join (three stacks starting on
    two cores ran past it), and a worker done loading waited that long for rank 0's first call
    (rank 0 loading a large model ended the group). Here rank 1 joins, and rank 0 finishes
    loading, 2.5 s after the other, with a 1 s timeout; they meet, then call as before."""

    spawn = mp.get_context("spawn")
    out, port = spawn.Queue(), free_port()
    procs = [spawn.Process(target=_align_rank, args=(rank, 2, port, join_lag, load_lag, 1.0, out))
             for rank, join_lag, load_lag in ((0, 0.0, 2.5), (1, 2.5, 0.0))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sorted(out.get(timeout=5) for _ in procs) == [(0, ("call", 0)), (1, ("call", 0))]


def test_no_worker_is_let_go_before_the_last_rank_has_loaded():
    """Three ranks, rank 2 done loading 5 s after the others, a 2 s timeout: rank 0 lets the
    workers go once every rank has checked in. A worker let go as soon as rank 0 arrived would
    wait in the first call for rank 0, itself still waiting for rank 2, and time out (two ranks
    cannot show this: rank 0's arrival is then the last one)."""

    spawn = mp.get_context("spawn")
    out, port = spawn.Queue(), free_port()
    procs = [spawn.Process(target=_align_rank, args=(rank, 3, port, 0.0, load_lag, 2.0, out))
             for rank, load_lag in ((0, 0.0), (1, 0.0), (2, 5.0))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sorted(out.get(timeout=5) for _ in procs) == [(0, ("call", 0)), (1, ("call", 0)), (2, ("call", 0))]


def _rank_alone_in_a_call(rank: int, port: int, out) -> None:
    tp = TensorParallel(rank, 2, f"tcp://127.0.0.1:{port}", backend="gloo", timeout_s=1.0)
    tp.align()
    if rank == 1:   # a worker that never makes the call (stuck)
        time.sleep(20)
        return
    t0 = time.monotonic()
    try:
        tp.all_reduce(torch.ones(4))
        out.put(("returned", time.monotonic() - t0))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((type(exc).__name__, time.monotonic() - t0))


def test_a_collective_a_rank_never_joins_fails_at_the_tp_timeout():
    """`verifier.tp_timeout_s` bounds each collective once the ranks have met: rank 0 waiting for
    a worker that never calls fails after it (1 s here), not after gloo's default 30 minutes."""

    spawn = mp.get_context("spawn")
    out, port = spawn.Queue(), free_port()
    procs = [spawn.Process(target=_rank_alone_in_a_call, args=(rank, port, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        what, took = out.get(timeout=60)
        assert what != "returned" and took < 10, (what, took)
    finally:
        for p in procs:
            p.kill()
            p.join(10)


def _rank_0_beside(worker_code: str, port: int, out) -> None:
    worker = subprocess.Popen([sys.executable, "-c", worker_code])
    try:
        TensorParallel(0, 2, f"tcp://127.0.0.1:{port}", timeout_s=60.0, peers_gone=lambda: first_exit([worker])).align()
        out.put(("started",))
    except ServiceError as exc:
        out.put((exc.code, exc.message))


@pytest.mark.parametrize("stage, worker_code", [
    ("joined", "raise SystemExit(3)"),
    ("loaded", "from services.verifier.parallel import TensorParallel\n"
               "TensorParallel(1, 2, 'tcp://127.0.0.1:{port}', timeout_s=60.0)\n"
               "raise SystemExit(3)"),
], ids=["before_joining", "while_loading"])
def test_a_worker_that_dies_while_the_group_starts_ends_the_start_at_once(stage, worker_code):
    """Rank 0 waited for such a worker until its limit, a verifier that neither served nor exited:
    for the collectives' timeout at the rendezvous, for hours while loading. It now fails the start
    with the rank and its exit code as soon as the worker is gone."""

    spawn = mp.get_context("spawn")
    out, port = spawn.Queue(), free_port()
    rank_0 = spawn.Process(target=_rank_0_beside, args=(worker_code.format(port=port), port, out))
    t0 = time.monotonic()
    rank_0.start()
    rank_0.join(120)
    got = out.get(timeout=5)
    assert got == (grpc.StatusCode.UNAVAILABLE, f"verifier rank 1 exited with code 3 before the verifier group was {stage}")
    assert time.monotonic() - t0 < 60   # the start's own limits: 10 minutes to join, 6 hours to load


def test_a_call_that_fails_on_rank_0_with_ranks_ends_the_group() -> None:
    """A collective that timed out closes its connections for good, and a call only rank 0 failed
    leaves the workers a call ahead: the group is out of step. It stayed up and SERVING, failing
    every handshake and step; now the failure goes to `on_failure` (NOT_SERVING, then exit), naming
    the call. A refusal of the input (ServiceError) is every rank's alike and ends nothing."""

    class Ranks:
        enabled = True
        fail = True
        gone = None

        def broadcast(self, call):
            if self.fail:
                raise RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Application "
                                   "timeout caused pair closure")

        def peer_gone(self, wait_s=0.0):
            return self.gone

    def refuse(*args):
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "bad tree")

    reasons: list[str] = []
    engine = SimpleNamespace(model_device=torch.device("cpu"), verify=refuse, prefill=lambda items: "ok")
    ranks = Ranks()
    ranks.fail = False
    group = EngineGroup(engine, ranks, on_failure=reasons.append)
    with pytest.raises(ServiceError) as refused:   # refused input: every rank's alike, the group goes on
        group.call("verify", [])
    assert not isinstance(refused.value, GroupFailed) and group.call("prefill", []) == "ok" and reasons == []
    ranks.fail = True
    with pytest.raises(GroupFailed) as failed:   # what the stream ends with: UNAVAILABLE naming it (was INTERNAL)
        group.call("prefill", [])
    assert len(reasons) == 1 and "rank 0's prefill failed" in reasons[0] and "pair closure" in reasons[0]
    assert "/__w/" not in reasons[0]   # the library's source path, said to every client, is left out
    assert (failed.value.code, failed.value.message) == (grpc.StatusCode.UNAVAILABLE, reasons[0])
    # Out of step for good: no later call or heartbeat is broadcast (one could pair with the failed
    # call's collective on a worker), each fails at once.
    sent: list[object] = []
    ranks.fail = False
    ranks.broadcast = sent.append
    with pytest.raises(GroupFailed, match="rank 0's prefill failed"):
        group.call("prefill", [])
    group.heartbeat()
    assert sent == [] and len(reasons) == 1
    heartbeat_group = EngineGroup(engine, Ranks(), on_failure=reasons.append)
    with pytest.raises(RuntimeError):
        heartbeat_group.heartbeat()
    assert "rank 0's heartbeat failed" in reasons[1]
    # A rank that died broke the collective: said as its death, not as rank 0's failure (a rank
    # killed under load was reported as "rank 0's verify failed (... Connection reset by peer)").
    # Its exit is waited for a moment (the reset reaches rank 0 while the rank is torn down).
    killed, waits = Ranks(), []
    killed.peer_gone = lambda wait_s=0.0: waits.append(wait_s) or "verifier rank 1 exited with code -9"
    with pytest.raises(GroupFailed) as failed:
        EngineGroup(engine, killed, on_failure=reasons.append).call("prefill", [])
    assert failed.value.message == reasons[2] == ("verifier ranks out of step: verifier rank 1 exited with code -9 "
                                                  "(rank 0's prefill failed with it)")
    assert len(waits) == 1 and waits[0] >= 1.0
    silent = Ranks()   # a collective's error without a message is said as its type
    silent.broadcast = lambda call: (_ for _ in ()).throw(RuntimeError())
    with pytest.raises(GroupFailed, match=r"rank 0's prefill failed \(RuntimeError: \)$"):
        EngineGroup(engine, silent, on_failure=reasons.append).call("prefill", [])
    del reasons[3]
    group = EngineGroup(engine, SimpleNamespace(enabled=True, broadcast=lambda call: None))
    group.stop()   # the workers were told to stop: a call would broadcast to ranks that left
    with pytest.raises(ServiceError, match="the verifier group is stopping") as stopping:
        group.call("prefill", [])
    assert stopping.value.code == grpc.StatusCode.UNAVAILABLE
    group.heartbeat()   # nothing to keep awake
    group.stop()        # once
    alone = EngineGroup(engine, SimpleNamespace(enabled=False), on_failure=reasons.append)
    with pytest.raises(ZeroDivisionError):   # one rank: an engine error is the step's, not the group's
        engine.prefill = lambda items: 1 / 0
        alone.call("prefill", [])
    assert len(reasons) == 3


def test_a_worker_skips_heartbeats_stops_on_stop_and_survives_only_refusals():
    """A worker replays rank 0's calls: a heartbeat runs nothing, a refused input (ServiceError,
    every rank's alike) leaves it in its loop, the stop call ends it, and any other error ends it
    (rank 0 then sees the rank gone) rather than leaving the group silently out of step."""
    class Ranks:
        rank = 1

        def __init__(self, calls):
            self.calls = iter(calls)

        def broadcast(self, obj):
            return next(self.calls)

    done = []

    class Engine:
        def prefill(self, items):
            done.append(("prefill", items))

        def verify(self, items):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "bad tree")

        def broken(self):
            raise RuntimeError("a collective failed")

    worker_loop(Engine(), Ranks([(_NOOP, ()), ("prefill", ([1],)), ("verify", ([],)), (_NOOP, ()),
                                 ("prefill", ([2],)), (_STOP, ()), ("prefill", ([3],))]))
    assert done == [("prefill", [1]), ("prefill", [2])]
    with pytest.raises(RuntimeError, match="a collective failed"):
        worker_loop(Engine(), Ranks([("broken", ()), (_STOP, ())]))


def test_the_stop_call_goes_to_the_workers_once_and_nothing_follows_it():
    """After the stop broadcast the workers have left: a second stop or a heartbeat would be a
    collective no rank joins (a hang until tp_timeout_s)."""
    sent = []
    group = EngineGroup(SimpleNamespace(model_device=torch.device("cpu")),
                        SimpleNamespace(enabled=True, broadcast=sent.append))
    group.heartbeat()
    group.stop()
    group.stop()
    group.heartbeat()
    assert [call[0] for call in sent] == [_NOOP, _STOP]


@pytest.mark.parametrize("fault, ends", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
    (torch.AcceleratorError("CUDA error: device-side assert triggered") if hasattr(torch, "AcceleratorError")
     else RuntimeError("CUDA error: device-side assert triggered"), True),
    (RuntimeError("Triton Error [CUDA]: misaligned address"), True),
    (RuntimeError("Triton Error [CUDA]: unspecified launch failure"), True),
    (RuntimeError("CUDA error: an illegal instruction was encountered"), True),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), True),
    (RuntimeError("CUDA error: hardware stack error"), True),
    (RuntimeError("CUDA error: invalid program counter"), True),
    (RuntimeError("CUDA error: the launch timed out and was terminated"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("CUDA error: invalid configuration argument"), False),   # that launch's alone
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), False),
    (torch.AcceleratorError("CUDA error: out of memory") if hasattr(torch, "AcceleratorError")
     else RuntimeError("CUDA error: out of memory"), False),
    (ValueError("a bug of ours"), False)])
def test_a_verifier_alone_whose_gpu_failed_ends_like_a_group(fault, ends) -> None:
    """Without ranks a CUDA error that leaves the context unusable (an illegal address, a device
    assert) failed every later step INTERNAL while the verifier said SERVING, and no supervisor
    restarted it. It now goes to `on_failure` (NOT_SERVING, then exit) as a group's end does;
    running out of memory and other exceptions do not."""

    def failing(*args):
        raise fault

    reasons: list[str] = []
    engine = SimpleNamespace(model_device=torch.device("cpu"), verify=failing)
    group = EngineGroup(engine, SimpleNamespace(enabled=False), on_failure=reasons.append)
    with pytest.raises(GroupFailed if ends else type(fault)):
        group.call("verify", [])
    assert len(reasons) == int(ends)
    if ends:
        assert reasons[0].startswith("the verifier's GPU failed in verify")


def test_the_verifier_stops_its_start_and_its_other_workers_when_a_worker_exits(monkeypatch) -> None:
    """`serve` with ranks: a worker that exits before joining fails the start with its rank and
    code (UNAVAILABLE, which `ddtree serve` prints and exits 3 on), and the workers still running
    are stopped rather than left waiting for a group that will not form."""

    spawned: list[subprocess.Popen] = []

    def fake_spawn(settings, config_path, init_method):
        spawned.extend([subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]),
                        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])])
        return spawned

    monkeypatch.setattr(server, "spawn_workers", fake_spawn)
    t0 = time.monotonic()
    with pytest.raises(ServiceError) as info:
        asyncio.run(server.serve(VerifierSettings(tp=3, port=0)))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert info.value.message == "verifier rank 1 exited with code 3 before the verifier group was joined"
    assert time.monotonic() - t0 < 30
    assert [p.poll() for p in spawned] == [3, -signal.SIGTERM]


_DIES_WHILE_RANK_0_WARMS_UP = """
import asyncio, subprocess, sys, time
from services.common.settings import VerifierSettings
from services.verifier import server

spawned = []
def fake_spawn(settings, config_path, init_method):
    spawned.extend([subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1); raise SystemExit(7)"]),
                    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])])
    print("workers", *[p.pid for p in spawned], flush=True)
    return spawned

class Joined:   # the group formed: what is left is rank 0's load and warm-up
    enabled = True
    def __init__(self, *args, **kwargs): pass

server.spawn_workers = fake_spawn
server.master_store = lambda n: type("Store", (), {"port": 1})()
server.TensorParallel = Joined
server.build_engine = lambda settings, tp: time.sleep(120)   # a collective the dead rank never joins
asyncio.run(server.serve(VerifierSettings(tp=3, port=0)))
"""


def test_a_worker_that_dies_while_rank_0_warms_up_ends_the_start_at_once(tmp_path) -> None:
    """Rank 0 watched its workers only while the group formed and once it served: one that died in
    between (its KV cache did not fit, the warm-up ran out of memory) left rank 0 in a collective
    until NCCL's timeout (an abort and a crash dump) or, in the one-shot all-reduce, for good."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       str(Path(__file__).resolve().parents[1] / "protos")]))
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", _DIES_WHILE_RANK_0_WARMS_UP], env=env, capture_output=True,
                         text=True, timeout=90)
    took = time.monotonic() - t0
    assert run.returncode == 3, (run.returncode, run.stderr[-2000:])
    assert "verifier rank 1 exited with code 7 during the verifier's start-up" in run.stderr, run.stderr[-2000:]
    assert took < 30
    other = int(run.stdout.split()[2])
    with pytest.raises(ProcessLookupError):   # the worker still running was stopped, not left waiting
        os.kill(other, 0)


_DIES_WHILE_THE_GROUP_FORMS = """
import asyncio, datetime, subprocess, sys
from services.common.settings import VerifierSettings
from services.verifier import server

def fake_spawn(settings, config_path, init_method):   # rank 1 joins, then exits before the process group forms
    port = init_method.rsplit(":", 1)[1]
    code = ("import datetime, sys, torch.distributed as dist\\n"
            f"s = dist.TCPStore('127.0.0.1', {port}, 2, is_master=False, timeout=datetime.timedelta(seconds=60), "
            "wait_for_workers=False)\\n"
            "s.add('joined', 1); s.wait(['joined/go'], datetime.timedelta(seconds=60)); sys.exit(7)")
    return [subprocess.Popen([sys.executable, "-c", code])]

server.spawn_workers = fake_spawn
asyncio.run(server.serve(VerifierSettings(tp=2, port=0, tp_timeout_s=60.0)))
"""


def test_a_worker_that_exits_while_the_process_group_forms_ends_the_start_at_once() -> None:
    """Rank 0 watched its workers at the store's meetings and from the end of the group's forming:
    one that exited in between left rank 0 waiting tp_timeout_s, then failing with a bare store
    timeout that named no rank."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       str(Path(__file__).resolve().parents[1] / "protos")]))
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", _DIES_WHILE_THE_GROUP_FORMS], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 3, (run.returncode, run.stderr[-2000:])
    assert "verifier rank 1 exited with code 7 during the verifier's start-up" in run.stderr, run.stderr[-2000:]
    assert time.monotonic() - t0 < 30


def test_a_verifier_whose_port_fails_after_its_group_formed_stops_its_workers(ckpt, monkeypatch) -> None:
    """The bind, after minutes of loading, ran outside the start's clean-up: the workers sat in
    their loop until rank 0's process ended or their broadcast timed out."""

    spawned: list[subprocess.Popen] = []
    spawn = server.spawn_workers
    monkeypatch.setattr(server, "spawn_workers", lambda *a: spawned.extend(spawn(*a)) or spawned)

    def taken(*a):
        raise SettingsError("verifier.port: cannot listen (the port is in use)")
    monkeypatch.setattr(server, "listen", taken)
    with pytest.raises(SettingsError, match="cannot listen"):
        asyncio.run(server.serve(VerifierSettings(model_path=str(ckpt), tp=2, port=0, tp_timeout_s=60.0,
                                                  kv_capacity_tokens=512)))
    assert spawned and all(p.wait(timeout=10) is not None for p in spawned)


def test_an_orderly_stop_while_a_long_call_runs_is_no_dead_rank(ckpt) -> None:
    """SIGTERM while one engine call outlasts the shutdown's grace and the stop broadcast's wait:
    the workers get their SIGTERM mid-call, the call fails on rank 0, and that was reported as a
    dead rank (rank_died, exit 3). An orderly stop exits 0."""
    port = free_port()
    env = {**os.environ, "DDTREE_VERIFIER_MODEL_PATH": str(ckpt), "DDTREE_VERIFIER_TP": "2",
           "DDTREE_VERIFIER_PORT": str(port), "DDTREE_VERIFIER_PREFILL_CHUNK": "1", "DDTREE_VERIFIER_TP_TIMEOUT_S": "30",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                          str(Path(__file__).resolve().parents[1] / "protos")])}
    env.pop("DDTREE_INTERNAL_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "verifier"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    async def long_step() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await asyncio.wait_for(ch.channel_ready(), 120)
            stub = verifier_pb2_grpc.VerifierStub(ch)
            await stub.Handshake(verifier_pb2.HandshakeRequest(draft_id="d", feature_layer_ids=[0], hidden_size=64,
                                                               vocab_size=512, transports=["inline"]))
            call = stub.VerifyStream(metadata=(("draft-id", "d"),))
            # 40 prompts of 200 tokens, a token a forward: one engine call of 8000 forwards on 2 ranks
            await call.write(verifier_pb2.VerifyRequest(sequence=1, prefills=[
                verifier_pb2.PrefillItem(request_id=f"r{i}", token_ids=[1 + j % 60 for j in range(200)],
                                         reserve_tokens=201) for i in range(40)]))
            await asyncio.sleep(2)
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
                await asyncio.wait_for(call.read(), 5)

    try:
        asyncio.run(long_step())
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "rank_died" not in out, out[-3000:]


def test_a_worker_whose_checkpoint_is_refused_says_one_line_and_exits_2(monkeypatch) -> None:
    """Rank 0 refuses a split that tp does not divide in one line (exit 2); each worker, loading
    the same slices, printed a traceback of its own beside it, seven of them at tp 8."""
    from services.common.config_files import CheckpointError
    from services.verifier import server as verifier_server

    def refused(settings, tp):
        raise CheckpointError("model.safetensors: tensor lm_head.weight splits into 512 units along dim 0, "
                              "not divisible by tp=3")
    from structlog.testing import capture_logs

    monkeypatch.setattr(ranks_module, "_die_with_parent", lambda: None)
    # (the worker's own logging set-up would bind structlog to this test's captured stdout, closed
    # after it: every later test's log line failed "I/O operation on closed file")
    monkeypatch.setattr(ranks_module, "configure_logging", lambda *args, **kwargs: None)
    monkeypatch.setattr(ranks_module, "TensorParallel", lambda *args, **kwargs: SimpleNamespace())
    monkeypatch.setattr(verifier_server, "build_engine", refused)
    monkeypatch.setenv(SETTINGS_ENV, settings_json(VerifierSettings(tp=3, device="cpu")))
    with capture_logs() as logs:
        assert ranks_module.worker_main(["--rank", "1", "--init-method", "tcp://127.0.0.1:1"]) == 2
    assert [(e["event"], e["rank"]) for e in logs] == [("rank_start_refused", 1)]
    assert "not divisible by tp=3" in logs[0]["error"]


def test_workers_take_rank_0s_settings_not_their_own_reading() -> None:
    """Each worker read the config file and environment itself: a file changed while the group
    started gave the ranks other KV caches, out of step at the first long prompt."""

    s = VerifierSettings(tp=2, kv_capacity_tokens=12345, graph_batches=(1, 3), feature_layers=(2, 0),
                         warmup_budgets=(), device="cpu")
    assert settings_from_json(settings_json(s)) == s
    seen = {}

    class Popen:
        def __init__(self, cmd, **kwargs):
            seen["env"] = kwargs["env"]
    real = ranks_module.subprocess.Popen
    ranks_module.subprocess.Popen = Popen
    try:
        spawn_workers(s, None, "tcp://127.0.0.1:1")
    finally:
        ranks_module.subprocess.Popen = real
    assert settings_from_json(seen["env"][SETTINGS_ENV]) == s


def test_workers_start_in_their_own_session_naming_rank_0s_pid(monkeypatch) -> None:
    """A Ctrl-C to rank 0's process group must reach rank 0 alone (it stops its workers in order),
    and each worker compares ``--parent-pid`` with its own parent to exit when rank 0 is gone."""

    calls = []

    class Popen:
        def __init__(self, cmd, **kwargs):
            calls.append((cmd, kwargs))

    monkeypatch.setattr(ranks_module.subprocess, "Popen", Popen)
    spawn_workers(VerifierSettings(tp=3, device="cpu"), None, "tcp://127.0.0.1:1")
    assert [cmd[cmd.index("--rank") + 1] for cmd, _ in calls] == ["1", "2"]
    for cmd, kwargs in calls:
        assert kwargs.get("start_new_session") is True
        assert cmd[cmd.index("--parent-pid") + 1] == str(os.getpid())


def test_a_start_up_rank_0_settles_itself_is_left_to_it() -> None:
    """A worker that died of the error rank 0 is about to raise (its KV cache does not fit) must
    leave rank 0's error, which names the setting, not end the start as "rank N exited"."""

    settled = threading.Event()
    settled.set()
    t0 = time.monotonic()
    _end_start_up("verifier rank 1 exited with code 1", [], settled)   # returns: no exit
    assert time.monotonic() - t0 < 1


def _argmax_rank(rank: int, port: int, out) -> None:
    tp = TensorParallel(rank, 2, f"tcp://127.0.0.1:{port}", backend="gloo", timeout_s=30)
    tp.align()
    full = torch.tensor([[1.0, 5.0, 2.0, 5.0], [3.0, 0.0, 9.0, 1.0], [0.0, 1.0, 2.0, float("nan")],
                         [float("inf"), 0.0, 1.0, 2.0]])
    out.put((rank, tp.argmax(full[:, 2 * rank:2 * rank + 2]).tolist()))
    tp.close()


def test_sharded_argmax_takes_the_lowest_index_of_a_tie_and_marks_rows_not_finite():
    """Greedy tokens over two vocabulary slices: a tie across ranks goes to the lower index, as a
    full-row argmax; a row with a NaN or +inf on either slice is -1 on every rank (its request
    fails alone; the NaN's index was emitted as a token)."""

    spawn = mp.get_context("spawn")
    out, port = spawn.Queue(), free_port()
    procs = [spawn.Process(target=_argmax_rank, args=(rank, port, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sorted(out.get(timeout=5) for _ in procs) == [(0, [1, 2, -1, -1]), (1, [1, 2, -1, -1])]


# Every entry distinct: a slice out of place or repeated changes the gathered row.
_FULL_LOGITS = torch.randn(4, 6, generator=torch.Generator().manual_seed(11))


def _gather_rank(rank: int, size: int, port: int, out) -> None:
    tp = TensorParallel(rank, size, f"tcp://127.0.0.1:{port}", backend="gloo", timeout_s=30)
    tp.align()
    per = _FULL_LOGITS.shape[1] // size
    out.put((rank, tp.gather_logits(_FULL_LOGITS[:, rank * per:(rank + 1) * per]).tolist()))   # a strided view
    tp.close()


@pytest.mark.parametrize("size", [2, 3])
def test_gather_logits_puts_the_vocabulary_slices_back_in_rank_order(size: int) -> None:
    spawn = mp.get_context("spawn")
    out, port = spawn.Queue(), free_port()
    procs = [spawn.Process(target=_gather_rank, args=(rank, size, port, out)) for rank in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sorted(out.get(timeout=5) for _ in procs) == [(rank, _FULL_LOGITS.tolist()) for rank in range(size)]
    logits = torch.randn(3, 5)
    assert TensorParallel(0, 1).gather_logits(logits) is logits
