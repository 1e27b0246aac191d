"""One typed, frozen settings object per service, built from file + environment + flags.

The launcher, compose and each service read the same TOML file (one table per service), so a
value means the same thing wherever it is set. Precedence: the launcher's own values (ports,
addresses, model paths) > environment > file > defaults.
Environment variables are `DDTREE_<SERVICE>_<FIELD>` (e.g. `DDTREE_VERIFIER_PAGE_SIZE=32`).
The only other variables read are not settings: the launcher's (it passes these to the services),
the internal token's (`DDTREE_INTERNAL_TOKEN[_FILE]`, one value for all three services, in
`services.common.auth`), the health probe's (`DDTREE_HEALTH_*`) and the kernel overrides README.md
lists.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import struct
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "SettingsError",
    "cannot_listen",
    "SchedulerSettings",
    "DraftSettings",
    "VerifierSettings",
    "load_settings",
    "is_device",
    "MAX_BUDGET",
    "TEMPERATURE_RANGE",
    "temperature_ok",
]

MAX_BUDGET = 128  # the largest tree budget any service accepts (every one runs under graphs)
MAX_SPEC_BACKOFF_STEPS = 256  # the longest autoregressive pause of a batch whose drafts are not accepted
# A draft's tree ring, as large as a verifier maps it: the verifier reads a slot's bytes, and a
# ring declared larger than its memory costs a draft nothing to make (a sparse segment).
MAX_DRAFT_RING_SLOTS = 64
MAX_VERIFIER_RING_SLOTS = 64   # a slot a step in flight; each handshake builds the ring's free list
MAX_CPU_THREADS = 1024   # torch takes a C int; far more threads than cores only spin
MAX_SECONDS = 1e6   # a timeout setting's largest value (11.6 days): gRPC and timedelta hold it
MAX_DRAFT_RING_SLOT_BYTES = 64 << 20
# Sampling temperatures a request may ask for besides 0 (greedy). The logits are divided by it in
# float32: far below this floor a logit becomes inf and the softmax NaN (and inf or a value past
# float32's range overflows the other way), which failed every request of the verify step.
TEMPERATURE_RANGE = (1e-6, 1e4)


_TEMPERATURE_F32 = tuple(struct.unpack("f", struct.pack("f", x))[0] for x in TEMPERATURE_RANGE)  # the wire's float32 ends


def temperature_ok(t: float) -> bool:
    """0 (greedy), or within ``TEMPERATURE_RANGE`` with its ends as the wire's float32 holds them."""
    lo, hi = _TEMPERATURE_F32
    return t == 0 or lo <= t <= hi  # NaN fails both


class SettingsError(ValueError):
    """A setting is missing, of the wrong type or out of range; the message names it."""


def cannot_listen(exc: OSError | UnicodeError, host: str, port: int, setting: str) -> SettingsError:
    """A failed bind, said against the setting at fault: a host that does not resolve, is no name
    at all (an empty label: getaddrinfo's IDNA encoding raises UnicodeError) or is no address of
    this machine (`draft.host = nonexistent.invalid` was said as `draft.port`'s fault), else the
    port. ``setting`` is the port's (`draft.port` -> `draft.host`)."""
    why = f"not a host name ({exc})" if isinstance(exc, UnicodeError) else exc.strerror or str(exc)
    if isinstance(exc, (socket.gaierror, UnicodeError)) or exc.errno == errno.EADDRNOTAVAIL:
        where = setting.removesuffix("metrics_port").removesuffix("port") + "host" if "." in setting else setting
        return SettingsError(f"{where}: cannot listen on {host!r}: {why} (a name or address of this machine)")
    return SettingsError(f"{setting}: cannot listen on {host}:{port}: {why}")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise SettingsError(f"{name}: {message}")


# A socket file's path must fit sockaddr_un's 108 bytes; its folder gets this much of them (the
# file's own name, `ddtree-steps-<server id>.sock`, takes up to 40).
MAX_STEP_SOCKET_DIR_BYTES = 64


def _check_step_socket_dir(folder: str, name: str) -> None:
    # The name goes to the peer as written and resolves against the peer's working folder: a
    # relative one reached nothing from another folder, and the peer fell back to gRPC silently.
    _check(not folder or os.path.isabs(folder), name, f"{folder!r} must be an absolute path (the peers open it as given)")
    _check(len(os.fsencode(folder)) <= MAX_STEP_SOCKET_DIR_BYTES, name,
           f"{folder!r} is longer than {MAX_STEP_SOCKET_DIR_BYTES} bytes (a Unix socket's path holds 107)")


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_ADDRESS = re.compile(r"(dns:(//)?)?[^\s]+:(\d{1,5})")  # host:port, [v6]:port, dns:name:port


