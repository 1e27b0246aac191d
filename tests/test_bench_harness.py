"""The benchmark harness runs end to end on a tiny matrix against a real stack, so it cannot rot."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.lossless_stack import check_tp, parse_budgets
from bench.matrix import ROW_KEYS, MatrixParams, check_fits, run_matrix, stack_spec
from services.common.launcher import Stack, StackSpec, free_port
from tests.selection import selected_names
from tests.stack_fixtures import build_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("bench"))


@pytest.fixture(scope="module", autouse=True)
def _side_runs(request, ckpt, tmp_path_factory) -> dict[str, tuple[subprocess.Popen, Path]]:
    """The benchmark commands that only run and write a file (``--spawn-stack`` end to end,
    split_overhead and the soak), started as soon as this module starts when their tests are
    selected, each in its own child: they then run while the tests before them use their own stacks
    (a stack mostly keeps one core busy at a time). Their tests wait for them and check the files."""
    selected = selected_names(request)
    runs: dict[str, tuple[subprocess.Popen, Path]] = {}
    for name, cmd in (("test_bench_spawn_stack_end_to_end", _spawn_stack_cmd), ("test_split_overhead_end_to_end", _split_cmd),
                      ("test_soak_end_to_end", _soak_cmd)):
        if name in selected:
            tmp = tmp_path_factory.mktemp(name)
            with open(tmp / "output.txt", "wb") as out:   # its tail goes in the failure's message
                runs[name] = (subprocess.Popen(cmd(tmp, ckpt), cwd=REPO, env=_env(), stdout=out,
                                               stderr=subprocess.STDOUT), tmp)
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _side_run(runs: dict[str, tuple[subprocess.Popen, Path]], name: str, make_cmd, tmp_path: Path, ckpt: Path,
              timeout: float = 240) -> Path:
    """The output folder of ``name``'s side run after it exited 0 (run here and now when the
    fixture did not start it, e.g. under a selection it did not see)."""
    if name not in runs:
        subprocess.run(make_cmd(tmp_path, ckpt), check=True, timeout=timeout, cwd=REPO, env=_env())
        return tmp_path
    proc, tmp = runs[name]
    if proc.wait(timeout=timeout) != 0:
        tail = (tmp / "output.txt").read_text(errors="replace")[-6000:]
        pytest.fail(f"{name}: the command exited with {proc.returncode}; its output ends:\n{tail}")
    return tmp


def _bench(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "bench", *args], check=check, timeout=timeout)


def test_bench_matrix_end_to_end(tmp_path, ckpt):
    metrics = free_port()
    spec = StackSpec(model_path=str(ckpt), scheduler_port=0, extra_env={"DDTREE_DRAFT_METRICS_PORT": str(metrics)})
    out = tmp_path / "matrix-tiny.json"
    cut = tmp_path / "matrix-cut.json"
    with Stack(spec) as stack:
        _bench("--address", stack.scheduler_address, "--contexts", "8", "20", "--concurrency", "1", "3",
               "--budgets", "4", "--max-tokens", "6", "--draft-metrics", stack.metrics_address("draft"), "--out", str(out))
        # A cell that outlives its timeout is cancelled and reported, and the run goes on.
        done = _bench("--address", stack.scheduler_address, "--contexts", "8", "--concurrency", "2", "--budgets", "4",
                      "--max-tokens", "200", "--warmup-tokens", "0", "--cell-timeout", "0.05", "--out", str(cut),
                      check=False)
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "matrix-tiny" and doc["gpu"] == "cpu" and doc["commit"]
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 2   # contexts x concurrency x (AR + one budget)
    for r in rows:
        for key in ROW_KEYS:
            assert key in r
        assert r["status"] == "ok" and r["agg_tok_s"] > 0 and r["mean_acceptance"] >= 1
        assert 0 < r["full_batch_s"] <= r["wall_s"] and r["full_batch_tok_s"] > 0
        assert r["step_split_ms"]["draft_ms"] is not None and r["step_split_ms"]["verify_ms"] > 0
    assert {r["mode"] for r in rows} == {"autoregressive", "ddtree"}
    assert out.with_suffix(".png").stat().st_size > 1000

    assert done.returncode == 1   # not every cell finished
    cut_rows = json.loads(cut.read_text())["rows"]
    assert [r["status"] for r in cut_rows] == ["timed_out", "timed_out"]
    assert all(r["tokens"] < 2 * 200 and set(ROW_KEYS) <= set(r) for r in cut_rows)


def _serving_ports(log: Path) -> list[int]:
    return [int(m) for m in re.findall(r"serving\s.*?address=127\.0\.0\.1:(\d+)", log.read_text())]


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _env() -> dict[str, str]:
    """As on a fresh GPU machine: the repo on PYTHONPATH, no installed package needed."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])}


def _spawn_stack_cmd(tmp: Path, ckpt: Path) -> list[str]:
    return [sys.executable, "-m", "services.cli", "bench", "--spawn-stack", str(ckpt), "--device", "cpu",
            "--dtype", "float32", "--contexts", "8", "--concurrency", "1", "2", "--budgets", "4",
            "--max-tokens", "8", "--commit", "0123abcd", "--cell-timeout", "60", "--time-budget", "120",
            "--stack-log", str(tmp / "stack.log"), "--out", str(tmp / "results" / "matrix-tiny.json")]


