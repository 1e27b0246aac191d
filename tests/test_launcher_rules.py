"""Rules of `ddtree up`'s launcher (and of the device pinning and graph capture it relies on) that
only a whole stack exercised, or nothing did: unit level, CPU only, children are fakes."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import types

import pytest
import torch

from services.common import cuda_graphs, launcher
from services.common.devices import current, pin_device
from services.common.launcher import (FEATURE_LAYERS_ENV, Stack, StackSpec, _Service, free_port, placed_by_up,
                                      wait_healthy)
from services.common.settings import DraftSettings, SchedulerSettings, SettingsError, load_settings
from tests.test_cli_up import _cert, _health_server, alive  # noqa: F401  (alive: a fixture)


def test_wait_healthy_caps_the_settle_at_half_the_timeout_and_hints_at_the_tls_name(tmp_path, alive) -> None:  # noqa: F811
    """A SERVING answer counts once the process has lived `settle_s`, capped at half the timeout:
    uncapped, a `--startup-timeout` under the settle could never succeed. Nothing answering over
    TLS before the timeout: the message says which name the certificate must hold (and
    DDTREE_HEALTH_TLS_NAME); a plaintext wait gets no such hint."""
    server, address = _health_server()
    try:
        wait_healthy(address, alive, "verifier", 3.0, settle_s=30.0)   # settles at 1.5 s, not 30
    finally:
        server.stop(0)
    cert, _ = _cert(tmp_path, "ddtree.test")
    address = f"127.0.0.1:{free_port()}"   # nothing listens
    with pytest.raises(RuntimeError) as info:
        wait_healthy(address, alive, "scheduler", 0.6, cert)
    assert "not healthy after 0.6 s (last answer: UNAVAILABLE" in str(info.value)
    assert "; over TLS its certificate must name 127.0.0.1 (DDTREE_HEALTH_TLS_NAME" in str(info.value)
    with pytest.raises(RuntimeError, match="its certificate must name other.test"):
        wait_healthy(address, alive, "scheduler", 0.6, cert, tls_name="other.test")
    with pytest.raises(RuntimeError) as info:
        wait_healthy(address, alive, "scheduler", 0.6)
    assert "over TLS" not in str(info.value)


def test_a_roles_stuck_processes_share_one_grace_the_drain_is_the_schedulers_and_hurry_signals_it_only(
        monkeypatch) -> None:
    """`stop` gives each role's stuck processes one grace together (eight hung draft replicas
    waited for in turn would hold the stop for 8 x 30 s), the scheduler's `stop_grace_s` drain on top of
    its own only (not the drafts' or the verifier's); a second Ctrl-C (`hurry`) signals the
    scheduler alone: the drafts and the verifier, cut first, would fail its requests."""
    clock = [0.0]
    monkeypatch.setattr(launcher, "time", types.SimpleNamespace(monotonic=lambda: clock[0], sleep=lambda s: None))
    waits: list[tuple[str, float]] = []

    class Stuck:
        def __init__(self, name: str) -> None:
            self.name, self.returncode, self.signals = name, None, []

        def poll(self):
            return self.returncode

        def send_signal(self, sig) -> None:
            self.signals.append(sig)

        def wait(self, timeout=None):
            if timeout is None:           # after the kill
                self.returncode = -9
                return self.returncode
            waits.append((self.name, round(timeout, 6)))
            clock[0] += timeout
            raise subprocess.TimeoutExpired("x", timeout)

        def kill(self) -> None:
            pass

    stack = Stack(StackSpec(model_path="models/demo"))
    for name, role in (("verifier", "verifier"), ("draft-0", "draft"), ("draft-1", "draft"), ("draft-2", "draft"),
                       ("scheduler", "scheduler")):
        stack.services.append(_Service(name, role, "", {}, proc=Stuck(name),
                                       settings=SchedulerSettings(stop_grace_s=60.0) if role == "scheduler" else None))
    stack.hurry()
    assert {s.name: s.proc.signals for s in stack.services} == {
        "verifier": [], "draft-0": [], "draft-1": [], "draft-2": [], "scheduler": [signal.SIGTERM]}
    procs = [s.proc for s in stack.services]
    stack.stop(grace_s=5.0)
    assert waits == [("scheduler", 65.0), ("draft-0", 5.0), ("draft-1", 0.1), ("draft-2", 0.1), ("verifier", 5.0)]
    assert all(p.returncode == -9 for p in procs) and stack.procs == []


def test_replica_ports_a_moved_metrics_port_skips_grpc_ports_and_the_scheduler_gets_every_replica(tmp_path) -> None:
    """Replicas after the first move off the file's metrics port to one no service uses, gRPC ports
    included (onto `--port` the stack refused to start, naming scheduler.port); a port given to one
    replica by name is kept, and the others move off it."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[draft]\nmetrics_port = 9102\n")

    def metrics(**kw) -> dict[str, int]:
        plan = Stack(StackSpec(model_path="models/demo", config_path=str(cfg), draft_replicas=2, **kw))._plan()
        return {s.name: load_settings(DraftSettings, str(cfg), env=s.env).metrics_port for s in plan if s.role == "draft"}

    assert metrics(scheduler_port=9103) == {"draft-0": 9102, "draft-1": 9104}
    assert metrics(scheduler_port=0, verifier_port=9103) == {"draft-0": 9102, "draft-1": 9104}
    assert metrics(scheduler_port=0, service_env={"draft-1": {"DDTREE_DRAFT_METRICS_PORT": "9102"}}) == {
        "draft-0": 9103, "draft-1": 9102}
    # A fixed first draft port: the replicas take the ports after it, and the scheduler is given every one.
    plan = Stack(StackSpec(model_path="models/demo", scheduler_port=0, draft_port=9200, draft_replicas=3))._plan()
    drafts = [s.address for s in plan if s.role == "draft"]
    assert drafts == ["127.0.0.1:9200", "127.0.0.1:9201", "127.0.0.1:9202"]
    assert plan[-1].env["DDTREE_SCHEDULER_DRAFT_ADDRESSES"] == ",".join(drafts)