def _address_ok(address: str) -> bool:
    """host:port with a TCP port (gRPC dialled :99999 as :34463, the port modulo 65536)."""
    m = _ADDRESS.fullmatch(address)
    return m is not None and 0 < int(m.group(3)) < 65536


def is_device(text: str) -> bool:
    """`cpu`, `cuda` (the current GPU) or `cuda:N`; checked here so a typo fails at start-up with the
    setting's name, not deep inside torch after the weights are loaded."""
    return _DEVICE.fullmatch(text) is not None


@dataclass(frozen=True)
class SchedulerSettings:
    """The public API process: batching, admission, streaming, detokenizing."""

    host: str = "127.0.0.1"
    port: int = 50051
    draft_addresses: tuple[str, ...] = ("127.0.0.1:50052",)
    tokenizer_path: str = "models/demo"
    max_queue: int = 256            # waiting requests beyond this are rejected (RESOURCE_EXHAUSTED)
    max_batch: int = 64             # requests decoded together in one step
    max_prefill_tokens: int = 8192  # prompt tokens a step; a longer prompt goes in pieces over several steps
    default_budget: int = 16
    default_mode: str = "ddtree"
    spec_min_acceptance: float = 1.5   # a batch whose DDTree requests accept fewer tokens a step decodes AR for a while (0 = never)
    spec_backoff_steps: int = 16       # AR steps after the first such window (doubling per failed probe, up to 256)
    max_tokens_limit: int = 4096    # the largest max_tokens a request may ask for
    step_timeout_s: float = 60.0    # a draft replica slower than this for one step is marked down
    stop_grace_s: float = 5.0       # on SIGTERM / Ctrl-C, how long queued and running requests may go on
    draft_wait_s: float = 120.0     # at start-up, how long to wait for a first draft replica to answer
    metrics_port: int = 0           # Prometheus /metrics (0 = off)
    tls_cert: str = ""              # PEM certificate chain; with tls_key, the public port speaks TLS only
    tls_key: str = ""
    auth_token: str = ""            # when set, every call needs `authorization: Bearer <token>`
    max_request_bytes: int = 4 << 20
    json_logs: bool = False

    def __post_init__(self) -> None:
        _check(bool(self.tls_cert) == bool(self.tls_key), "scheduler.tls_cert",
               "tls_cert and tls_key must be set together")
        # A header value: clients (the SDK, gRPC) cannot send another, so every call would be refused
        _check(all(" " <= c <= "~" for c in self.auth_token) and self.auth_token == self.auth_token.strip(),
               "scheduler.auth_token", "must be printable ASCII, without leading or trailing spaces (it is sent in a header)")
        _check(self.max_request_bytes >= 1024, "scheduler.max_request_bytes", "must be >= 1024")
        _check(0 <= self.port < 65536, "scheduler.port", f"{self.port} is not a TCP port")
        _check(0 <= self.metrics_port < 65536, "scheduler.metrics_port", f"{self.metrics_port} is not a TCP port (0 = off)")
        _check(self.metrics_port != self.port or not self.port, "scheduler.metrics_port",
               f"{self.metrics_port} is scheduler.port too")
        _check(len(self.draft_addresses) > 0, "scheduler.draft_addresses", "needs at least one address")
        for entry in self.draft_addresses:
            _check(_address_ok(entry), "scheduler.draft_addresses",
                   f"{entry!r} is not host:port or dns:host:port (port 1..65535)")
        _check(self.max_queue > 0, "scheduler.max_queue", "must be > 0")
        _check(self.max_batch > 0, "scheduler.max_batch", "must be > 0")
        _check(self.max_prefill_tokens > 0, "scheduler.max_prefill_tokens", "must be > 0")
        _check(1 <= self.default_budget <= MAX_BUDGET, "scheduler.default_budget", f"must be in 1..{MAX_BUDGET}")
        _check(self.default_mode in ("ddtree", "autoregressive"), "scheduler.default_mode",
               "must be 'ddtree' or 'autoregressive'")
        _check(self.max_tokens_limit > 0, "scheduler.max_tokens_limit", "must be > 0")
        _check(self.draft_wait_s > 0, "scheduler.draft_wait_s", "must be > 0 seconds")
        _check(self.spec_min_acceptance >= 0, "scheduler.spec_min_acceptance", "must be >= 0 (0 = never fall back)")
        _check(1 <= self.spec_backoff_steps <= MAX_SPEC_BACKOFF_STEPS, "scheduler.spec_backoff_steps",
               f"must be in 1..{MAX_SPEC_BACKOFF_STEPS} (the longest pause)")
        _check(self.step_timeout_s > 0, "scheduler.step_timeout_s", "must be > 0")
        _check(0 <= self.stop_grace_s <= 3600, "scheduler.stop_grace_s", "must be in 0..3600 seconds")


