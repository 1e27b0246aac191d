"""What `ddtree up` gives each service before starting it, and the mistakes it refuses before
starting any."""

from __future__ import annotations

import dataclasses
import signal
import socket
import subprocess
import sys

import pytest

from services.common.launcher import Stack, StackSpec
from services.common.settings import DraftSettings, SchedulerSettings, SettingsError, VerifierSettings, load_settings


def test_the_compose_config_runs_under_up_with_replicas_on_loopback() -> None:
    """compose/ddtree.toml sets host 0.0.0.0 and draft metrics port 9102 for containers; under
    `ddtree up` the draft and verifier stay on loopback and each replica gets a metrics port of
    its own that no other service uses (two replicas used to fight over 9102, and the second died
    at start-up)."""
    stack = Stack(StackSpec(model_path="models/demo", config_path="compose/ddtree.toml", scheduler_port=0,
                            draft_replicas=3))
    plan = stack._plan()
    drafts = [load_settings(DraftSettings, "compose/ddtree.toml", env=s.env) for s in plan if s.role == "draft"]
    assert [d.metrics_port for d in drafts] == [9102, 9104, 9105]  # 9101 / 9103: scheduler / verifier
    assert {d.host for d in drafts} == {"127.0.0.1"}
    assert load_settings(VerifierSettings, "compose/ddtree.toml", env=plan[0].env).host == "127.0.0.1"
    assert len({d.port for d in drafts}) == 3