def test_bench_spawn_stack_end_to_end(tmp_path, ckpt, _side_runs):
    """The one command the GPU run uses: start a stack sized for the matrix, run it, write the
    result file and plot, stop the stack (the command runs from the module's start: ``_side_runs``)."""
    tmp = _side_run(_side_runs, "test_bench_spawn_stack_end_to_end", _spawn_stack_cmd, tmp_path, ckpt)
    out = tmp / "results" / "matrix-tiny.json"
    log = tmp / "stack.log"
    doc = json.loads(out.read_text())
    assert (doc["benchmark"], doc["commit"], doc["gpu"], doc["copy_gbps"]) == ("matrix-tiny", "0123abcd", "cpu", None)
    env = doc["params"]["stack"]["env"]
    assert int(env["DDTREE_VERIFIER_KV_CAPACITY_TOKENS"]) >= 2 * (8 + 8 + 16)
    assert env["DDTREE_SCHEDULER_MAX_BATCH"] == "2"
    rows = doc["rows"]
    assert [(r["concurrency"], r["mode"], r["budget"]) for r in rows] == [
        (1, "autoregressive", None), (1, "ddtree", 4), (2, "autoregressive", None), (2, "ddtree", 4)]
    for r in rows:
        assert set(ROW_KEYS) <= set(r) and r["status"] == "ok" and r["context"] == 8
        assert r["tokens"] == 8 * r["concurrency"] and r["agg_tok_s"] > 0 and r["mean_acceptance"] >= 1
        # The server's count of tree steps: none autoregressive; in DDTree some in the first cell, whose
        # first steps speculate on a fresh stack. A later cell may be paused throughout: the random
        # checkpoint accepts little, and a pause doubles (a CI run's C=2 cell had no tree step).
        if r["mode"] == "autoregressive":
            assert r["tree_step_share"] == 0 and r["tree_step_acceptance"] is None
        else:
            assert 0 <= r["tree_step_share"] <= 1
            assert (r["tree_step_acceptance"] is None) if r["tree_step_share"] == 0 else r["tree_step_acceptance"] >= 1
        # The scheduler's /metrics read while the cell ran: never more running than were sent.
        # (a sub-second cell on a loaded runner may end before the first reading returns: none is no error)
        assert (r["running_max"] or 0) <= r["concurrency"] and r["running_readings"] >= 0 and r["tpot_samples"] >= 1
        assert r["p50_tpot_ms"] > 0 and r["ttft_ms"] > 0 and r["step_split_ms"]["verify_ms"] > 0
        # The scheduler's side: its round trip holds the draft's step.
        assert r["scheduler_split_ms"]["step_rpc_ms"] >= r["step_split_ms"]["step_ms"] > 0
    assert rows[1]["tree_step_share"] > 0   # the first DDTree cell
    assert out.with_suffix(".png").stat().st_size > 1000
    ports = _serving_ports(log)
    assert len(ports) == 3 and all(_refused(p) for p in ports)   # the stack is gone


def test_bench_spawn_stack_stops_on_sigterm(tmp_path, ckpt):
    """`timeout` sends SIGTERM: the services (in sessions of their own) must not outlive the bench,
    and the rows finished so far stay on disk."""
    out = tmp_path / "matrix-long.json"
    log = tmp_path / "stack.log"
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "bench", "--spawn-stack", str(ckpt),
                             "--contexts", "8", "--concurrency", "1", "--budgets", "4", "5", "6", "7",
                             "--max-tokens", "100", "--warmup-tokens", "0", "--stack-log", str(log),
                             "--out", str(out)], cwd=REPO, env=_env())
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline:   # the first cell is written
            time.sleep(0.2)
        assert out.exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    ports = _serving_ports(log)
    assert len(ports) == 3
    # The bench stops them; where it died first instead (a CI run saw gRPC abort the bench in its
    # shutdown: "Check failed: !inspect->seen_inactive"), each stops itself once orphaned (~1 s poll).
    deadline = time.monotonic() + 30
    while not all(_refused(p) for p in ports) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(_refused(p) for p in ports)
    rows = json.loads(out.read_text())["rows"]
    assert rows and rows[0]["status"] == "ok"


def test_time_budget_skips_cells_and_reports_each(capsys):
    """Cells not started within the time budget are recorded, not dropped (no stack needed); a run
    whose warm-up took the whole budget, and a metrics address where nothing answers, say so (rows
    of skipped cells and empty splits came without a word)."""
    seen: list[int] = []
    p = MatrixParams(address="127.0.0.1:1", contexts=[8, 16], concurrencies=[1], budgets=[4], time_budget_s=1e-9,
                     draft_metrics=f"127.0.0.1:{free_port()}")
    rows = run_matrix(p, progress=False, on_row=lambda rs: seen.append(len(rs)))
    assert [r["status"] for r in rows] == ["skipped"] * 4 and seen == [1, 2, 3, 4]
    assert all(set(ROW_KEYS) <= set(r) and r["agg_tok_s"] is None for r in rows)
    err = capsys.readouterr().err
    assert f"no /metrics page answers at --draft-metrics {p.draft_metrics}: its splits stay empty" in err
    assert "--scheduler-metrics" not in err   # not given: nothing to say
    assert "the warm-up took the whole time budget (1e-09 s): every cell is skipped" in err


