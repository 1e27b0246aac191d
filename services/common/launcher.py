"""`ddtree up`: the three services as local processes, started in dependency order, stopped together.

Each child gets its settings as `DDTREE_<SERVICE>_*` environment variables layered over the shared
config file, so the launcher and docker compose configure the services the same way.
"""

from __future__ import annotations

import functools
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_FILE_ENV, internal_token, server_credentials
from services.common.grpc_server import PARENT_PID_ENV, check_port_free, host_port
from services.common.settings import DraftSettings, SchedulerSettings, SettingsError, VerifierSettings, load_settings

_SETTINGS = {"verifier": VerifierSettings, "draft": DraftSettings, "scheduler": SchedulerSettings}
STOP_GRACE_S = 30.0   # what each role has to stop after its SIGTERM (the scheduler: beyond its drain)
# What `ddtree up` sets itself, over the config file and the environment: the model (its flags) and
# every port and address (`--host`, `--port` the scheduler's).
PLACED_BY_UP = {"scheduler": ("host", "port", "draft_addresses", "tokenizer_path"),
                "draft": ("host", "port", "verifier_address", "target_path", "drafter_path"),
                "verifier": ("host", "port", "model_path")}


def placed_by_up(config_path: str | None, environ: dict[str, str]) -> list[str]:
    """The settings the config file or the environment gives that `ddtree up` replaces, each
    named with where it came from: set there and silently not applied, they misled (a port or a
    model path that seemed to be served)."""
    doc: dict = {}
    if config_path:
        try:
            with open(config_path, "rb") as fh:
                doc = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            doc = {}   # the settings check names the file's fault
    found = []
    for role, names in PLACED_BY_UP.items():
        table = doc.get(role, {}) if isinstance(doc.get(role), dict) else {}
        for name in names:
            var = f"DDTREE_{role.upper()}_{name.upper()}"
            if var in environ:
                found.append(var)
            if name in table:   # both, where both set it: each misleads on its own
                found.append(f"{role}.{name} ({config_path})")
    return found

# The tokenizer files a model directory may hold, as the scheduler reads them (`load_tokenizer`).
TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")

__all__ = ["StackSpec", "Stack", "StartupStopped", "free_port", "wait_healthy"]


class ServiceExited(RuntimeError):
    """A service ended during its start-up; ``code`` is its exit status (2: its settings or
    checkpoint were refused, which `ddtree up` passes on: fix them, do not retry)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class StartupStopped(Exception):
    """``should_stop()`` turned true while a service started: the caller stops the stack (a
    Ctrl-C during minutes of loading must not wait for every service to be healthy)."""


def _reach(host: str) -> str:
    """Where this host reaches a service listening on ``host``: loopback for a wildcard."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


_HANDED_OUT: set[int] = set()
_PICK = random.SystemRandom()


@functools.cache
def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


LOWEST_PICK = 10000   # below: where well-known servers (8080, 9090, 6379, ...) listen


@functools.cache
def _pick_range() -> tuple[int, int]:
    """Where `free_port` picks: below the ephemeral range (above it where that leaves too few
    ports), which the kernel never hands to a `connect` or a `bind` to port 0. A range that
    leaves no room either side (1024-65535 on some proxies) is picked in, said once."""
    low, high = _ephemeral_range()
    if low - LOWEST_PICK >= 4096:
        return LOWEST_PICK, low - 1
    if 65535 - high >= 4096:
        return high + 1, 65535
    print(f"ddtree: the ephemeral port range {low}-{high} (net.ipv4.ip_local_port_range) leaves no ports "
          "outside it: the stack's ports are picked inside it, where an outgoing connection may take one "
          "before its service binds it", file=sys.stderr)
    return low, high