def test_launch_appends_the_services_output_to_the_log_in_a_session_of_its_own(tmp_path, monkeypatch) -> None:
    """`log_path` is appended to (an earlier run's lines, and the services started before, stay),
    stderr goes there too, each child runs in a session of its own (a Ctrl-C reaches only the
    launcher, which stops the stack in order) and reads the config file it was given."""
    calls = []

    def popen(cmd, **kwargs):
        calls.append((cmd, kwargs))
        if kwargs.get("stdout") is not None:
            kwargs["stdout"].write(b"child\n")
            kwargs["stdout"].flush()
        return object()

    monkeypatch.setattr(launcher, "subprocess", types.SimpleNamespace(Popen=popen, STDOUT=subprocess.STDOUT))
    monkeypatch.setattr(launcher, "wait_healthy", lambda *a, **kw: None)
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    log = tmp_path / "stack.log"
    log.write_bytes(b"before\n")
    svc = _Service("draft", "draft", "127.0.0.1:1", {"X": "1"})
    Stack(StackSpec(model_path="models/demo", config_path=str(cfg), log_path=str(log)))._launch(svc)
    Stack(StackSpec(model_path="models/demo"))._launch(svc)
    assert log.read_bytes() == b"before\nchild\n"
    (logged, logged_kw), (plain, plain_kw) = calls
    assert logged[logged.index("serve"):] == ["serve", "draft", "--config", str(cfg)]
    assert plain[plain.index("serve"):] == ["serve", "draft"]
    assert logged_kw["stderr"] == subprocess.STDOUT and logged_kw["env"] == {"X": "1"}
    assert logged_kw["start_new_session"] is True and plain_kw["start_new_session"] is True
    assert "stdout" not in plain_kw or plain_kw["stdout"] is None