def test_the_spawned_stack_runs_the_draft_replicas_asked_for() -> None:
    """`ddtree bench --spawn-stack --draft-replicas N`: N drafts in front of one verifier, each with
    a batch of its own in flight (two batches in flight, measured against one)."""
    p = MatrixParams(contexts=[8], concurrencies=[1, 4], budgets=[4])
    assert stack_spec(p, "models/demo", "cpu", "float32")[0].draft_replicas == 1
    spec, draft_metrics, _ = stack_spec(p, "models/demo", "cpu", "float32", draft_replicas=2)
    assert spec.draft_replicas == 2 and spec.extra_env["DDTREE_SCHEDULER_MAX_BATCH"] == "4"
    assert draft_metrics == f"127.0.0.1:{spec.extra_env['DDTREE_DRAFT_METRICS_PORT']}"   # the first replica's


def test_a_cell_timeout_past_the_step_timeouts_bound_gives_the_stack_a_step_timeout_it_takes() -> None:
    """The spawned scheduler's step timeout follows `--cell-timeout`; 2e6 (or inf) was refused at
    start-up as DDTREE_SCHEDULER_STEP_TIMEOUT_S, a variable the user never set."""
    from services.common.settings import SchedulerSettings, load_settings

    for cell_timeout, step_timeout in ((2e6, "1000000.0"), (float("inf"), "1000000.0"), (10.0, "60.0"), (600.0, "600.0")):
        spec = stack_spec(MatrixParams(contexts=[8], concurrencies=[1], budgets=[4], cell_timeout_s=cell_timeout),
                          "models/demo", "cpu", "float32")[0]
        env = {k: v for k, v in spec.extra_env.items() if k.startswith("DDTREE_SCHEDULER_")}
        assert env["DDTREE_SCHEDULER_STEP_TIMEOUT_S"] == step_timeout
        assert load_settings(SchedulerSettings, env=env).step_timeout_s == float(step_timeout)


def test_lossless_stack_holds_each_budget_to_the_same_stacks_greedy_decoding(tmp_path, ckpt) -> None:
    """T-lossless's served check: a row a budget, greedy DDTree against the stack's own greedy AR."""
    assert parse_budgets("1-3,8,2") == [1, 2, 3, 8]
    prompts = [[3 + (7 * i + 11 * j) % 200 for j in range(12)] for i in range(2)]
    rows = check_tp(ckpt, 1, prompts, [1, 5], 8, "cpu", "float32", str(tmp_path / "stack.log"))
    assert [(r["tp"], r["budget"], r["prompts"], r["identical_to_autoregressive"]) for r in rows] == \
        [(1, 1, 2, 2), (1, 5, 2, 2)]
    assert all(r["mean_acceptance"] >= 1 for r in rows)


def _split_cmd(tmp: Path, ckpt: Path) -> list[str]:
    out = tmp / "split-overhead.json"  # a result file's name is its benchmark's
    return [sys.executable, "-m", "bench.split_overhead", "--model", str(ckpt), "--device", "cpu",
            "--prompts", "2", "--max-tokens", "24", "--reps", "2", "--commit", "0123abcd", "--out", str(out)]


def test_split_overhead_end_to_end(tmp_path, ckpt, _side_runs):
    """T-split's script: both sides warmed and timed alike, step_ms on both, outputs identical (the
    command runs from the module's start: ``_side_runs``)."""
    out = _side_run(_side_runs, "test_split_overhead_end_to_end", _split_cmd, tmp_path, ckpt) / "split-overhead.json"
    doc = json.loads(out.read_text())
    assert (doc["benchmark"], doc["commit"], doc["gpu"]) == ("split-overhead", "0123abcd", "cpu")
    rows = {r["deployment"]: r for r in doc["rows"]}
    assert set(rows) == {"in_process", "three_process"}
    for r in rows.values():
        assert r["concurrency"] == 1 and r["tok_s"] > 0 and r["step_ms"] > 0 and len(r["tok_s_passes"]) == 2
    st = rows["three_process"]
    assert st["identical_outputs"] == 2 and st["transport"] == "shm"
    # The same decoding on both sides: a random target accepts ~1 token a step, which would make
    # the stack's scheduler pause speculation within 24 tokens were it not off here.
    assert st["mean_acceptance"] == rows["in_process"]["mean_acceptance"]
    paired = statistics.median(a / b for a, b in zip(st["tok_s_passes"], rows["in_process"]["tok_s_passes"]))
    assert st["ratio"] == pytest.approx(paired, rel=1e-3) and rows["in_process"]["ratio"] == 1.0