@dataclass(frozen=True)
class DraftSettings:
    """The drafter + tree builder process; `drafter_path` may be `oracle:<file.json>` for tests."""

    host: str = "127.0.0.1"
    port: int = 50052
    verifier_address: str = "127.0.0.1:50053"
    verifier_wait_s: float = 120.0   # how long a starting draft waits for its verifier (one restarting, or started by hand)
    verifier_step_timeout_s: float = 60.0   # a verifier that answers no step within this is taken for gone
    target_path: str = "models/demo"
    drafter_path: str = "models/demo/drafter"
    transport: str = "auto"          # auto | cuda_ipc | shm | inline (auto: the first both sides can map, in that order)
    ring_slots: int = 4
    ring_slot_bytes: int = 1 << 20
    device: str = "cpu"
    dtype: str = "float32"
    cpu_threads: int = 1             # torch intra-op threads (CPU); the services share the cores
    warmup_budgets: tuple[int, ...] = (8, 16, 32)   # tree builds run (and graphs captured) at start-up (GPU)
    step_socket: bool = True         # schedulers of this host's network namespace send their steps on a Unix socket
    step_socket_dir: str = ""        # "": an abstract socket name; a folder: a socket file there (containers sharing it)
    cuda_graphs: bool = True         # GPU: propose from CUDA graphs over a context pool
    graph_rows: int = 128            # contexts the pool holds (at least the scheduler's max batch)
    graph_context: int = 2048        # tokens per pool row; longer contexts propose eagerly
    metrics_port: int = 0
    json_logs: bool = False

    def __post_init__(self) -> None:
        _check(1 <= self.cpu_threads <= MAX_CPU_THREADS, "draft.cpu_threads", f"must be in 1..{MAX_CPU_THREADS}")
        _check(self.verifier_wait_s > 0, "draft.verifier_wait_s", "must be > 0")
        _check(self.verifier_step_timeout_s > 0, "draft.verifier_step_timeout_s", "must be > 0")
        _check(self.graph_rows >= 1, "draft.graph_rows", "must be >= 1")
        _check(self.graph_context >= 64, "draft.graph_context", "must be >= 64")
        _check_step_socket_dir(self.step_socket_dir, "draft.step_socket_dir")
        _check(all(1 <= b <= MAX_BUDGET for b in self.warmup_budgets),
               "draft.warmup_budgets", f"must be budgets in 1..{MAX_BUDGET}")
        _check(0 <= self.port < 65536, "draft.port", f"{self.port} is not a TCP port")
        _check(_address_ok(self.verifier_address) and not self.verifier_address.startswith("dns:"),
               "draft.verifier_address", f"{self.verifier_address!r} is not host:port (port 1..65535)")
        _check(0 <= self.metrics_port < 65536, "draft.metrics_port", f"{self.metrics_port} is not a TCP port (0 = off)")
        _check(self.metrics_port != self.port or not self.port, "draft.metrics_port", f"{self.metrics_port} is draft.port too")
        _check(self.transport in ("auto", "cuda_ipc", "shm", "inline"), "draft.transport",
               "must be auto, cuda_ipc, shm or inline")
        _check(self.transport != "cuda_ipc" or self.device.startswith("cuda"), "draft.transport",
               f"cuda_ipc puts the rings on the draft's GPU; draft.device is {self.device!r} (use auto or shm)")
        _check(2 <= self.ring_slots <= MAX_DRAFT_RING_SLOTS, "draft.ring_slots", f"must be in [2, {MAX_DRAFT_RING_SLOTS}]")
        _check(4096 <= self.ring_slot_bytes <= MAX_DRAFT_RING_SLOT_BYTES, "draft.ring_slot_bytes",
               f"must be in [4096, {MAX_DRAFT_RING_SLOT_BYTES}] (a step's trees: 0.4 MB at 128 requests of budget 128)")
        _check(self.dtype in ("float32", "bfloat16", "float16"), "draft.dtype", "must be float32, bfloat16 or float16")
        _check(is_device(self.device), "draft.device", f"{self.device!r} is not cpu, cuda or cuda:N")