def test_a_bad_setting_fails_before_any_service_starts(tmp_path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[scheduler]\nmax_batch = 0\n")
    stack = Stack(StackSpec(model_path="models/demo", config_path=str(cfg), scheduler_port=0))
    with pytest.raises(SettingsError, match=r"scheduler\.max_batch"):
        stack.start()
    assert stack.procs == []  # nothing was started


def test_two_services_on_one_metrics_port_fail_before_any_starts(tmp_path) -> None:
    """Each port was checked alone: the scheduler, started last (minutes after a large model's
    weights), failed to bind the verifier's."""
    from services.common.launcher import free_port
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[verifier]\nmetrics_port = {port}\n[scheduler]\nmetrics_port = {port}\n")
    stack = Stack(StackSpec(model_path="models/demo", config_path=str(cfg), scheduler_port=0))
    with pytest.raises(SettingsError, match=rf"scheduler\.metrics_port: {port} is the verifier's metrics port too"):
        stack.start()
    assert all(svc.proc is None for svc in stack.services)


def test_a_services_port_on_anothers_metrics_port_fails_before_any_starts_and_picks_avoid_fixed_ports(
        tmp_path, monkeypatch) -> None:
    """Only metrics ports were checked against each other: `up --port 9102` beside a draft whose
    metrics took 9102 started everything but the scheduler; a port picked from the ephemeral range
    could be the scheduler's fixed 50051; and a stale DDTREE_SCHEDULER_PORT, which `up` replaces,
    refused the start."""
    from services.common import launcher
    cfg = tmp_path / "c.toml"
    cfg.write_text("[draft]\nmetrics_port = 9102\n")
    stack = Stack(StackSpec(model_path="models/demo", config_path=str(cfg), scheduler_port=9102))
    with pytest.raises(SettingsError, match=r"scheduler\.port: 9102 is the draft's metrics port too"):
        stack.start()
    assert all(svc.proc is None for svc in stack.services)
    picks = iter([50051, 9102, 50051, 41000, 50051, 41001])
    monkeypatch.setattr(launcher._PICK, "randint", lambda low, high: next(picks))
    monkeypatch.setenv("DDTREE_SCHEDULER_PORT", "70000")
    monkeypatch.setenv("DDTREE_DRAFT_VERIFIER_ADDRESS", "dns:verifier:50053")
    plan = Stack(StackSpec(model_path="models/demo", config_path=str(cfg), scheduler_port=50051))._plan()
    assert [svc.address for svc in plan] == ["127.0.0.1:41000", "127.0.0.1:41001", "127.0.0.1:50051"]
    # Devices given replica by replica beside a role-wide cuda_ipc: checked per replica, not refused as "cpu".
    replicas = StackSpec(model_path="models/demo", draft_replicas=2, extra_env={"DDTREE_DRAFT_TRANSPORT": "cuda_ipc"},
                         service_env={f"draft-{i}": {"DDTREE_DRAFT_DEVICE": f"cuda:{i}"} for i in range(2)})
    monkeypatch.setattr(launcher._PICK, "randint", lambda low, high: next(ports))
    ports = iter(range(42000, 42100))
    assert [svc.name for svc in Stack(replicas)._plan()] == ["verifier", "draft-0", "draft-1", "scheduler"]


@pytest.mark.parametrize("flags, needle", [(["--draft-replicas", "0"], "--draft-replicas 0"),
                                           (["--port", "-1"], "--port -1"), (["--tp", "-2"], "--tp -2")])
def test_up_refuses_bad_flags_at_once(flags, needle) -> None:
    out = subprocess.run([sys.executable, "-m", "services.cli", "up", *flags], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and needle in out.stderr, out.stderr


@pytest.mark.parametrize("command", [["up"], ["generate", "--prompt", "x"], ["serve", "scheduler"], ["bench"]])
def test_an_unknown_flag_shows_its_commands_usage(command, capsys) -> None:
    """argparse's top level reported a subcommand's unknown flag with the list of subcommands."""
    from services.cli import main

    with pytest.raises(SystemExit) as info:
        main([*command, "--frobnicate"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"usage: ddtree {command[0]}" in err
    assert f"ddtree {command[0]}: error: unrecognized arguments: --frobnicate" in err
    with pytest.raises(SystemExit):
        main(["--frobnicate", *command])                   # before the subcommand: the top level's
    assert "ddtree: error: unrecognized arguments: --frobnicate" in capsys.readouterr().err


def test_up_outside_the_repository_points_at_the_demo_model_not_at_random_weights(tmp_path, monkeypatch, capsys) -> None:
    from services.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["up"]) == 2
    err = capsys.readouterr().err
    assert f"no checkpoint at {tmp_path / 'models' / 'demo'}" in err
    assert "the bundled demo model is models/demo in the repository" in err and "--model PATH" in err
    assert "random weights for tests" in err


def test_up_names_the_settings_it_does_not_apply(tmp_path, monkeypatch, capsys) -> None:
    """A port or model path in the config file or the environment that `ddtree up` replaces was
    ignored without a word: the stack served elsewhere, or another model, than the user set."""
    from services.cli import main
    from services.common.launcher import PLACED_BY_UP, placed_by_up

    config = tmp_path / "ddtree.toml"
    config.write_text('[scheduler]\nhost = "0.0.0.0"\nport = 6001\nmax_batch = 8\n[verifier]\nmodel_path = "/nowhere"\n')
    env = {"DDTREE_DRAFT_DRAFTER_PATH": "/elsewhere", "DDTREE_SCHEDULER_MAX_QUEUE": "9"}
    assert placed_by_up(str(config), env) == [f"scheduler.host ({config})", f"scheduler.port ({config})",
                                              "DDTREE_DRAFT_DRAFTER_PATH", f"verifier.model_path ({config})"]
    plan = Stack(StackSpec(model_path="models/demo", config_path=str(config), scheduler_port=0,
                           scheduler_host="127.0.0.1"))._plan()   # as `up` passes its --host
    assert load_settings(SchedulerSettings, str(config), env=plan[-1].env).host == "127.0.0.1"
    assert placed_by_up(None, {}) == []
    # Set in both: both named (the file's was dropped without a word where the variable was set).
    assert placed_by_up(str(config), {"DDTREE_SCHEDULER_PORT": "7000"})[:3] == [
        f"scheduler.host ({config})", "DDTREE_SCHEDULER_PORT", f"scheduler.port ({config})"]
    for role, names in PLACED_BY_UP.items():   # each is a real setting of its service
        assert set(names) <= {f.name for f in dataclasses.fields(load_settings(
            {"scheduler": SchedulerSettings, "draft": DraftSettings, "verifier": VerifierSettings}[role], None, env={}))}
    monkeypatch.setenv("DDTREE_SCHEDULER_PORT", "6002")
    monkeypatch.setenv("DDTREE_AUTH_TOKEN", "from-the-shell")   # compose's name for the scheduler's token
    monkeypatch.setenv("DDTREE_PUBLISH_ADDR", "")               # unset, as compose reads an empty one
    monkeypatch.setattr("signal.signal", lambda *args: None)   # `up` takes SIGINT / SIGTERM: not pytest's

    def start(self, should_stop=None):
        raise SettingsError("stopped here: the warning comes before anything starts")
    monkeypatch.setattr("services.common.launcher.Stack.start", start)
    assert main(["up", "--config", str(config), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"not applied, since ddtree up takes the model from its flags and picks the ports and addresses: " \
           f"scheduler.host ({config}), DDTREE_SCHEDULER_PORT, scheduler.port ({config}), " \
           f"verifier.model_path ({config})" in err
    assert "not applied: DDTREE_AUTH_TOKEN is read by compose only (the scheduler's bearer token; for ddtree up, " \
           "set DDTREE_SCHEDULER_AUTH_TOKEN or scheduler.auth_token in --config)" in err
    assert "DDTREE_PUBLISH_ADDR" not in err


def test_a_model_without_a_tokenizer_serves_token_ids(tmp_path) -> None:
    """`ddtree up` points the scheduler at the model's tokenizer.json only where there is one (a
    missing tokenizer is a start-up error when configured by hand)."""
    (tmp_path / "config.json").write_text("{}")
    for model, want in ((str(tmp_path), ""), ("models/demo", "models/demo")):
        plan = Stack(StackSpec(model_path=model, scheduler_port=0))._plan()
        assert plan[-1].env["DDTREE_SCHEDULER_TOKENIZER_PATH"] == want


def test_up_says_why_a_model_serves_token_ids_only(tmp_path) -> None:
    """A checkpoint that ships a tokenizer the scheduler does not read (a SentencePiece
    `tokenizer.model`): `ddtree up` served it without a word, and the first text prompt was
    refused FAILED_PRECONDITION."""
    from services.cli import _no_tokenizer_note

    plain = _no_tokenizer_note(tmp_path)
    assert "no tokenizer.json" in plain and "--token-ids" in plain and "convert" not in plain
    (tmp_path / "tokenizer.model").write_text("x")
    other = _no_tokenizer_note(tmp_path)
    assert "tokenizer.model is not read here" in other and "tokenizer.json" in other


def test_ups_hint_names_the_command_as_this_shell_runs_it(monkeypatch, tmp_path) -> None:
    """`make up` runs `.venv/bin/ddtree`, which is not on PATH: the hint `ddtree generate ...` failed."""
    import shutil
    import sys

    from services.cli import _this_command

    exe = tmp_path / "bin" / "ddtree"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "argv", [str(exe), "up"])
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert _this_command() == str(exe)
    monkeypatch.setattr(shutil, "which", lambda name: str(exe))   # on PATH: the short name
    assert _this_command() == "ddtree"
    monkeypatch.setattr(sys, "argv", ["-m", "up"])   # `python -m services.cli up`
    assert _this_command() == "ddtree"


def test_the_scheduler_is_probed_where_it_listens() -> None:
    """compose/ddtree.toml puts the scheduler on 0.0.0.0: the launcher reached it (and reported it)
    on 127.0.0.1 whatever it listened on. `scheduler_host` (`ddtree up --host`) sets it."""
    def scheduler(**kw):
        return Stack(StackSpec(model_path="models/demo", config_path="compose/ddtree.toml", scheduler_port=50123,
                               **kw))._plan()[-1]

    for host, listen, reached in ((None, "0.0.0.0:50123", "127.0.0.1:50123"),          # the file's
                                  ("127.0.0.1", "127.0.0.1:50123", "127.0.0.1:50123"),  # `ddtree up`'s default
                                  ("localhost", "localhost:50123", "localhost:50123"),
                                  ("::1", "[::1]:50123", "[::1]:50123"), ("::", "[::]:50123", "127.0.0.1:50123")):
        svc = scheduler(scheduler_host=host)
        assert (svc.listen, svc.address) == (listen, reached), host
        assert load_settings(SchedulerSettings, "compose/ddtree.toml", env=svc.env).host == (host or "0.0.0.0")


def test_free_port_never_hands_out_a_port_twice() -> None:
    """A stack's ports are picked together and bound later; the OS may pick one twice meanwhile."""
    from services.common.launcher import free_port

    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_free_port_picks_no_port_the_kernel_hands_out_meanwhile(monkeypatch, capsys) -> None:
    """A picked port is bound by its service seconds later (a verifier once loaded); picked in the
    ephemeral range, an outgoing connection or a listener on port 0 (gloo's, a TP rendezvous)
    could take it first. The picks lie outside the range the kernel hands out."""
    from services.common import launcher
    from services.common.launcher import LOWEST_PICK, _ephemeral_range, _pick_range, free_port

    for kernel, picked in (((32768, 60999), (10000, 32767)), ((10000, 50000), (50001, 65535)),
                           ((1024, 65535), (1024, 65535))):   # the last: no room outside, said
        monkeypatch.setattr(launcher, "_ephemeral_range", lambda kernel=kernel: kernel)
        assert _pick_range.__wrapped__() == picked
    assert "leaves no ports outside it" in capsys.readouterr().err
    monkeypatch.undo()
    low, high = _ephemeral_range()
    first, last = _pick_range()
    if not (last < low or first > high):   # this machine's range leaves no room: nothing more to check here
        return
    picks = {free_port() for _ in range(200)}
    assert all(first <= p <= last and not low <= p <= high and p >= LOWEST_PICK for p in picks)
    with socket.socket() as server:   # the kernel's side: what it hands out is in its range
        server.bind(("127.0.0.1", 0))
        server.listen(256)
        clients = [socket.create_connection(server.getsockname()) for _ in range(100)]
        try:
            handed = {c.getsockname()[1] for c in clients} | {server.getsockname()[1]}
            assert all(low <= p <= high for p in handed) and not handed & picks
        finally:
            for c in clients:
                c.close()


def test_the_verifier_is_given_the_drafters_feature_layers(tmp_path) -> None:
    """The verifier captures its graphs with the layers the drafter started here reads, at start-up,
    rather than again at the first handshake. The environment's value stands (empty: the first
    handshake's), the config file's does not (like its model paths), and no value is guessed where
    the drafter's config cannot say, names layers the target lacks, or the replicas disagree."""
    import json
    demo = json.loads(open("models/demo/drafter/config.json").read())["dflash_config"]["target_layer_ids"]
    depth = json.loads(open("models/demo/config.json").read())["num_hidden_layers"]

    def layers(config: str | None = None, **kw) -> tuple[int, ...]:
        plan = Stack(StackSpec(model_path="models/demo", scheduler_port=0, config_path=config, **kw))._plan()
        return load_settings(VerifierSettings, config, env=plan[0].env).feature_layers

    assert layers() == tuple(demo) and demo
    assert layers(service_env={"verifier": {"DDTREE_VERIFIER_FEATURE_LAYERS": "0"}}) == (0,)
    assert layers(service_env={"verifier": {"DDTREE_VERIFIER_FEATURE_LAYERS": ""}}) == ()
    file = tmp_path / "c.toml"
    file.write_text("[verifier]\nfeature_layers = [0]\n")
    assert layers(str(file)) == tuple(demo)
    assert layers(drafter_path=str(tmp_path)) == ()                      # no config.json there
    config = json.loads(open("models/demo/drafter/config.json").read())
    for name, ids in (("other", [0]), ("deeper", [0, depth])):
        (tmp_path / name).mkdir()
        config["dflash_config"]["target_layer_ids"] = ids
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert layers(drafter_path=str(tmp_path / "other")) == (0,)
    assert layers(drafter_path=str(tmp_path / "deeper")) == ()          # the draft names the mismatch itself
    assert layers(draft_replicas=2, service_env={"draft-1": {"DDTREE_DRAFT_DRAFTER_PATH": str(tmp_path / "other")}}) == ()


def test_more_draft_replicas_than_the_verifier_serves_fail_before_any_starts(tmp_path) -> None:
    """The drafts past `verifier.max_peers` were refused at their handshake, after the verifier
    had loaded the model."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[verifier]\nmax_peers = 1\n")
    stack = Stack(StackSpec(model_path="models/demo", config_path=str(cfg), scheduler_port=0, draft_replicas=2))
    with pytest.raises(SettingsError, match=r"--draft-replicas 2: the verifier serves verifier.max_peers = 1 drafts at once"):
        stack.start()
    assert all(svc.proc is None for svc in stack.services)


def test_a_service_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    """A service stuck in a CUDA call or a drain must not outlive the stack's stop (its GPU and port
    held for the next start)."""
    import time

    from services.common.launcher import _end

    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
                                 "time.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    _end([stubborn], grace_s=0.5)
    assert stubborn.returncode == -signal.SIGKILL and time.monotonic() - t0 < 10


@pytest.mark.parametrize("supervised", ["returns", "raises"])
def test_up_stops_its_stack_however_supervision_ends_and_a_crash_loop_exits_1(monkeypatch, capsys,
                                                                               supervised) -> None:
    """Without the stop, a Ctrl-C left the services running (no drain) until they saw their
    launcher gone; a crash loop that ended supervision must not read as success."""
    from services.cli import main

    monkeypatch.setattr("signal.signal", lambda *args: None)
    stops = []

    def start(self, should_stop=None):
        self.scheduler_address = self.scheduler_listen_address = "127.0.0.1:50999"
        return self

    def supervise(self, *args, **kwargs):
        if supervised == "raises":
            raise RuntimeError("draft exited 4 times in 60 s")
    monkeypatch.setattr("services.common.launcher.Stack.start", start)
    monkeypatch.setattr("services.common.launcher.Stack.supervise", supervise)
    monkeypatch.setattr("services.common.launcher.Stack.stop", lambda self, *a, **kw: stops.append(1))
    monkeypatch.setattr("services.common.launcher.Stack.scheduler_settings", SchedulerSettings(tokenizer_path="models/demo"))
    code = main(["up", "--port", "0"])
    assert stops == [1]
    if supervised == "raises":
        assert code == 1 and "draft exited 4 times in 60 s; stopping" in capsys.readouterr().err
    else:
        assert code == 0


def test_the_scheduler_is_given_its_drain_beyond_the_stops_grace() -> None:
    """Its running requests get `scheduler.stop_grace_s`; a SIGKILL at the stop's own grace cut
    that drain short, with no request_end logged for them."""
    from services.common.launcher import _Service

    draining = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                 "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.8), sys.exit(0)))\n"
                                 "print('ready', flush=True)\ntime.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    assert draining.stdout.readline().strip() == "ready"
    stack = Stack(StackSpec(model_path="models/demo"))
    stack.services.append(_Service("scheduler", "scheduler", "", {}, proc=draining,
                                   settings=SchedulerSettings(stop_grace_s=2.0)))
    stack.stop(grace_s=0.2)
    assert draining.returncode == 0   # finished its 0.8 s drain: 0.2 + 2.0 s allowed, not 0.2


def test_the_stack_stops_one_role_after_another(tmp_path) -> None:
    """The scheduler's stop lets its running requests finish, which needs the draft and verifier
    behind it: signalled all at once, the draft ended those requests' step stream at once."""
    import time

    from services.common.launcher import _Service

    script = ("import signal, sys, time\n"
              "def stop(*_):\n"
              "    open(sys.argv[1], 'a').write(f'{sys.argv[2]} term\\n')\n"
              "    time.sleep(float(sys.argv[3]))\n"
              "    open(sys.argv[1], 'a').write(f'{sys.argv[2]} exit\\n')\n"
              "    sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    log = tmp_path / "order.txt"
    stack = Stack(StackSpec(model_path="models/demo"))
    for name, role, delay in (("verifier", "verifier", "0"), ("draft-0", "draft", "0.3"), ("draft-1", "draft", "0"),
                              ("scheduler", "scheduler", "0.5")):
        proc = subprocess.Popen([sys.executable, "-c", script, str(log), name, delay], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        stack.services.append(_Service(name, role, "", {}, proc=proc,
                                       settings=SchedulerSettings(stop_grace_s=1.0) if role == "scheduler" else None))
    procs = [svc.proc for svc in stack.services]
    t0 = time.monotonic()
    stack.stop(grace_s=20)
    assert time.monotonic() - t0 < 10 and all(p.returncode == 0 for p in procs)
    events = log.read_text().splitlines()
    assert events[:2] == ["scheduler term", "scheduler exit"]
    assert sorted(events[2:6]) == ["draft-0 exit", "draft-0 term", "draft-1 exit", "draft-1 term"]
    assert events.index("draft-1 term") < events.index("draft-0 exit")   # the replicas stop together
    assert events[6:] == ["verifier term", "verifier exit"]


@pytest.mark.parametrize("host, token, said", [("0.0.0.0", "", True), ("127.0.0.1", "", False),
                                               ("0.0.0.0", "s3cret", False)])
def test_up_says_when_its_scheduler_answers_beyond_loopback_without_a_token(monkeypatch, capsys, host, token,
                                                                            said) -> None:
    from services.cli import main

    monkeypatch.setattr("signal.signal", lambda *args: None)

    def start(self, should_stop=None):
        self.scheduler_address = self.scheduler_listen_address = f"{host}:50999"
        return self
    monkeypatch.setattr("services.common.launcher.Stack.start", start)
    monkeypatch.setattr("services.common.launcher.Stack.supervise", lambda self, *a, **kw: None)
    monkeypatch.setattr("services.common.launcher.Stack.stop", lambda self, *a, **kw: None)
    monkeypatch.setattr("services.common.launcher.Stack.scheduler_settings",
                        SchedulerSettings(host=host, auth_token=token, tokenizer_path="models/demo"))
    monkeypatch.delenv("DDTREE_SCHEDULER_AUTH_TOKEN", raising=False)
    assert main(["up", "--port", "0", "--host", host]) == 0
    err = capsys.readouterr().err
    assert ("answers anyone who reaches it: no scheduler.auth_token" in err) == said, err


def test_only_a_picked_port_lost_to_another_process_is_picked_again(monkeypatch) -> None:
    """A service that exits at its start is launched again on a new port only where the launcher
    picked its port and another process holds it now, and only `PORT_MOVES` times: a port the user
    gave, or a start refused for another reason (its port free), is the start's failure as before.
    A metrics port is moved where this process picked it (`free_port`), as tests and benchmarks do."""
    from services.common import launcher
    from services.common.launcher import PORT_MOVES, ServiceExited

    def grpc_port(svc) -> int:
        return int(svc.address.rsplit(":", 1)[1])

    def run(spec: StackSpec, takes: int, code: int = 2, port_of=grpc_port) -> tuple[list[int], Stack]:
        """The scheduler's port (``port_of`` it) taken before it listened, ``takes`` times."""
        stack = Stack(spec)
        stack.services = stack._plan()
        for svc in stack.services:
            svc.settings = load_settings(launcher._SETTINGS[svc.role], None, env=svc.env)
        seen: list[int] = []
        held: list[socket.socket] = []

        def launch(svc, should_stop=None):
            seen.append(port_of(svc))
            if svc.role == "scheduler" and len(seen) <= takes:
                s = socket.socket()
                s.bind(("127.0.0.1", port_of(svc)))
                held.append(s)
                raise ServiceExited("scheduler exited with code 2 during start-up", code)

        monkeypatch.setattr(stack, "_launch", launch)
        try:
            stack._launch_moving(stack.services[-1], None)
        finally:
            for s in held:
                s.close()
        return seen, stack

    seen, stack = run(StackSpec(model_path="models/demo", scheduler_port=0), takes=2)
    assert len(set(seen)) == 3 and stack.scheduler_address == f"127.0.0.1:{seen[-1]}"
    assert stack.services[-1].env["DDTREE_SCHEDULER_PORT"] == str(seen[-1])
    assert stack.services[-1].settings.port == seen[-1]
    with pytest.raises(ServiceExited):
        run(StackSpec(model_path="models/demo", scheduler_port=0), takes=PORT_MOVES + 1)
    with pytest.raises(ServiceExited):   # another exit code: not a port lost
        run(StackSpec(model_path="models/demo", scheduler_port=0), takes=1, code=1)
    given = launcher.free_port()
    with pytest.raises(ServiceExited):   # the user's port stays the user's
        run(StackSpec(model_path="models/demo", scheduler_port=given), takes=1)

    def metrics_spec(port: int) -> StackSpec:
        return StackSpec(model_path="models/demo", scheduler_port=0,
                         extra_env={"DDTREE_SCHEDULER_METRICS_PORT": str(port)})

    def metrics_port(svc) -> int:
        return svc.settings.metrics_port

    # a metrics port picked here, as a test or a benchmark passes one on: moved
    seen, stack = run(metrics_spec(launcher.free_port()), takes=1, port_of=metrics_port)
    assert len(seen) == 2 and seen[1] != seen[0] and stack.metrics_address("scheduler") == f"127.0.0.1:{seen[1]}"
    assert stack.services[-1].env["DDTREE_SCHEDULER_METRICS_PORT"] == str(seen[1])
    with socket.socket() as s:   # a port this process did not pick: the user's, kept
        s.bind(("127.0.0.1", 0))
        mine = s.getsockname()[1]
    with pytest.raises(ServiceExited):
        run(metrics_spec(mine), takes=1, port_of=metrics_port)

    def refused(svc, should_stop=None):   # exits 2, its port free: refused settings, not retried
        calls.append(svc.address)
        raise ServiceExited("scheduler exited with code 2 during start-up", 2)

    calls: list[str] = []
    stack = Stack(StackSpec(model_path="models/demo", scheduler_port=0))
    stack.services = stack._plan()
    monkeypatch.setattr(stack, "_launch", refused)
    with pytest.raises(ServiceExited):
        stack._launch_moving(stack.services[-1], None)
    assert len(calls) == 1