def test_split_overhead_swaps_the_side_that_leads_and_reports_one_whole_pass() -> None:
    """The side that runs first swaps every pass (drift must not fall on one side); a row is the
    median pass by tok_s with every figure from it (a figure-by-figure median mixed passes into a
    row no pass had); the ratio pairs each pass with the other side's pass of the same round."""
    from bench.split_overhead import Run, median_pass, paired_ratio, passes

    calls: list[str] = []

    def side(name: str):
        def gen(prompt, max_tokens, budget):
            calls.append(name)
            return Run([1] * max_tokens, 1.0, 0.1, max_tokens - 1)
        return gen

    runs = passes({"a": side("a"), "b": side("b")}, [[1], [2]], 4, 3, reps=3, warmup_tokens=2)
    assert calls == ["a", "b"] + ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]
    assert len(runs["a"]) == len(runs["b"]) == 3

    def one(seconds: float, first: float, tokens: int, steps: int) -> list[Run]:
        return [Run([7] * tokens, seconds, first, steps)]

    # tok_s 10, 20, 30; the fastest pass has the slowest decode: a per-figure median would pair
    # the middle pass's tok_s with another pass's step_ms
    slow, mid, fast = one(1.0, 0.1, 10, 9), one(1.0, 0.5, 20, 5), one(1.0, 0.9, 30, 29)
    row = median_pass([fast, slow, mid])
    assert row["tok_s"] == 20 and row["step_ms"] == pytest.approx(100.0) and row["mean_acceptance"] == 19 / 5
    assert median_pass([fast, slow])["tok_s"] == 10          # even count: the lower middle
    base = [one(1.0, 0.1, 100, 9), one(1.0, 0.1, 50, 9), one(1.0, 0.1, 100, 9)]
    stack = [one(1.0, 0.1, 50, 9), one(1.0, 0.1, 40, 9), one(1.0, 0.1, 90, 9)]
    assert paired_ratio(stack, base) == pytest.approx(0.8)    # median of 0.5, 0.8, 0.9; unpaired: 50 / 100
    assert paired_ratio(base, base) == 1.0


def _soak_cmd(tmp: Path, ckpt: Path) -> list[str]:
    return [sys.executable, "-m", "bench.soak", "--model", str(ckpt), "--duration", "12", "--concurrency", "4",
            "--max-tokens", "24", "--long-context", "160", "--prefill-tokens", "64", "--seed", "3",
            "--max-stall-s", "60",   # two busy cores run this beside other stacks
            "--commit", "0123abcd", "--stack-log", str(tmp / "stack.log"), "--out", str(tmp / "soak-tiny.json")]


def test_soak_end_to_end(tmp_path, ckpt, _side_runs):
    """The soak on the CPU (float32): a random mix of requests, among them cancels, deadlines,
    aborts, invalid ones and long prompts in pieces, breaks no rule, gives back every KV page and
    ring slot, and each probe decodes the same alone and under load (the command exits 1 on a
    finding or a held gauge that moved; it runs from the module's start: ``_side_runs``)."""
    out = _side_run(_side_runs, "test_soak_end_to_end", _soak_cmd, tmp_path, ckpt) / "soak-tiny.json"
    doc = json.loads(out.read_text())
    assert (doc["benchmark"], doc["commit"], doc["gpu"]) == ("soak-tiny", "0123abcd", "cpu")
    kinds = [r for r in doc["rows"] if r["row"] == "kind"]
    assert sum(r["sent"] for r in kinds) >= 20 and not any(r["findings"] for r in kinds)
    assert sum(r["answered"] for r in kinds) > 0
    state = next(r for r in doc["rows"] if r["row"] == "state")
    assert state["held_differs"] == [] and state["held_before"]
    assert any(k.endswith("ddtree_kv_pages_free") for k in state["held_before"])
    reserved = [v for k, v in state["held_after"].items() if "ddtree_kv_tokens_reserved" in k]
    assert reserved == [0.0]   # idle: every ended request's KV given back
    counted, ran = state["requests_counted"]   # (a request past its deadline before the scheduler took it: unseen)
    assert ran - state["deadline_exceeded_at_the_client"] <= counted <= ran and counted > 0
    assert 0 < state["longest_time_without_an_answer_s"] < 60
    assert 0 <= state["longest_time_without_an_answer_from_s"] < 12 + 60
    assert state["greedy_ddtree_equals_autoregressive"] and state["seeded_ddtree_equals_autoregressive"]
    for probe in (r for r in doc["rows"] if r["row"] == "probe"):   # float32 on the CPU: the same every time
        assert probe["runs"]["alone"] == 2 and probe["runs"]["alone_after"] == 1, probe
        assert probe["equal_to_first"] == probe["runs"] and not probe["first_difference_at"], probe


def test_the_soaks_checks_flag_each_broken_rule() -> None:
    """Each rule the soak checks an ended request against, broken once (no stack needed)."""
    from bench.soak import Soak, SoakParams
    from services.scheduler.client import Completion, Usage

    soak = Soak(SoakParams(), stream=[1, 2, 3], vocab=100, context_limit=1000, default_budget=16,
                eos_ids=frozenset({0}))
    kw = dict(max_tokens=4, budget=2, mode="ddtree", ignore_eos=False, stop_token_ids=[7])

    def check(tokens: list[int], acceptance: list[int], finish: str, completion_tokens: int | None = None) -> list[str]:
        soak.findings.clear()
        usage = Usage(prompt_tokens=5, completion_tokens=len(tokens) if completion_tokens is None else completion_tokens,
                      steps=len(acceptance), mean_acceptance=1.0)
        soak._check_done("k", Completion(token_ids=tokens, acceptance_lengths=acceptance, finish_reason=finish,
                                         usage=usage), kw)
        return soak.findings.get("k", [])

    assert check([5, 6, 8, 9], [2, 1], "length") == []                  # a request that kept every rule
    assert check([5, 6, 7], [2], "stop") == []                           # ended on its stop token
    assert check([5, 6, 8, 9, 4], [2, 2], "length")                      # more than max_tokens
    assert check([5, 6, 8], [2], "aborted")                              # a finish reason it cannot have
    assert check([5, 7, 8, 9], [2, 1], "length")                         # a stop token inside the output
    assert check([5, 6, 0], [2], "length")                               # ended on EOS, not as 'stop'
    assert check([5, 6, 8, 9], [2], "length")                            # acceptance adds up to too few
    assert check([5, 6, 8, 9], [3, 0], "length")                         # an acceptance length of 0
    assert check([5, 6, 8, 9], [1, 1, 1], "length", completion_tokens=3)  # usage miscounts
    kw.update(budget=1)
    assert check([5, 6, 8, 9], [3], "length")                            # 3 accepted from a budget-1 tree