@dataclass(frozen=True)
class VerifierSettings:
    """The target model process (rank 0 serves gRPC)."""

    host: str = "127.0.0.1"
    port: int = 50053
    model_path: str = "models/demo"
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    kv_capacity_tokens: int = 65536  # KV cache size; admission reserves from it
    max_context: int = 0             # 0 = the model's max_position_embeddings
    prefill_chunk: int = 512         # prompt tokens per eager prefill forward; caps a replayed chunk too
    prefill_graphs: bool = True      # GPU: prompts replay the verify graphs (chunks of up to the largest graph_nodes)
    ring_slots: int = 4
    ring_slot_bytes: int = 8 << 20
    tp: int = 1                      # tensor-parallel ranks (processes); device "cuda" puts rank i on GPU i
    tp_timeout_s: float = 60.0       # a step's collective waiting longer than this fails the group
    peer_stream_timeout_s: float = 30.0   # a draft that hand-shook but opened no stream by then is dropped
    step_socket: bool = True         # drafts of this host's network namespace send their steps on a Unix socket, not gRPC
    step_socket_dir: str = ""        # "": an abstract socket name; a folder: a socket file there (containers sharing it)
    max_peers: int = 32              # drafts served at once (each holds a ring here and one of its own mapped)
    cuda_graphs: bool = True         # verify replays CUDA graphs on GPU (every bucket captured by the warm-up)
    graph_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)   # batch buckets; larger steps replay the largest in turn
    graph_nodes: tuple[int, ...] = (1, 2, 3, 5, 9, 13, 17, 25, 33, 49, 65, 97, 129)   # tree-size buckets (budget + 1);
                                     # a tree pads to the next, larger trees run eagerly
    warmup_budgets: tuple[int, ...] = (0, 8, 16, 32)   # GPU: verify steps of the warm-up (0 = autoregressive), after every bucket's capture; () = no warm-up
    feature_layers: tuple[int, ...] = ()   # target layers the drafters read (dflash target_layer_ids): the graphs are
                                           # captured with them, other layers refused; () = the first handshake's, recaptured then
    cpu_threads: int = 1             # torch intra-op threads per rank (CPU); spinning threads of several
                                     # processes on the same cores cost 5-10x on a small machine
    metrics_port: int = 0
    json_logs: bool = False

    def __post_init__(self) -> None:
        _check(1 <= self.tp <= 8, "verifier.tp", "must be in 1..8")
        _check(1 <= self.cpu_threads <= MAX_CPU_THREADS, "verifier.cpu_threads", f"must be in 1..{MAX_CPU_THREADS}")
        # (under a second a collective fails as the group forms: gloo rounded 0.0001 s to 0 ms, a traceback)
        _check(self.tp_timeout_s >= 1, "verifier.tp_timeout_s", "must be >= 1 second")
        _check(self.peer_stream_timeout_s > 0, "verifier.peer_stream_timeout_s", "must be > 0")
        _check(self.max_peers >= 1, "verifier.max_peers", "must be >= 1")
        _check_step_socket_dir(self.step_socket_dir, "verifier.step_socket_dir")
        _check(0 <= self.port < 65536, "verifier.port", f"{self.port} is not a TCP port")
        _check(0 <= self.metrics_port < 65536, "verifier.metrics_port", f"{self.metrics_port} is not a TCP port (0 = off)")
        _check(self.metrics_port != self.port or not self.port, "verifier.metrics_port",
               f"{self.metrics_port} is verifier.port too")
        _check(self.page_size > 0, "verifier.page_size", "must be > 0")
        _check(self.kv_capacity_tokens >= self.page_size, "verifier.kv_capacity_tokens", "must hold one page")
        _check(self.max_context >= 0, "verifier.max_context", "must be >= 0")
        _check(self.prefill_chunk > 0, "verifier.prefill_chunk", "must be > 0")
        _check(bool(self.graph_batches) and all(b >= 1 for b in self.graph_batches), "verifier.graph_batches",
               "must be one or more batch sizes >= 1")
        _check(bool(self.graph_nodes) and all(1 <= n <= MAX_BUDGET + 1 for n in self.graph_nodes),
               "verifier.graph_nodes", f"must be one or more tree sizes in 1..{MAX_BUDGET + 1} (budget + 1)")
        _check(all(0 <= b <= MAX_BUDGET for b in self.warmup_budgets), "verifier.warmup_budgets",
               f"must be budgets in 0..{MAX_BUDGET}")
        _check(all(i >= 0 for i in self.feature_layers), "verifier.feature_layers", "must be layer indices >= 0")
        _check(len(set(self.feature_layers)) == len(self.feature_layers), "verifier.feature_layers",
               f"{list(self.feature_layers)} names a layer twice")   # else refused only after the weights load
        _check(2 <= self.ring_slots <= MAX_VERIFIER_RING_SLOTS, "verifier.ring_slots",
               f"must be in [2, {MAX_VERIFIER_RING_SLOTS}]")
        _check(self.ring_slot_bytes >= 4096, "verifier.ring_slot_bytes", "must be >= 4096")
        _check(self.dtype in ("float32", "bfloat16", "float16"), "verifier.dtype",
               "must be float32, bfloat16 or float16")
        _check(is_device(self.device), "verifier.device", f"{self.device!r} is not cpu, cuda or cuda:N")