def free_port(avoid: Collection[int] = ()) -> int:
    """A loopback port that is free now and not one this process handed out before (nor in
    ``avoid``: a stack's fixed ports, bound later). The ports of a stack are picked together and
    bound later, a verifier's once it has loaded, seconds on: asked for port 0, the OS gave one
    port twice in about 1 of 160 batches of 15, and nearly the same ports to processes asking at
    the same time (a draft's port went to a verifier's TP rendezvous); picked in the ephemeral
    range, one went meanwhile to an outgoing connection or to gloo's listeners (the draft then
    failed its start, "Address already in use"). So the pick is uniform over ports outside that
    range (`_pick_range`), then checked by a bind."""
    low, high = _pick_range()
    while True:
        port = _PICK.randint(low, high)
        if port in _HANDED_OUT or port in avoid:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


def _bound_elsewhere(port: int) -> bool:
    """Whether a loopback ``port`` is bound now, probed as the services probe theirs."""
    try:
        check_port_free("127.0.0.1", port, "port")
    except SettingsError:
        return True
    return False


PORT_MOVES = 3   # a picked port lost to another process is picked again this many times at most


@dataclass
class StackSpec:
    model_path: str = "models/demo"
    drafter_path: str | None = None          # default: <model_path>/drafter
    config_path: str | None = None
    scheduler_port: int = 50051               # 0 = any free port
    draft_port: int = 0                       # first draft replica's port; 0 = any free port
    verifier_port: int = 0
    draft_replicas: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)
    # Per-service additions over extra_env, keyed by role ("verifier", "draft", "scheduler") or by
    # service name ("draft-1"), the name's entry winning: one draft replica per GPU, or a
    # CUDA_VISIBLE_DEVICES for one service only.
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    startup_timeout_s: float = 120.0           # per service; a large model's verifier needs longer
    scheduler_host: str | None = None         # the scheduler's listen host; None: the config's (or its environment's)
    log_path: str | None = None               # the services' stdout and stderr go here (appended), not to ours


def _draft_name(i: int, replicas: int) -> str:
    """Replica ``i``'s service name: "draft" alone, "draft-0", "draft-1", ... beside others."""
    return f"draft-{i}" if replicas > 1 else "draft"


def _check_before_start(role: str, settings) -> None:
    """What a service would fail on only once it starts, checked before any starts: the scheduler
    starts last, after minutes of weight loading on a large model, and a TLS file it cannot use, a
    tokenizer file that does not parse or a metrics port in use then failed the whole start-up; the
    drafts start after the verifier (`_check_checkpoints`). ``SettingsError`` names the setting."""
    if role == "scheduler" and settings.tls_cert:
        server_credentials(settings.tls_cert, settings.tls_key)
    if role == "scheduler" and settings.tokenizer_path:   # a file that is no tokenizer, found before the loading
        from services.common.tokenizer_files import load_tokenizer
        load_tokenizer(settings.tokenizer_path)
    if role in ("verifier", "draft"):
        _check_checkpoints(role, settings)
    check_port_free(settings.host, settings.metrics_port, f"{role}.metrics_port")


def _check_checkpoints(role: str, settings) -> None:
    """The verifier's checkpoint, and the draft's pair (its drafter's tensors from their headers),
    each error naming its setting: the drafts start after the verifier, and a drafter that did not
    fit its target (configs, tensor names, shapes, dtypes) failed only once the verifier had loaded
    and warmed up (minutes on a large model)."""
    from services.common.checkpoint import CheckpointError, require_checkpoint
    from services.draft.dflash import check_drafter_checkpoint
    try:
        if role == "verifier":
            require_checkpoint(settings.model_path, "verifier.model_path")
        elif not settings.drafter_path.startswith("oracle:"):
            require_checkpoint(settings.drafter_path, "draft.drafter_path")
            require_checkpoint(settings.target_path, "draft.target_path")
            try:
                check_drafter_checkpoint(Path(settings.drafter_path), Path(settings.target_path))
            except CheckpointError as exc:
                raise CheckpointError(f"draft.drafter_path: {exc}") from None
    except CheckpointError as exc:
        raise SettingsError(str(exc)) from None