def test_the_soak_allows_only_deadline_passed_requests_uncounted() -> None:
    """gRPC drops a call whose deadline passed before the scheduler took it, unseen and so
    uncounted (a loaded 2-core CI runner): the soak allows as many missing as its clients saw
    DEADLINE_EXCEEDED, and no more, and never more counted than ran."""
    from bench.soak import Soak, SoakParams

    def found(counted: int, ran: int, expired: int) -> list[str]:
        s = Soak(SoakParams(), stream=[1, 2, 3], vocab=100, context_limit=1000, default_budget=16)
        s.expected_errors["deadline"] = expired
        s.check_counted(counted, ran)
        return s.findings.get("all", [])

    assert found(10, 10, 0) == [] and found(10, 10, 3) == [] and found(7, 10, 3) == []
    assert found(9, 10, 0) and found(6, 10, 3)   # more missing than passed their deadline
    assert "counted 11 ended requests; 10 ran" in found(11, 10, 3)[0]   # counted twice


def test_the_soak_flags_a_time_with_no_request_answered() -> None:
    """Every answer can be right and late: a kernel compiled on each budget's first request held
    every request of its replica for 23 s, and the soak reported 0 findings."""
    from bench.soak import Soak, SoakParams

    def soak(answers: list[float], max_stall_s: float = 5.0) -> tuple[tuple[float, float], list[str]]:
        s = Soak(SoakParams(max_stall_s=max_stall_s), stream=[1, 2, 3], vocab=100, context_limit=1000,
                 default_budget=16)
        s.answered_at = [100.0 + t for t in answers]
        return s.check_stalls(100.0), s.findings.get("all", [])

    assert soak([0.5, 1.0, 3.0, 4.0]) == ((2.0, 1.0), [])
    (gap, at), found = soak([0.5, 1.0, 24.0, 25.0])
    assert (gap, at) == (23.0, 1.0) and found and "23.0 s, from 1.0 s into the load" in found[0]
    assert soak([7.0, 8.0])[1]                           # nothing answered in the first 7 s
    assert soak([7.0, 8.0], max_stall_s=0)[1] == []      # 0: not checked
    assert soak([-3.0, 1.5, 2.0])[0] == (1.5, 0.0)       # answers before the load do not count
    assert soak([]) == ((0.0, 0.0), [])


def test_a_probe_that_fails_is_a_finding_not_the_end_of_the_soak(monkeypatch) -> None:
    """The workers caught a failed request, the probes did not: a replica that died under the load
    (what a soak looks for) ended it with a traceback and no result file."""
    import asyncio
    import types

    import grpc

    import bench.soak as soak
    from services.scheduler.client import ClientError, Completion, Usage

    class Client:
        calls = 0

        def __init__(self, *args, **kwargs) -> None:
            pass

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc) -> None:
            pass

        async def model_info(self):
            return types.SimpleNamespace(vocab_size=512, max_context=4096, block_size=16, default_budget=16,
                                         eos_token_ids=[0])

        async def generate(self, prompt, **kwargs):
            Client.calls += 1
            if Client.calls > 10:   # the two runs alone pass; under load a replica is gone
                raise ClientError(grpc.StatusCode.UNAVAILABLE, "draft replica 127.0.0.1:5 failed: Socket closed")
            n = kwargs["max_tokens"]
            return Completion(token_ids=[7] * n, acceptance_lengths=[1] * (n - 1), finish_reason="length",
                              usage=Usage(len(prompt), n, n - 1, 1.0))

    monkeypatch.setattr(soak, "AsyncClient", Client)
    monkeypatch.setattr(soak, "read_metrics", lambda address: {"ddtree_running_requests": 0.0})
    p = soak.SoakParams(duration_s=1.0, concurrency=0, probe_every_s=0.2, probe_tokens=4, long_context=32)
    result = asyncio.run(soak.run_soak("x", p, list(range(2, 300)), {"scheduler": "s"}, log=lambda m: None))
    errors = [e for row in result["probes"] for e in row["errors"]]
    assert errors and all("UNAVAILABLE: draft replica 127.0.0.1:5 failed" in e for e in errors), errors
    assert errors[0].startswith("under_load: ")


def test_the_commit_recorded_is_this_checkouts_from_any_directory(tmp_path, monkeypatch) -> None:
    """`git rev-parse` ran in the working directory: a run from another checkout recorded its HEAD."""
    from bench.common import git_commit
    here = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"],
                   cwd=tmp_path, check=True)
    monkeypatch.chdir(tmp_path)
    assert git_commit() == here and git_commit("abc") == "abc"