S = TypeVar("S", SchedulerSettings, DraftSettings, VerifierSettings)

_SECTIONS: dict[type, str] = {SchedulerSettings: "scheduler", DraftSettings: "draft", VerifierSettings: "verifier"}


_SECRETS = ("auth_token", "AUTH_TOKEN")   # settings whose values an error message must not repeat


def _coerce(name: str, value: Any, target: Any, from_text: bool = True) -> Any:
    """Turns a TOML or environment value into the field's declared type. Environment values are
    strings and are parsed (``from_text``); TOML values must already have the type (a list where a
    list is meant, no ``true`` or ``"8"`` for a number, no 1.7 for an integer), so a slip in the
    file fails at start-up with the setting's name instead of being rounded or crashing later."""
    text = str(target.__name__ if isinstance(target, type) else target)
    if not from_text and isinstance(value, str) and text != "str":
        shape = "a list, e.g. [...]" if text.startswith("tuple") else "written without quotes"
        raise SettingsError(f"{name}: {value!r} is a string; this setting is {text}, {shape}")
    if text == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{name}: {value!r} is not a boolean")
    if text == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise SettingsError(f"{name}: {value!r} is not a number")
        try:
            number = float(value)
        except ValueError:
            raise SettingsError(f"{name}: {value!r} is not a number") from None
        # inf read as "wait for ever" gave up at once (a deadline past what gRPC holds), or overflowed
        if not math.isfinite(number):
            raise SettingsError(f"{name}: {value!r} is not a finite number")
        if name.lower().endswith("_s") and number > MAX_SECONDS:
            raise SettingsError(f"{name}: {value!r} seconds; at most {MAX_SECONDS:g} ({MAX_SECONDS / 86400:g} days)")
        return number
    if text == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise SettingsError(f"{name}: {value!r} is not an integer")
        try:
            return int(value)
        except ValueError:
            raise SettingsError(f"{name}: {value!r} is not an integer") from None
    if text.startswith("tuple"):
        if isinstance(value, str):
            bare = value.strip()   # TOML's form in a variable: its items kept their brackets ([::1]:5 is an address)
            if bare.startswith(("[", "(")) and (bare.endswith(("]", ")")) or '"' in bare or "'" in bare):
                raise SettingsError(f"{name}: {value!r}: a list in an environment variable is comma-separated, "
                                    "without brackets or quotes (e.g. 1,2,4 or host:1,host:2)")
            items = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, list):
            items = value
        else:
            raise SettingsError(f"{name}: {value!r} is not a list (write [{value!r}] for one item)")
        if text.startswith("tuple[int"):
            if any(isinstance(v, (bool, float)) or (not from_text and isinstance(v, str)) for v in items):
                raise SettingsError(f"{name}: {value!r} is not a list of integers"
                                    f"{' (written without quotes)' if not from_text else ''}")
            try:
                return tuple(int(v) for v in items)
            except (TypeError, ValueError):
                raise SettingsError(f"{name}: {value!r} is not a list of integers") from None
        if not all(isinstance(v, str) for v in items):
            raise SettingsError(f"{name}: {value!r} is not a list of strings")
        return tuple(items)
    if text == "str" and not isinstance(value, str):
        shown = "the value" if name.endswith(_SECRETS) else repr(value)   # an error line lands in logs
        raise SettingsError(f"{name}: {shown} is not a string (quote it)")
    return value


