"""The verifier as a group of ranks: rank 0 serves gRPC and broadcasts each engine call; ranks
1..N-1 are worker processes that replay the same calls on their slice of the model, in lockstep.

A rank that dies takes the group down at once (rank 0 reports NOT_SERVING and exits, workers exit
when rank 0's collectives fail): a half group would hang or be wrong, and the supervisor (the
launcher, compose's restart policy) starts a whole new group.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import re
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from services.common.config_files import CheckpointError
from services.common.devices import current, seen_gpus, visible_gpus
from services.common.grpc_server import ServiceError
from services.common.logging import configure_logging, get_logger
from services.common.settings import RANK0_SETTINGS_ENV, SettingsError, VerifierSettings, load_settings
from services.verifier.engine import VerifierEngine
from services.verifier.parallel import TensorParallel

__all__ = ["EngineGroup", "GroupFailed", "backend_for", "check_rank_devices", "first_exit", "rank_device",
           "spawn_workers", "stop_workers", "watch_workers", "worker_main"]

log = get_logger("verifier")

_STOP = "__stop__"
_NOOP = "__noop__"


def settings_json(settings: VerifierSettings) -> str:
    """Rank 0's settings, as the workers must use them (passed in `RANK0_SETTINGS_ENV`): each read
    the config file and environment itself, and a file changed while the group started gave ranks
    other KV caches (out of step at the first long prompt, SERVING until then)."""
    return json.dumps(dataclasses.asdict(settings))


def settings_from_json(text: str) -> VerifierSettings:
    fields = json.loads(text)
    return VerifierSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


class GroupFailed(ServiceError):
    """The group lost a rank or a call left it out of step: every later call fails with this
    (UNAVAILABLE), and a stream that meets it ends rather than fail only its step's requests."""

    def __init__(self, reason: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, reason)


# CUDA's words for the errors that leave a process's context unusable ("sticky": every later call
# fails the same), as torch and Triton report them. Others (out of memory, a launch's bad
# configuration) fail their own call only.
_STICKY_CUDA_ERRORS = ("illegal memory access", "device-side assert", "misaligned address", "unspecified launch failure",
                       "illegal instruction", "uncorrectable ECC error", "hardware stack error", "invalid program counter",
                       "launch timed out and was terminated")


def device_fault(exc: BaseException) -> bool:
    """A CUDA error that leaves the context unusable: every later call failed INTERNAL while the
    verifier said SERVING, and only a new process recovers, so it counts as the group's end."""
    text = str(exc)
    return "CUDA" in text and any(words in text for words in _STICKY_CUDA_ERRORS)