@pytest.mark.parametrize("script", ["tree_mla_bench", "tree_build_bench", "tree_build_buckets", "vocab_topk"])
@pytest.mark.parametrize("out", ["a_directory", "tree_mla.txt"])
def test_a_result_path_that_is_no_json_file_is_refused_before_the_run(script, out, tmp_path, monkeypatch,
                                                                     capsys) -> None:
    """These four once took a directory: given one now, a run of minutes would end writing to it."""
    import importlib
    (tmp_path / "a_directory.json").mkdir()
    target = tmp_path / ("a_directory.json" if out == "a_directory" else out)
    module = importlib.import_module(f"bench.{script}")
    monkeypatch.setattr(sys, "argv", [script, "--out", str(target)])
    monkeypatch.setattr(module.torch.cuda, "get_device_name", lambda *a: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code == 2
    assert "is not a .json file to write the result to" in capsys.readouterr().err


def test_a_result_files_name_is_its_benchmarks(tmp_path) -> None:
    from bench.common import result_file
    assert result_file(str(tmp_path / "tree_mla-h100-abc1234.json")).stem == "tree_mla-h100-abc1234"


def test_power_sampler_off_reads_nothing() -> None:
    from bench.matrix import PowerSampler
    with PowerSampler(enabled=False) as sampler:
        pass
    assert sampler.source == "off" and sampler.mean() == (None, None)


def test_power_is_sampled_on_the_gpus_named_not_every_gpu_of_the_host(monkeypatch) -> None:
    """On a host shared with other work, the power of every GPU NVML sees was summed into the run's:
    `--power-gpus`, else CUDA_VISIBLE_DEVICES, names the GPUs read (NVML by index or UUID;
    nvidia-smi with --id)."""
    import sys
    import types

    import bench.matrix as matrix

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1, GPU-abc")
    assert matrix.power_gpu_ids("") == ["1", "GPU-abc"] and matrix.power_gpu_ids("3") == ["3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert matrix.power_gpu_ids("") == [] and matrix._nvml_reader([]) is None   # no GPU: none sampled
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert matrix.power_gpu_ids("") is None

    watts = {"0": 100_000, "1": 200_000, "GPU-abc": 300_000}   # milliwatts, by GPU
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: str(i), nvmlDeviceGetHandleByUUID=lambda u: u,
        nvmlDeviceGetPowerUsage=lambda h: watts[h],
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=50))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert matrix._nvml_reader(["1", "GPU-abc"])() == (500.0, 50)
    assert matrix._nvml_reader(None)() == (300.0, 50)   # none named: every GPU (0 and 1)

    seen: list[list[str]] = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        return types.SimpleNamespace(stdout="150.0, 40\n")
    monkeypatch.setattr(matrix.shutil, "which", lambda exe: "/bin/nvidia-smi")
    monkeypatch.setattr(matrix.subprocess, "run", run)
    assert matrix._smi_reader(["0", "2"])() == (150.0, 40)
    assert seen[-1][-1] == "--id=0,2"
    matrix._smi_reader(None)
    assert not any(a.startswith("--id") for a in seen[-1]) and matrix._smi_reader([]) is None


def test_the_results_name_the_schedulers_tls_but_never_its_token(tmp_path) -> None:
    """`ddtree bench --token` reaches a secured stack; the committed JSON must not carry the token."""
    from bench.matrix import write_results

    params = MatrixParams(tls_ca="ca.pem", tls_server_name="api.example", token="s3cret")
    assert params.client_options() == {"tls_ca": "ca.pem", "token": "s3cret", "tls_server_name": "api.example"}
    out = tmp_path / "matrix-t.json"
    write_results([], params, out, commit="abc", plot=False)
    doc = json.loads(out.read_text())
    assert doc["params"]["tls_ca"] == "ca.pem" and "token" not in doc["params"] and "s3cret" not in out.read_text()
    assert "s3cret" not in repr(params)


def test_the_split_overhead_ab_alternates_the_commits_and_merges_their_rows(monkeypatch, tmp_path) -> None:
    """Old and new alternate (a change is judged against its parent in the same call), the one
    that goes first swapped every round (a drift within the call falls on both), each run's rows
    carry its commit and round, and the params say the order."""
    from bench import split_overhead_ab

    runs = []

    def fake_run(tree, code, args, out):
        runs.append((tree, code, args))
        row = {"deployment": "three_process", "step_ms": 3.0 + len(runs), "tok_s": 100.0 * len(runs), "ratio": 0.5}
        return {"gpu": "cpu", "copy_gbps": None, "params": {"prompts": 6}, "rows": [row]}

    monkeypatch.setattr(split_overhead_ab, "_run", fake_run)
    out = tmp_path / "split-overhead-ab-new.json"
    assert split_overhead_ab.main(["--old-dir", str(tmp_path), "--old-code", "old", "--new-code", "new",
                                   "--out", str(out), "--", "--prompts", "6"]) == 0
    doc = json.loads(out.read_text())
    assert [c for _, c, _ in runs] == doc["params"]["order"] == ["old", "new", "new", "old"]
    assert all(args == ["--prompts", "6"] for _, _, args in runs) and runs[0][0] == tmp_path.resolve()
    assert [(r["code"], r["round"], r["tok_s"]) for r in doc["rows"]] == [
        ("old", 1, 100.0), ("new", 1, 200.0), ("new", 2, 300.0), ("old", 2, 400.0)]
    assert doc["benchmark"] == out.stem and doc["commit"] == "new" and doc["params"]["prompts"] == 6