def load_settings(cls: type[S], path: str | Path | None = None, env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> S:
    """Builds `cls` from the config file's table, `DDTREE_<SECTION>_*` variables, then overrides.

    `env` defaults to the process environment; tests pass their own mapping.
    """
    section = _SECTIONS[cls]
    values: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except OSError as exc:
            raise SettingsError(f"config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise SettingsError(f"config file {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        known = sorted(_SECTIONS.values())
        for key, value in doc.items():  # a misspelt table would otherwise be ignored without a word
            if key not in known or not isinstance(value, dict):
                raise SettingsError(f"config file {path}: {key!r} is not one of the tables [{'], ['.join(known)}]")
        table = doc.get(section, {})
        for key, value in table.items():
            if key not in fields:
                raise SettingsError(f"{section}.{key}: unknown setting (known: {', '.join(fields)})")
            values[key] = _coerce(f"{section}.{key}", value, fields[key].type, from_text=False)
    environ = os.environ if env is None else env
    _refuse_other_services(environ)
    prefix = f"DDTREE_{section.upper()}_"
    for key, value in environ.items():
        if key.startswith(prefix):
            name = key[len(prefix):].lower()
            if name not in fields:
                if key in INTERNAL_VARIABLES:
                    raise SettingsError(f"{key}: {INTERNAL_VARIABLES[key]}, not by hand; unset it")
                raise SettingsError(f"{key}: unknown setting for {section}")
            if name == "auth_token" and not value:   # compose passes an unset shell variable as "": the file's token stands
                continue
            values[name] = _coerce(key, value, fields[name].type)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in fields:
            raise SettingsError(f"{section}.{key}: unknown setting")
        values[key] = _coerce(f"{section}.{key}", value, fields[key].type)
    return cls(**values)


# Variables a service sets for processes it starts, under a service's prefix but no setting of it.
RANK0_SETTINGS_ENV = "DDTREE_VERIFIER_RANK0_SETTINGS"   # rank 0's settings, for its workers (verifier/ranks.py)
INTERNAL_VARIABLES = {RANK0_SETTINGS_ENV: "set by the verifier for its tensor-parallel ranks"}

# The DDTREE_ variables that are no service's setting (those are DDTREE_<SERVICE>_<FIELD>).
OTHER_VARIABLES = frozenset({
    "DDTREE_AUTH_TOKEN", "DDTREE_TOKEN", "DDTREE_INTERNAL_TOKEN", "DDTREE_INTERNAL_TOKEN_FILE", "DDTREE_HEALTH_PORT",
    "DDTREE_HEALTH_CONFIG", "DDTREE_HEALTH_SERVICE", "DDTREE_HEALTH_TLS_NAME", "DDTREE_PARENT_PID", "DDTREE_PUBLISH_ADDR",
    "DDTREE_TREE_MLA_BACKEND", "DDTREE_INT4_MOE_CONFIG", "DDTREE_PDL", "DDTREE_CI", "DDTREE_COMMIT",
    "DDTREE_STEP_PROBE_DIR"})


def _refuse_other_services(environ: Mapping[str, str]) -> None:
    """A setting's variable under a service name that is none of ours (DDTREE_SCHEDULR_MAX_QUEUE),
    or under none at all (DDTREE_MAX_QUEUE), was read by no service, without a word, where a
    misspelt field or config table is refused. The longest setting name the variable ends in is
    the one meant (DDTREE_METRICS_PORT: `metrics_port`, not `port`)."""
    services = tuple(f"DDTREE_{name.upper()}_" for name in _SECTIONS.values())
    owners: dict[str, list[str]] = {}   # field: the services that have it
    for cls, name in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, []).append(name)
    for key in environ:
        if not key.startswith("DDTREE_") or key.startswith(services) or key in OTHER_VARIABLES:
            continue
        words = key.removeprefix("DDTREE_").lower().split("_")
        for cut in range(len(words)):
            field = "_".join(words[cut:])
            if field in owners:
                names = " or ".join(f"DDTREE_{o.upper()}_{field.upper()}" for o in owners[field])
                said = f"no service is called {'_'.join(words[:cut])!r}" if cut else "no service is named"
                raise SettingsError(f"{key}: {said} (the setting is {names})")


def replace(settings: S, **changes: Any) -> S:
    """A copy with some fields changed, validated again."""
    return dataclasses.replace(settings, **changes)