def _end(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to each still running, then SIGKILL to what is left after ``grace_s`` (together)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_healthy(address: str, proc: subprocess.Popen, name: str, timeout_s: float,
                 tls_roots: bytes | None = None, *, tls_name: str | None = None,
                 should_stop: Callable[[], bool] | None = None, settle_s: float = 1.0) -> None:
    """Polls grpc.health.v1 until SERVING; raises RuntimeError if the process exits or time runs
    out (naming the last answer), ``StartupStopped`` as soon as ``should_stop()`` is true.

    A SERVING answer counts only once ``proc`` has lived ``settle_s`` and is still alive after it:
    another process holding the port answers at once, while ours dies on the busy port within a
    second of its start (the launcher used to report such a stack as serving).
    `tls_roots`: PEM roots to trust when the service speaks TLS (the launcher passes the
    scheduler's own certificate, which verifies a self-signed one); `tls_name`: the name to check
    in its certificate instead of the address's host (DDTREE_HEALTH_TLS_NAME, as the compose probe).
    """
    start = time.monotonic()
    deadline = start + timeout_s
    settle_s = min(settle_s, timeout_s / 2)
    if tls_roots:
        options = [("grpc.ssl_target_name_override", tls_name)] if tls_name else []
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_roots), options=options)
    else:
        channel = grpc.insecure_channel(address)
    last = "none"
    serving_seen = False
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if should_stop is not None and should_stop():
                raise StartupStopped(f"{name}: start-up stopped")
            if proc.poll() is not None:
                other = (f"; yet something answered SERVING on {address}: another process holds the port"
                         if serving_seen else "")
                raise ServiceExited(f"{name} exited with code {proc.returncode} during start-up (see its output){other}",
                                    proc.returncode)
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=min(1.0, max(0.05, deadline - now)))
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    serving_seen = True
                    if time.monotonic() - start >= settle_s and proc.poll() is None:
                        return
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
                if tls_roots and "hostname verification" in (exc.details() or "").lower():
                    # The service is up and its certificate names another host: no retry fixes that
                    # (the whole start-up timeout went by, then exit 1, "may work later").
                    host = tls_name or address.rsplit(":", 1)[0]
                    raise SettingsError(f"{name} at {address}: its TLS certificate does not name {host} ({last}); "
                                        "DDTREE_HEALTH_TLS_NAME gives a name it holds to check instead") from None
            time.sleep(0.2)
    hint = ""
    if tls_roots and not serving_seen and last.startswith("UNAVAILABLE"):
        host = tls_name or address.rsplit(":", 1)[0]
        hint = (f"; over TLS its certificate must name {host} (DDTREE_HEALTH_TLS_NAME gives the name to check "
                "instead)")
    raise RuntimeError(f"{name} at {address} not healthy after {timeout_s:g} s (last answer: {last}){hint}")


@dataclass
class _Service:
    """One process of the stack: its name (`draft-1`), role, address and environment."""

    name: str
    role: str
    address: str                  # where the launcher reaches it
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    listen: str = ""              # host:port it listens on (the scheduler's: 0.0.0.0:50051 for all interfaces)
    settings: object = None       # what it reads from the config file and its environment (set by start)
    picked: bool = False          # its port was picked by `free_port` (not given): it may move to another


FEATURE_LAYERS_ENV = "DDTREE_VERIFIER_FEATURE_LAYERS"


def _drafter_layers(drafter_path: str, target_path: str) -> tuple[int, ...] | None:
    """The target layers a drafter checkpoint reads, or None where its config cannot say or names
    layers the target lacks (the draft service reports a bad checkpoint or a mismatch itself, with
    the file and field, where the verifier could only name a setting the user never wrote)."""
    from services.common.checkpoint import CheckpointError, read_config
    from services.draft.config import DraftConfig
    if not drafter_path:
        return None
    try:
        layers = DraftConfig.from_hf(read_config(Path(drafter_path))).target_layer_ids
        depth = read_config(Path(target_path)).get("num_hidden_layers")
    except (CheckpointError, OSError, ValueError):
        return None
    return layers if isinstance(depth, int) and max(layers) < depth else None