def test_a_cells_figures_count_tree_steps_apart_and_say_how_many_requests_they_rest_on() -> None:
    """Steps the scheduler ran without a tree (speculation paused) accept 1: the pooled mean lowered
    T-speedup's bar (0.8 x acceptance x AR); the tree steps' own mean is recorded beside it. The
    median of an even count is the mean of the middle two (it was the upper one: at C=2, the max)."""
    from bench.matrix import _cell_stats, _Trace

    a = _Trace(start=0.0, first=0.1, last=1.1, tokens=11, acceptance=[4, 1, 1, 5], steps=4, tree_steps=2, done=True)
    b = _Trace(start=0.0, first=0.1, last=2.1, tokens=11, acceptance=[3, 3, 4], steps=3, tree_steps=3, done=True)
    stats = _cell_stats([a, b], wall=2.1, timed_out=False)
    assert stats["mean_acceptance"] == 21 / 7 and stats["tree_step_share"] == 5 / 7
    assert stats["tree_step_acceptance"] == (4 + 5 + 3 + 3 + 4) / 5
    assert stats["tpot_samples"] == 2 and abs(stats["p50_tpot_ms"] - 150.0) < 1e-9 and abs(stats["p99_tpot_ms"] - 200.0) < 1e-9
    cut = _Trace(start=0.0, first=0.1, last=0.5, tokens=3, acceptance=[2])   # cancelled: no usage came
    assert _cell_stats([cut], wall=0.5, timed_out=True)["tree_step_acceptance"] is None


def test_the_full_batch_rate_counts_tokens_up_to_the_first_requests_end() -> None:
    """A burst that runs down: request a ends at 1 s, b streams on to 3 s. Up to 1 s both ran, a's
    10 tokens and b's 4 (its arrival at 1.5 s is past the window): 14 tokens in 1 s, where the
    cell's aggregate is 20 in 3 s. A request that delivered nothing leaves no such window."""
    from bench.matrix import _cell_stats, _Trace, full_batch

    a = _Trace(start=0.0, first=0.2, last=1.0, tokens=10, arrivals=[(0.2, 2), (0.6, 6), (1.0, 10)], done=True)
    b = _Trace(start=0.0, first=0.4, last=3.0, tokens=10, arrivals=[(0.4, 1), (0.9, 4), (1.5, 7), (3.0, 10)], done=True)
    stats = _cell_stats([a, b], wall=3.0, timed_out=False)
    assert stats["full_batch_tok_s"] == 14.0 and stats["full_batch_s"] == 1.0
    assert stats["agg_tok_s"] == 20 / 3
    assert full_batch([a]) == (10.0, 1.0)   # one request: its own rate
    assert full_batch([a, _Trace(start=0.0)]) == (None, None)
    assert full_batch([]) == (None, None)


def test_p99_tpot_is_the_nearest_rank_and_a_split_without_its_first_page_is_none(monkeypatch) -> None:
    """Of 100 (200) requests p99 is the 99th (198th) slowest, not the slowest (199th): the rank was
    int(0.99 n) + 1. A cell whose /metrics page did not answer before it read the stages as zeros
    and reported the stack's lifetime mean a step as the cell's."""
    from bench import matrix
    from bench.matrix import _cell_stats, _Trace, stage_split, stage_totals

    for n, rank in ((100, 99), (200, 198), (99, 99), (128, 127), (1, 1)):
        traces = [_Trace(start=0.0, first=0.0, last=float(i + 1), tokens=2, acceptance=[1], steps=1, done=True)
                  for i in range(n)]   # TPOT i + 1 s
        assert _cell_stats(traces, wall=float(n), timed_out=False)["p99_tpot_ms"] == 1e3 * rank, n
    pages = iter([{}, {'ddtree_step_ms_sum{stage="draft"}': 1010.0, 'ddtree_step_ms_count{stage="draft"}': 101.0}])
    monkeypatch.setattr(matrix, "read_metrics", lambda address: next(pages))
    before, after = stage_totals("127.0.0.1:1"), stage_totals("127.0.0.1:1")
    assert before is None and after == {"draft": (1010.0, 101.0)}
    assert stage_split(before, after) == {"draft_ms": None}
    assert stage_split({"draft": (1000.0, 100.0)}, after) == {"draft_ms": 10.0}
    assert stage_split({}, after) == {"draft_ms": 1010.0 / 101.0}   # a page that answered, before any step


def test_the_cli_names_paused_speculation_and_a_cell_run_in_waves() -> None:
    from services.cli import _paused, _waves

    row = {"mode": "ddtree", "concurrency": 128, "status": "ok", "tree_step_share": 0.76,
           "tree_step_acceptance": 2.13, "running_max": 64, "running_readings": 40}
    assert "trees 76% of steps, 2.13 accepted a tree step" in _paused(row)
    assert "trees 99% of steps" in _paused({**row, "tree_step_share": 0.9996})   # paused once: not "100%"
    assert "trees 29% of steps" in _paused({**row, "tree_step_share": 29 / 100})   # (floor read 28%)
    assert _paused({**row, "tree_step_share": 1.0}) == ""
    assert _waves(row) == " (at most 64 of 128 requests ran at once: the rest queued)"
    assert _waves({**row, "running_max": 128}) == _waves({**row, "running_max": None}) == ""
    assert _waves({**row, "running_readings": 2}) == ""   # a short cell's readings may miss its peak