def test_start_takes_as_many_replicas_as_the_verifier_serves_keeps_the_listen_address_and_always_stops(tmp_path) -> None:
    """`--draft-replicas N` beside `verifier.max_peers = N` is allowed (only more are refused), and
    the scheduler's listen address (0.0.0.0 from the file) is kept apart from where it is reached."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[verifier]\nmax_peers = 2\n[scheduler]\nhost = "0.0.0.0"\n')
    stack = Stack(StackSpec(model_path="models/demo", config_path=str(cfg), scheduler_port=0, draft_replicas=2))
    launched = []
    stack._launch = lambda svc, should_stop=None: launched.append(svc.name)
    stack.start()
    assert launched == ["verifier", "draft-0", "draft-1", "scheduler"]
    port = stack.scheduler_address.rsplit(":", 1)[1]
    assert (stack.scheduler_address, stack.scheduler_listen_address) == (f"127.0.0.1:{port}", f"0.0.0.0:{port}")

    # Stopped however the start ends: a KeyboardInterrupt or a SystemExit (`bench` exits on SIGTERM)
    # during a draft's start-up ends the verifier started before it; leaving `with Stack` stops it.
    class Running:
        returncode = None

        def poll(self):
            return self.returncode

        def send_signal(self, sig) -> None:
            self.returncode = -sig

        def wait(self, timeout=None):
            return self.returncode

    def interrupted(svc, should_stop=None):
        svc.proc = Running()
        if svc.role == "draft":
            raise KeyboardInterrupt
    stack._launch = interrupted
    with pytest.raises(KeyboardInterrupt):
        stack.start()
    assert stack.procs == [] and [s.name for s in stack.services][:2] == ["verifier", "draft-0"]
    stops = []
    stack.start = lambda should_stop=None: stack
    stack.stop = lambda grace_s=None: stops.append(grace_s)
    with stack:
        assert stops == []
    assert stops == [None]


def test_what_up_reads_from_its_files_layers_past_the_target_and_settings_it_replaces(tmp_path) -> None:
    """A drafter config without `num_target_layers` is checked against the target's depth here:
    a layer id equal to the depth (one past the last layer) is no layer of it, so the verifier is
    given none (the draft names the mismatch itself; the verifier could only name a setting the
    user never wrote). `placed_by_up` names an empty variable `up` replaces (an empty
    DDTREE_SCHEDULER_TOKENIZER_PATH, token ids only, meant) like any value, and leaves a config
    file that is not UTF-8 to the settings check (one line, exit 2), not a traceback."""
    depth = json.loads(open("models/demo/config.json").read())["num_hidden_layers"]
    config = json.loads(open("models/demo/drafter/config.json").read())
    config.pop("num_target_layers", None)
    for name, ids, given in (("last", [0, depth - 1], f"0,{depth - 1}"), ("past", [0, depth], None)):
        (tmp_path / name).mkdir()
        config["dflash_config"]["target_layer_ids"] = ids
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        plan = Stack(StackSpec(model_path="models/demo", drafter_path=str(tmp_path / name), scheduler_port=0))._plan()
        assert plan[0].env.get(FEATURE_LAYERS_ENV) == given, name

    assert placed_by_up(None, {"DDTREE_SCHEDULER_TOKENIZER_PATH": ""}) == ["DDTREE_SCHEDULER_TOKENIZER_PATH"]
    binary = tmp_path / "c.toml"
    binary.write_bytes(b"[scheduler]\nport = 1\n# \xff\xfe\n")
    assert placed_by_up(str(binary), {}) == []


def test_pin_device_and_current_make_the_services_gpu_current(monkeypatch) -> None:
    """The point of pinning: Triton launches, bare "cuda" allocations and graph captures follow the
    current device, so `pin_device` must set it; "cuda" is the current GPU, not cuda:0; and with no
    GPU visible, "cuda" is refused by name before asking CUDA for a current device."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    pinned = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pinned.append(str(d)))
    assert pin_device("cuda:0") == torch.device("cuda", 0)
    assert pin_device("cuda") == torch.device("cuda", 1)
    assert pinned == ["cuda:0", "cuda:1"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)

    def no_gpu():
        raise RuntimeError("no CUDA GPUs are available")
    monkeypatch.setattr(torch.cuda, "current_device", no_gpu)
    with pytest.raises(SettingsError, match=r"^draft\.device: device cuda does not exist: this process sees 0 GPU"):
        pin_device("cuda", "draft.device")
    assert pinned == ["cuda:0", "cuda:1"]
    # Worker threads start on GPU 0 whatever was pinned: `current` makes the service's GPU theirs.
    block = current(torch.device("cuda", 1))
    assert isinstance(block, torch.cuda.device) and block.idx == 1
    assert isinstance(current(torch.device("cpu")), contextlib.nullcontext)


def test_capture_warms_up_on_one_kept_side_stream_per_device(monkeypatch) -> None:
    """The recipe every captured forward shares: a warm-up run on the device's side stream (ordered
    after the current stream and before it again), then the capture in thread_local mode into the
    given pool; the side stream is made once per device ("cuda" is the current GPU's), since the
    caching allocator reuses a block only on the stream that freed it."""
    events = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits {other.name}")

    made = []

    def new_stream(device):
        made.append(str(device))
        return Stream(f"side{len(made)}")

    @contextlib.contextmanager
    def on(stream):
        events.append(f"on {stream.name}")
        yield
        events.append(f"off {stream.name}")

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode="global"):
        events.append(f"capture pool={pool} mode={capture_error_mode}")
        yield
        events.append("captured")

    monkeypatch.setattr(cuda_graphs, "_SIDE", {})
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("main"))
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", graph)
    runs = iter(["warm", "captured out"])

    def fn():
        events.append("fn")
        return next(runs)
    assert cuda_graphs.capture(fn, torch.device("cuda"), pool="P") == ("graph", "captured out")
    assert events == ["side1 waits main", "on side1", "fn", "off side1", "main waits side1",
                      "capture pool=P mode=thread_local", "fn", "captured"]
    side = cuda_graphs._side_stream(torch.device("cuda", 0))
    assert side is cuda_graphs._side_stream("cuda") and side.name == "side1"
    assert cuda_graphs._side_stream("cuda:1") is not side and made == ["cuda:0", "cuda:1"]