class EngineGroup:
    """Rank 0's engine handle: every state-changing call runs on all ranks in the same order."""

    def __init__(self, engine: VerifierEngine, tp: TensorParallel,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.tp = tp
        self.last_call = time.monotonic()
        # Called when a call fails on rank 0 with ranks: the group is out of step for good (a
        # collective that timed out closes its connections; a call only rank 0 failed leaves the
        # workers a call ahead). It stayed up and SERVING, failing every handshake and step.
        self.on_failure = on_failure
        self.stopped = False
        self.failed: str | None = None   # why the group is out of step for good, once it is

    def call(self, method: str, *args: Any) -> Any:
        """Runs ``method`` on every rank. Raises what the engine raises; with ranks, a failure
        that leaves the group out of step is UNAVAILABLE naming it (it was a bare INTERNAL)."""
        if self.stopped:   # the workers were told to stop: a broadcast now would wait for no one
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the verifier group is stopping")
        if self.failed is not None:   # out of step: a broadcast now could pair with a failed call's collective
            raise GroupFailed(self.failed)
        try:
            self._broadcast((method, args))
            return getattr(self.engine, method)(*args)
        except ServiceError:   # refused input: every rank refused it alike (see worker_loop)
            raise
        except Exception as exc:
            if reason := self._failed(method, exc):
                raise GroupFailed(reason) from exc
            raise

    def heartbeat(self) -> None:
        """A call that does nothing. Workers wait for rank 0's next call in a broadcast, a
        collective that fails after `verifier.tp_timeout_s` like any other: an idle group (no
        draft, no request) ended itself every minute. Rank 0 sends this while idle (`keep_awake`)."""
        if self.tp.enabled and not self.stopped and self.failed is None:
            try:
                self._broadcast((_NOOP, ()))
            except Exception as exc:
                self._failed("heartbeat", exc)
                raise

    def _failed(self, method: str, exc: Exception) -> str | None:
        """Reports a failure that ends the group, and returns why: with ranks any, alone a device
        fault (`device_fault`); None for the rest."""
        # (a collective's error opens with its library's source path: `[/__w/.../pair.cc:537] `)
        said = re.sub(r"^\[[^\]]*:\d+\] ", "", str(exc).splitlines()[0]) if str(exc) else ""
        what = f"({type(exc).__name__}: {said[:200]})"
        if self.tp.enabled:
            # A rank that died (killed, out of memory) broke the collective: said as such, not as
            # rank 0's failure, which its error text (a reset connection) read as.
            gone = self.tp.peer_gone(wait_s=2.0)
            reason = f"verifier ranks out of step: {gone} (rank 0's {method} failed with it)" if gone \
                else f"verifier ranks out of step: rank 0's {method} failed {what}"
        elif device_fault(exc):
            reason = f"the verifier's GPU failed in {method} {what}"
        else:
            return None
        self.failed = self.failed or reason
        if self.on_failure is not None:
            self.on_failure(reason)
        return reason

    def _broadcast(self, call: tuple[str, tuple]) -> None:
        if not self.tp.enabled:
            return
        with current(self.engine.model_device):   # engine calls come from worker threads (GPU 0)
            self.tp.broadcast(call)
        self.last_call = time.monotonic()

    def stop(self) -> None:
        if self.tp.enabled and not self.stopped:
            self.stopped = True
            self._broadcast((_STOP, ()))


def worker_loop(engine: VerifierEngine, tp: TensorParallel) -> None:
    while True:
        method, args = tp.broadcast(None)
        if method == _STOP:
            return
        if method == _NOOP:
            continue
        try:
            getattr(engine, method)(*args)
        except ServiceError as exc:
            # A refusal of the call's input: every rank holds the same state and input, so rank 0
            # refused it at the same point and answered its caller; the group stays in step.
            log.info("call_refused", rank=tp.rank, method=method, error=exc.message)


def rank_device(device: str, rank: int) -> str:
    """`cuda` / `cuda:0` spreads ranks over GPUs 0..N-1, `cuda:K` over K..K+N-1; `cpu` keeps them all
    on the CPU."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def check_rank_devices(settings: VerifierSettings) -> None:
    """Every rank's GPU must exist before any rank starts: a rank past the GPUs this process sees
    died in its own start-up with a traceback, and rank 0 then failed the group UNAVAILABLE
    (``ddtree up`` exit 1, "may work later") where the setting is what is wrong."""
    if settings.tp == 1 or not settings.device.startswith("cuda"):
        return   # one rank: `pin_device` names verifier.device for a GPU that is not there
    count = visible_gpus(settings.device, "verifier.device")
    first, last = rank_device(settings.device, 0), rank_device(settings.device, settings.tp - 1)
    if int(first.split(":", 1)[1]) >= count:   # rank 0's own GPU: the device's fault, as with one rank
        raise SettingsError(f"verifier.device: device {first} does not exist: {seen_gpus(count)}")
    if int(last.split(":", 1)[1]) >= count:
        raise SettingsError(f"verifier.tp: {settings.tp} ranks on verifier.device = {settings.device} take "
                            f"{first}..{last}, and {seen_gpus(count)}")


def spawn_workers(settings: VerifierSettings, config_path: str | None, init_method: str) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-m", "services.verifier.ranks", "--init-method", init_method, "--parent-pid", str(os.getpid())]
    if config_path:
        cmd += ["--config", config_path]
    # Own session: a Ctrl-C or a signal to rank 0's process group reaches rank 0 only, which stops
    # the workers in order (stop broadcast); PR_SET_PDEATHSIG still ends them if rank 0 dies.
    env = {**os.environ, RANK0_SETTINGS_ENV: settings_json(settings)}
    return [subprocess.Popen(cmd + ["--rank", str(r)], start_new_session=True, env=env) for r in range(1, settings.tp)]


def first_exit(procs: list[subprocess.Popen]) -> str | None:
    """Which worker rank has exited, and how, or None while all run."""
    for rank, proc in enumerate(procs, start=1):
        if proc.poll() is not None:
            return f"verifier rank {rank} exited with code {proc.returncode}"
    return None


def watch_workers(procs: list[subprocess.Popen], on_death: Callable[[str], None],
                  interval_s: float = 0.2) -> threading.Event:
    """A daemon thread that calls `on_death` as soon as any worker rank exits.

    Returns its off switch: set it before stopping the workers on purpose, so an orderly shutdown
    is not reported as a rank dying.
    """
    disarmed = threading.Event()

    def run() -> None:
        while not disarmed.wait(interval_s):
            if (gone := first_exit(procs)) is not None and not disarmed.is_set():
                on_death(gone)
                return
    threading.Thread(target=run, name="rank-watchdog", daemon=True).start()
    return disarmed


def stop_workers(procs: list[subprocess.Popen], grace_s: float, kill_after_s: float = 5.0) -> None:
    """Give all workers `grace_s` together to leave on their own (after a stop broadcast), then
    SIGTERM the rest, then SIGKILL what is still there `kill_after_s` later."""
    for deadline, signal_rest in ((time.monotonic() + grace_s, subprocess.Popen.terminate),
                                  (time.monotonic() + grace_s + kill_after_s, subprocess.Popen.kill)):
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:
            if proc.poll() is None:
                signal_rest(proc)
    for proc in procs:
        proc.wait()


def _die_with_parent() -> None:
    """Linux: get SIGTERM when rank 0 goes, so no worker outlives its group."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def worker_main(argv: list[str] | None = None) -> int:
    from services.verifier.server import build_engine

    p = argparse.ArgumentParser(description="verifier worker rank (started by rank 0)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--config", default=None)
    p.add_argument("--parent-pid", type=int, default=None, help="rank 0's pid: a worker whose rank 0 is gone exits")
    args = p.parse_args(argv)
    _die_with_parent()
    if args.parent_pid is not None and os.getppid() != args.parent_pid:
        # Rank 0 died while this process imported (seconds), before the death signal was asked
        # for: it would wait for its group to form for minutes, holding its GPU.
        print(f"verifier rank {args.rank}: rank 0 (pid {args.parent_pid}) is gone; exiting", file=sys.stderr)
        return 1
    rank0 = os.environ.pop(RANK0_SETTINGS_ENV, "")
    settings = settings_from_json(rank0) if rank0 else load_settings(VerifierSettings, args.config)
    configure_logging(f"verifier-rank{args.rank}", settings.json_logs)
    tp = TensorParallel(args.rank, settings.tp, args.init_method, backend=backend_for(settings),
                        timeout_s=settings.tp_timeout_s, device=rank_device(settings.device, args.rank))
    try:
        engine = build_engine(settings, tp)
    except (CheckpointError, SettingsError) as exc:
        # Rank 0 loads the same checkpoint and says why in one line: a traceback from every
        # worker (seven at tp 8) buried it.
        log.warning("rank_start_refused", rank=args.rank, error=str(exc))
        return 2
    try:
        worker_loop(engine, tp)
    except Exception as exc:   # rank 0 went away mid-collective: nothing left to serve
        log.warning("rank_exit", rank=args.rank, reason=str(exc))
        return 1
    tp.close()
    return 0


def backend_for(settings: VerifierSettings) -> str:
    return "nccl" if settings.device.startswith("cuda") else "gloo"


if __name__ == "__main__":
    sys.exit(worker_main())