def test_the_running_requests_read_during_a_cell_ignore_readings_before_the_first_admission(monkeypatch) -> None:
    """A cell's first reading comes before any request is admitted (0 running): a short cell whose
    peak fell between readings read "at most 0 of 16 ran at once"; such readings say nothing."""
    import asyncio

    import bench.matrix as matrix

    readings = iter([0.0, 3.0, 16.0, 5.0])
    monkeypatch.setattr(matrix, "read_metrics", lambda address: {"ddtree_running_requests": next(readings, 0.0)})
    seen: list[float] = []

    async def watch() -> None:
        task = asyncio.ensure_future(matrix._watch_running("x:1", seen, interval_s=0.001))
        while len(seen) < 4:
            await asyncio.sleep(0.001)
        task.cancel()
    asyncio.run(watch())
    assert matrix.running_max(seen) == 16
    assert matrix.running_max([0.0, 0.0]) is None and matrix.running_max([]) is None


def test_power_is_the_energy_counters_difference_over_the_cell_where_nvml_has_one(monkeypatch) -> None:
    """NVML's power reading averages the last second: a sub-second cell's samples were mostly the
    cell before it. The energy counter's difference over the cell is its mean power exactly."""
    import sys
    import types

    import bench.matrix as matrix

    joules = {"0": 0.0}
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: str(i), nvmlDeviceGetHandleByUUID=lambda u: u,
        nvmlDeviceGetPowerUsage=lambda h: 90_000,   # the last second's average: the cell before
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=30),
        nvmlDeviceGetTotalEnergyConsumption=lambda h: int(joules[h] * 1000))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with matrix.PowerSampler(True, ["0"]) as sampler:
        joules["0"] += 500.0   # before the cell (its set-up): not the cell's
        sampler.mark()
        joules["0"] += 140.0   # 140 J in 0.2 s: 700 W
        time.sleep(0.2)
        sampler.mark()
        joules["0"] += 500.0   # after it
    assert sampler.source == "nvml-energy" and 600.0 < sampler.mean()[0] <= 700.0

    def no_counter(h):
        raise RuntimeError("not supported")
    monkeypatch.setattr(nvml, "nvmlDeviceGetTotalEnergyConsumption", no_counter)
    with matrix.PowerSampler(True, ["0"]) as sampler:
        while not sampler.samples:
            time.sleep(0.01)
    assert sampler.source == "nvml" and sampler.mean() == (90.0, 30)


def test_utilisation_and_sampled_power_count_only_the_readings_between_the_marks(monkeypatch) -> None:
    """The sampler runs over the cell's set-up (prompts, channel) and after it, with the GPU idle:
    those readings lowered a cell's utilisation, and its power where there is no energy counter."""
    import sys
    import types

    import bench.matrix as matrix

    now = {"w": 60_000, "util": 0}
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: str(i), nvmlDeviceGetHandleByUUID=lambda u: u,
        nvmlDeviceGetPowerUsage=lambda h: now["w"],
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=now["util"]))

    def no_counter(h):
        raise RuntimeError("not supported")
    nvml.nvmlDeviceGetTotalEnergyConsumption = no_counter
    monkeypatch.setitem(sys.modules, "pynvml", nvml)

    def readings_past(n: int) -> None:
        deadline = time.monotonic() + 10
        while len(sampler.samples) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    with matrix.PowerSampler(True, ["0"]) as sampler:
        readings_past(2)                      # set-up: idle
        now.update(w=400_000, util=80)
        sampler.mark()
        readings_past(len(sampler.samples) + 2)
        sampler.mark()
        now.update(w=60_000, util=0)          # after the cell: idle again
        readings_past(len(sampler.samples) + 2)
    assert sampler.source == "nvml"
    assert {u for _, u in sampler.samples} == {0, 80}     # idle readings were taken around the cell
    assert sampler.mean() == (400.0, 80)


def test_synthetic_prompt_ids_past_the_vocabulary_are_refused_before_the_matrix_runs() -> None:
    """`--vocab-high` above the model's vocabulary ran a whole matrix of INVALID_ARGUMENT cells;
    a prompt file's ids are the file's, not drawn below it."""
    from ddtree.v1 import common_pb2

    info = common_pb2.ModelInfo(vocab_size=300, max_context=4096, block_size=16, kv_capacity_tokens=1 << 20,
                                kv_page_size=16)
    check_fits(info, MatrixParams(contexts=[8], concurrencies=[1], max_tokens=8, vocab_high=300))
    with pytest.raises(ValueError, match="--vocab-high 301: synthetic prompt ids would pass the model's vocabulary of 300"):
        check_fits(info, MatrixParams(contexts=[8], concurrencies=[1], max_tokens=8, vocab_high=301))
    check_fits(info, MatrixParams(contexts=[8], concurrencies=[1], max_tokens=8, vocab_high=301, prompt_file="p.json"))


def test_a_metrics_address_that_is_no_url_reads_as_no_page() -> None:
    """A typo in `--scheduler-metrics HOST:PORT` (a port "9l00") raised http.client's InvalidURL
    through the whole bench; an address where nothing answers reads as no page."""
    from bench.common import read_metrics

    assert read_metrics("127.0.0.1:9l00") == {} and read_metrics("") == {}