class Stack:
    """Starts verifier -> draft replicas -> scheduler; `stop()` ends them in reverse, SIGTERM then SIGKILL."""

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.services: list[_Service] = []
        self.scheduler_address = ""         # where this host reaches the scheduler
        self.scheduler_listen_address = ""  # where it listens (0.0.0.0:50051 for all interfaces)

    def _plan(self) -> list[_Service]:
        spec = self.spec
        base = dict(os.environ)
        base.update({
            "DDTREE_VERIFIER_MODEL_PATH": spec.model_path,
            "DDTREE_DRAFT_TARGET_PATH": spec.model_path,
            "DDTREE_DRAFT_DRAFTER_PATH": spec.drafter_path or str(Path(spec.model_path) / "drafter"),
            # the model's tokenizer.json or tiktoken.model (Kimi-K2); a model without either serves
            # token-id prompts only
            "DDTREE_SCHEDULER_TOKENIZER_PATH": spec.model_path if any(
                (Path(spec.model_path) / name).is_file() for name in TOKENIZER_FILES) else "",
            PARENT_PID_ENV: str(os.getpid()),   # the services stop if this process dies without stopping them
            # The launcher reaches the draft and verifier on loopback; a config file written for
            # containers (host = "0.0.0.0") must not open them to the network here.
            "DDTREE_VERIFIER_HOST": "127.0.0.1",
            "DDTREE_DRAFT_HOST": "127.0.0.1",
        })
        base.update(spec.extra_env)
        if not base.get(INTERNAL_TOKEN_ENV) and not base.get(INTERNAL_TOKEN_FILE_ENV):   # an empty one is none
            # One per launch: the draft and verifier ports, on loopback, still take calls from any
            # local user; with it they answer only this stack's services.
            base[INTERNAL_TOKEN_ENV] = secrets.token_urlsafe(32)
        if spec.scheduler_host is not None:
            base["DDTREE_SCHEDULER_HOST"] = spec.scheduler_host
        # Read with placeholders for the ports and addresses set below (a stale DDTREE_SCHEDULER_PORT
        # in the shell, which `up` replaces, refused the start).
        scheduler = load_settings(SchedulerSettings, spec.config_path, env={
            **self._env(base, "scheduler", "scheduler"), "DDTREE_SCHEDULER_PORT": "0",
            "DDTREE_SCHEDULER_DRAFT_ADDRESSES": "127.0.0.1:1"})
        verifier_metrics = load_settings(VerifierSettings, spec.config_path, env={
            **self._env(base, "verifier", "verifier"), "DDTREE_VERIFIER_PORT": "0"}).metrics_port
        try:   # the replicas' own settings (a device each) are checked where each is loaded, in `start`
            draft_metrics = load_settings(DraftSettings, spec.config_path, env={
                **self._env(base, "draft", "draft"), "DDTREE_DRAFT_PORT": "0",
                "DDTREE_DRAFT_VERIFIER_ADDRESS": "127.0.0.1:1"}).metrics_port
        except SettingsError:
            draft_metrics = 0
        # Metrics ports given to one replica by name: kept as given, and no other replica moves onto them.
        named_metrics = set()
        for i in range(spec.draft_replicas):
            own = spec.service_env.get(_draft_name(i, spec.draft_replicas), {})
            if own.get("DDTREE_DRAFT_METRICS_PORT", "").isdigit():
                named_metrics.add(int(own["DDTREE_DRAFT_METRICS_PORT"]))
        # The ports picked here avoid the fixed ones (a pick from the ephemeral range took 50051).
        fixed = {spec.scheduler_port, spec.verifier_port, scheduler.metrics_port, verifier_metrics, draft_metrics,
                 *named_metrics, *(spec.draft_port + i for i in range(spec.draft_replicas) if spec.draft_port)} - {0}
        vport = spec.verifier_port or free_port(fixed)
        verifier = f"127.0.0.1:{vport}"
        plan = [_Service("verifier", "verifier", verifier,
                         {**self._env(base, "verifier", "verifier"), "DDTREE_VERIFIER_PORT": str(vport)},
                         picked=not spec.verifier_port)]
        drafts, drafters = [], set()
        # A draft replica whose metrics port another service's metrics take (replicas after the
        # first share the file's port) moves to the next port no service of the stack uses: no
        # metrics port, nor gRPC port, picked or fixed (a move onto the scheduler's port had the
        # stack refuse to start, naming `scheduler.port`). One configured on a gRPC port stays,
        # to be refused by name.
        taken = {verifier_metrics, scheduler.metrics_port, *named_metrics} - {0}
        grpc_ports = {spec.scheduler_port, vport, *(spec.draft_port + i for i in range(spec.draft_replicas)
                                                    if spec.draft_port)} - {0}
        for i in range(spec.draft_replicas):
            dport = (spec.draft_port + i) if spec.draft_port else free_port(fixed | taken | grpc_ports)
            grpc_ports.add(dport)
            drafts.append(f"127.0.0.1:{dport}")
            name = _draft_name(i, spec.draft_replicas)
            env = {**self._env(base, "draft", name), "DDTREE_DRAFT_PORT": str(dport),
                   "DDTREE_DRAFT_VERIFIER_ADDRESS": verifier}
            draft = load_settings(DraftSettings, spec.config_path, env=env)
            drafters.add(draft.drafter_path)
            metrics = draft.metrics_port
            if metrics and "DDTREE_DRAFT_METRICS_PORT" not in spec.service_env.get(name, {}):
                if metrics in taken:
                    while metrics in taken or metrics in grpc_ports:
                        metrics += 1
                taken.add(metrics)
                env["DDTREE_DRAFT_METRICS_PORT"] = str(metrics)
            plan.append(_Service(name, "draft", drafts[-1], env, picked=not spec.draft_port))
        layers = {_drafter_layers(path, spec.model_path) for path in drafters}
        if len(layers) == 1 and None not in layers and FEATURE_LAYERS_ENV not in plan[0].env:
            # The verifier captures its graphs with the layers of the drafter started here, at
            # start-up, rather than again at the first handshake (every graph; long on a large
            # model). Like the model paths, this overrides the config file; the environment
            # (empty: the first handshake's) overrides it.
            plan[0].env[FEATURE_LAYERS_ENV] = ",".join(map(str, layers.pop()))
        sport = spec.scheduler_port or free_port(fixed | taken | grpc_ports)
        # Probed where it listens (the config file's host, e.g. 0.0.0.0 in compose/ddtree.toml,
        # is reached on loopback), not on 127.0.0.1 whatever it listens on.
        plan.append(_Service("scheduler", "scheduler", host_port(_reach(scheduler.host), sport),
                             {**self._env(base, "scheduler", "scheduler"), "DDTREE_SCHEDULER_PORT": str(sport),
                              "DDTREE_SCHEDULER_DRAFT_ADDRESSES": ",".join(drafts)},
                             listen=host_port(scheduler.host, sport), picked=not spec.scheduler_port))
        return plan

    def _env(self, base: dict[str, str], role: str, name: str) -> dict[str, str]:
        """`base` with the spec's entries for this role, then for this service's name, on top."""
        env = {**base, **self.spec.service_env.get(role, {})}
        if name != role:
            env.update(self.spec.service_env.get(name, {}))
        return env

    def start(self, should_stop: Callable[[], bool] | None = None) -> Stack:
        """Starts the services in order; raises ``SettingsError`` before starting any where one of
        them could not load its settings (file + environment), ``RuntimeError`` where one fails,
        ``StartupStopped`` once ``should_stop()`` is true (each after stopping what it started)."""
        self.services = self._plan()
        ports: dict[int, str] = {}
        for svc in self.services:
            svc.settings = load_settings(_SETTINGS[svc.role], self.spec.config_path, env=svc.env)
            internal_token(svc.env)   # a token file that cannot be read fails here, before anything starts
            _check_before_start(svc.role, svc.settings)
            # Each port was free alone; the second service to bind one failed, after the first loaded.
            for setting in ("port", "metrics_port"):
                port = getattr(svc.settings, setting)
                if port and port in ports:
                    raise SettingsError(f"{svc.role}.{setting}: {port} is the {ports[port]} too; "
                                        "each service needs ports of its own (metrics_port 0 = off)")
                ports[port] = f"{svc.name}'s" + (" metrics port" if setting == "metrics_port" else " port")
        drafts = [svc for svc in self.services if svc.role == "draft"]
        peers = next(svc.settings.max_peers for svc in self.services if svc.role == "verifier")
        if len(drafts) > peers:   # else the drafts past it were refused at their handshake, minutes in
            raise SettingsError(f"--draft-replicas {len(drafts)}: the verifier serves verifier.max_peers = {peers} "
                                "drafts at once")
        self.scheduler_address = self.services[-1].address
        self.scheduler_listen_address = self.services[-1].listen or self.scheduler_address
        try:
            for svc in self.services:
                if should_stop is not None and should_stop():
                    raise StartupStopped(f"stopped before {svc.name} started")
                self._launch_moving(svc, should_stop)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch_moving(self, svc: _Service, should_stop: Callable[[], bool] | None) -> None:
        """Launches ``svc``; where it exits at its start because another process bound a port
        picked for it meanwhile, moves it to a new port and launches it again (up to
        `PORT_MOVES` times). A picked port is only free when picked, and bound seconds later
        (after the services before it loaded): a test run's other stacks, picking in the same
        range, took the scheduler's between the two. Ports that were given are never moved; a
        metrics port is moved where this process picked it (`free_port`: a test or a benchmark
        that passes it on as a setting), and read back with `metrics_address`."""
        for moves in range(PORT_MOVES + 1):
            try:
                return self._launch(svc, should_stop)
            except ServiceExited as exc:
                lost = self._lost_port(svc) if exc.code == 2 and moves < PORT_MOVES else None
                if lost is None:
                    raise
                setting, port = lost
                new = free_port(self._ports())
                if setting == "port":
                    self._move(svc, new)
                else:
                    svc.env[f"DDTREE_{svc.role.upper()}_METRICS_PORT"] = str(new)
                    svc.settings = load_settings(_SETTINGS[svc.role], self.spec.config_path, env=svc.env)
                print(f"ddtree: {svc.name}'s {setting.replace('_', ' ')} {port} was taken by another process before "
                      f"it listened; starting it again on {new}", file=sys.stderr)

    @staticmethod
    def _lost_port(svc: _Service) -> tuple[str, int] | None:
        """The setting and port of ``svc`` that was picked for it and that another process holds now."""
        mine = [("port", int(svc.address.rsplit(":", 1)[1]))] if svc.picked else []
        metrics = getattr(svc.settings, "metrics_port", 0)
        if metrics and metrics in _HANDED_OUT:
            mine.append(("metrics_port", metrics))
        return next(((setting, port) for setting, port in mine if _bound_elsewhere(port)), None)

    def metrics_address(self, name: str) -> str | None:
        """Where the service ``name`` ("verifier", "draft-N", "scheduler"; "draft": the first
        replica) serves its /metrics page (on loopback where it listens on every interface), None
        where it serves none. Read after the start: a metrics port may have moved then
        (`_launch_moving`)."""
        svc = next((s for s in self.services if s.name == name), None) or \
            next((s for s in self.services if name == "draft" and s.role == "draft"), None)
        if svc is None:
            raise KeyError(f"no service {name!r} in this stack: {[s.name for s in self.services]}")
        port = getattr(svc.settings, "metrics_port", 0)
        return host_port(_reach(svc.settings.host), port) if port else None

    def _ports(self) -> set[int]:
        """Every gRPC and metrics port of the stack's plan (a moved service avoids them all)."""
        ports = {int(s.address.rsplit(":", 1)[1]) for s in self.services}
        return ports | {getattr(s.settings, "metrics_port", 0) for s in self.services} - {0}

    def _move(self, svc: _Service, port: int) -> None:
        """Moves a service that has not started to ``port``, with the addresses of it that the
        services after it (not started either) are given."""
        old = svc.address
        svc.address = f"{old.rsplit(':', 1)[0]}:{port}"
        if svc.listen:
            svc.listen = f"{svc.listen.rsplit(':', 1)[0]}:{port}"
        svc.env[f"DDTREE_{svc.role.upper()}_PORT"] = str(port)
        svc.settings = load_settings(_SETTINGS[svc.role], self.spec.config_path, env=svc.env)
        for other in self.services:
            for var in ("DDTREE_DRAFT_VERIFIER_ADDRESS", "DDTREE_SCHEDULER_DRAFT_ADDRESSES"):
                if var in other.env:
                    other.env[var] = ",".join(svc.address if a == old else a for a in other.env[var].split(","))
        if svc.role == "scheduler":
            self.scheduler_address = svc.address
            self.scheduler_listen_address = svc.listen or svc.address

    def _launch(self, svc: _Service, should_stop: Callable[[], bool] | None = None) -> None:
        cmd = [sys.executable, "-m", "services.cli", "serve", svc.role]
        if self.spec.config_path:
            cmd += ["--config", self.spec.config_path]
        if self.spec.log_path:
            with open(self.spec.log_path, "ab") as log:   # the child keeps its own copy of the descriptor
                svc.proc = subprocess.Popen(cmd, env=svc.env, start_new_session=True, stdout=log,
                                            stderr=subprocess.STDOUT)
        else:
            svc.proc = subprocess.Popen(cmd, env=svc.env, start_new_session=True)
        roots = tls_name = None
        if svc.role == "scheduler":  # a TLS-only scheduler (its cert from the config file or the environment)
            from services.healthcheck import scheduler_tls_cert
            cert = scheduler_tls_cert(self.spec.config_path, svc.env)
            roots = Path(cert).read_bytes() if cert and Path(cert).is_file() else None
            tls_name = svc.env.get("DDTREE_HEALTH_TLS_NAME") or None   # a certificate not naming 127.0.0.1
        wait_healthy(svc.address, svc.proc, svc.name, self.spec.startup_timeout_s, roots, tls_name=tls_name,
                     should_stop=should_stop)

    @property
    def scheduler_settings(self) -> SchedulerSettings:
        """The scheduler's settings as it reads them (TLS, token: what a client must bring)."""
        return self.services[-1].settings

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        return [(s.name, s.proc) for s in self.services if s.proc is not None]

    def process(self, name: str) -> subprocess.Popen:
        return dict(self.procs)[name]

    def address(self, name: str) -> str:
        return next(s.address for s in self.services if s.name == name)

    def restart(self, name: str, should_stop: Callable[[], bool] | None = None) -> None:
        """Starts a service again on the same address (after it died or was killed)."""
        svc = next(s for s in self.services if s.name == name)
        if svc.proc is not None and svc.proc.poll() is None:
            raise RuntimeError(f"{name} is still running")
        self._launch(svc, should_stop)

    def supervise(self, should_stop: Callable[[], bool], poll_s: float = 0.5, max_restarts: int = 3,
                  window_s: float = 60.0, report: Callable[..., None] = lambda event, msg, **fields: None) -> None:
        """Keeps the stack up until ``should_stop()``, as compose's ``restart: unless-stopped`` does:
        a service that exits is started again, unless it exited more than ``max_restarts`` times
        in ``window_s`` (a crash loop), which raises RuntimeError. A restart that dies (or hangs,
        and is then stopped) before it is healthy counts as one more exit, to be retried on the next
        round, not as the end; more than ``max_restarts`` of those in a row raise RuntimeError too,
        however slowly they fail (one that fails after a minute's loading never met the window). A
        ``should_stop()`` during a restart's wait raises ``StartupStopped``. ``report(event, message,
        target=name, code=exit code)`` is told of each restart (`service_restarting`) and each failed
        one (`service_restart_failed`, no code).

        A draft replica in such a loop while another replica runs is left down instead
        (`service_given_up`) and the stack serves on the others, which the scheduler routes to: one
        replica's fault (its GPU, say) stopped the healthy ones with it. The last replica's loop, or
        the scheduler's or the verifier's, still stops the stack."""
        exits: dict[str, list[float]] = {}
        failed: dict[str, int] = {}   # restarts in a row that never became healthy
        given_up: set[str] = set()
        while not should_stop():
            for svc in self.services:
                if svc.name in given_up or svc.proc is None or svc.proc.poll() is None:
                    continue
                now = time.monotonic()
                recent = [t for t in exits.get(svc.name, []) if now - t < window_s] + [now]
                exits[svc.name] = recent
                if len(recent) > max_restarts:
                    why = f"{svc.name} exited {len(recent)} times in {window_s:.0f} s (last code {svc.proc.returncode})"
                    if self._give_up(svc, given_up, why, report):
                        continue
                    raise RuntimeError(f"{why}; not restarting it again")
                report("service_restarting", f"{svc.name} exited with code {svc.proc.returncode}; restarting it",
                       target=svc.name, code=svc.proc.returncode)
                try:
                    self.restart(svc.name, should_stop)
                    failed[svc.name] = 0
                except RuntimeError as exc:   # died (or hung) during its start-up: the next round sees it
                    failed[svc.name] = failed.get(svc.name, 0) + 1
                    if svc.proc is not None and svc.proc.poll() is None:   # still starting past its time: ended
                        _end([svc.proc], grace_s=10.0)
                    if failed[svc.name] > max_restarts:
                        why = f"{svc.name} failed its start-up {failed[svc.name]} times in a row ({exc})"
                        if self._give_up(svc, given_up, why, report):
                            continue
                        raise RuntimeError(f"{why}; not restarting it again") from None
                    report("service_restart_failed", f"{svc.name} restart failed: {exc}", target=svc.name)
            time.sleep(poll_s)

    def _give_up(self, svc: _Service, given_up: set[str], why: str, report: Callable[..., None]) -> bool:
        """Whether ``svc`` is left down (a draft replica while another one's process runs); the
        caller skips it from then on, so this is said once."""
        others = [s for s in self.services if s.role == "draft" and s is not svc and s.name not in given_up
                  and s.proc is not None and s.proc.poll() is None]
        if svc.role != "draft" or not others:
            return False
        given_up.add(svc.name)
        report("service_given_up", f"{why}; leaving it down until the stack starts again (its other replicas "
                                   f"go on: {', '.join(s.name for s in others)})", target=svc.name)
        return True

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Ends the services in reverse order of their start, one role after another, each within
        ``grace_s`` (the scheduler's beyond the time it gives its running requests,
        `scheduler.stop_grace_s`): the scheduler's requests need the draft and verifier behind it
        until it has ended them (all signalled at once, the draft cut their step streams at once)."""
        drain = getattr(self.services[-1].settings, "stop_grace_s", 0.0) if self.services else 0.0
        for role in ("scheduler", "draft", "verifier"):
            procs = [s.proc for s in self.services if s.role == role and s.proc is not None]
            _end(procs, grace_s + (drain if role == "scheduler" else 0.0))
        for svc in self.services:
            svc.proc = None

    def hurry(self) -> None:
        """A second stop signal, passed on to the scheduler (a second Ctrl-C reaches only the
        launcher; the services run in sessions of their own): it ends its running requests now,
        with its stop's status, instead of waiting up to `stop_grace_s`. The drafts and the
        verifier, stopped after it, have no such wait (and, cut first, would fail its requests
        as a replica's failure)."""
        for svc in self.services:
            if svc.role == "scheduler" and svc.proc is not None and svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
