"""The `ddtree` command: run the stack, call it, and make checkpoints (`ddtree <command> --help`
lists every flag).

    ddtree up [--model DIR] [--drafter DIR] [--host H] [--port N] [--config FILE] [--draft-replicas N] [--tp N]
              [--startup-timeout S]  # the three services; a service that dies is restarted; Ctrl-C stops all
    ddtree generate --prompt TEXT [--token-ids] [--max-tokens N] [--temperature T] [--top-p P] [--top-k K]
                    [--seed S] [--budget B] [--mode ddtree|autoregressive] [--stop STR ...] [--stop-token-ids IDS]
                    [--ignore-eos] [--timeout S] [--json] [--address HOST:PORT] [--token T]
                    [--tls-ca FILE] [--tls-server-name NAME]
    ddtree serve {scheduler,draft,verifier} [--config FILE] [--set FIELD=VALUE]  # one service (what `up` and compose run)
    ddtree make-checkpoint DIR [--vocab-size N] [--seed S] [--bf16-experts] [--force]  # a small random target + drafter
    ddtree make-token FILE  # the internal token draft and verifier ports ask for (compose runs it)
    ddtree bench [--contexts ...] [--concurrency ...] [--budgets ...] [--max-tokens N] [--out FILE.json]
                 [--spawn-stack MODEL --device cuda --dtype bfloat16]  # the serving matrix; more: --help
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

__all__ = ["main"]

TOKEN_ENV = "DDTREE_TOKEN"   # the bearer token for generate / bench, where --token would show in `ps`
DEMO_MODEL = "models/demo"   # the bundled demo pair, relative to the repository's root
MAX_RANDOM_VOCAB = 262_144   # `make-checkpoint --vocab-size`: past K2's 163,840, below what fills a host's memory


def _cmd_serve(args: argparse.Namespace) -> int:
    import grpc

    from services.common.grpc_server import ServiceError, watch_launcher_during_start_up
    from services.common.settings import (DraftSettings, SchedulerSettings, SettingsError, VerifierSettings,
                                          load_settings)

    usage_errors: tuple[type[Exception], ...] = (SettingsError,)
    watch_launcher_during_start_up()
    try:
        overrides = _setting_flags(args.service, args.set)
        if args.service != "scheduler":   # checkpoints need torch; the scheduler runs without it
            from services.common.checkpoint import CheckpointError
            usage_errors += (CheckpointError,)
        if args.service == "verifier":
            from services.verifier.server import serve
            coro = serve(load_settings(VerifierSettings, args.config, overrides=overrides), args.config)
        elif args.service == "draft":
            from services.draft.server import serve
            coro = serve(load_settings(DraftSettings, args.config, overrides=overrides))
        else:
            from services.scheduler.server import serve
            coro = serve(load_settings(SchedulerSettings, args.config, overrides=overrides))
        _run_async(coro)
    except usage_errors as exc:
        print(f"ddtree serve {args.service}: {exc}", file=sys.stderr)
        return 2
    except ServiceError as exc:
        print(f"ddtree serve {args.service}: {exc.code.name}: {exc.message}", file=sys.stderr)
        # A peer that refused this service's settings as given (a verifier refusing the draft's
        # handshake: its feature layers, no common transport) is a usage error: a restart cannot help.
        return 2 if exc.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION) else 3
    except KeyboardInterrupt:   # Ctrl-C before the service serves (loading, waiting for its peers)
        print(f"ddtree serve {args.service}: interrupted during start-up", file=sys.stderr)
        return 130
    return 0


def _setting_flags(service: str, flags: list[str]) -> dict[str, str]:
    """``--set FIELD=VALUE`` (or ``SERVICE.FIELD=VALUE``) flags as settings overrides: typed and
    checked as the environment's text is, and over it."""
    from services.common.settings import SettingsError

    overrides: dict[str, str] = {}
    for flag in flags:
        key, sep, value = flag.partition("=")
        section, dot, field = key.strip().rpartition(".")
        if not sep or not field or (dot and section != service):
            raise SettingsError(f"--set {flag!r}: give FIELD=VALUE or {service}.FIELD=VALUE (a setting of the "
                                f"{service}, as in its [{service}] table)")
        if field == "auth_token":
            raise SettingsError(f"{service}.auth_token: not as a flag, which every user of this host can read in "
                                f"the process list (the config file or DDTREE_{service.upper()}_AUTH_TOKEN)")
        overrides[field] = value
    return overrides


def _run_async(coro) -> None:
    try:
        import uvloop
        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


# The variables compose/docker-compose.yml reads, which `ddtree up` does not: what each means there.
COMPOSE_VARIABLES = {
    "DDTREE_AUTH_TOKEN": "the scheduler's bearer token; for ddtree up, set DDTREE_SCHEDULER_AUTH_TOKEN "
                         "or scheduler.auth_token in --config",
    "DDTREE_PUBLISH_ADDR": "where the scheduler's port is published; for ddtree up, --host"}


def _cmd_up(args: argparse.Namespace) -> int:
    from services.common.grpc_server import check_port_free, is_loopback
    from services.common.launcher import ServiceExited, Stack, StackSpec, StartupStopped, placed_by_up
    from services.common.settings import SettingsError

    for ok, flag in ((0 <= args.port < 65536, f"--port {args.port}: not a TCP port (0 = any free one)"),
                     (args.draft_replicas >= 1, f"--draft-replicas {args.draft_replicas}: must be >= 1"),
                     (0 <= args.tp <= 8, f"--tp {args.tp}: must be 1..8 (or 0: the config's)"),
                     (args.startup_timeout > 0, f"--startup-timeout {args.startup_timeout:g}: must be > 0 seconds")):
        if not ok:
            print(f"ddtree up: {flag}", file=sys.stderr)
            return 2
    model = Path(args.model)
    if not (model / "config.json").is_file():
        bundled = "" if args.model != DEMO_MODEL or model.exists() else \
            f"; the bundled demo model is {DEMO_MODEL} in the repository (run from its root, or give --model PATH)"
        print(f"ddtree up: no checkpoint at {model.resolve()} (config.json missing){bundled}; "
              f"random weights for tests: `ddtree make-checkpoint {model}`", file=sys.stderr)
        return 2
    drafter = args.drafter or str(model / "drafter")
    if not drafter.startswith("oracle:") and not (Path(drafter) / "config.json").is_file():
        print(f"ddtree up: no drafter checkpoint at {drafter} (config.json missing)"
              f"{'' if args.drafter else '; --drafter DIR names another'}", file=sys.stderr)
        return 2
    # Before anything starts: another stack on the port would answer our health probe while our
    # scheduler crash-looped on "Address already in use".
    try:
        check_port_free(args.host, args.port, "--host/--port")
    except SettingsError as exc:
        hint = " (another stack? --port picks another, 0 any free one)" if "in use" in str(exc) else ""
        print(f"ddtree up: {exc}{hint}", file=sys.stderr)
        return 2
    ignored = placed_by_up(args.config, dict(os.environ))
    if ignored:
        print(f"ddtree up: not applied, since ddtree up takes the model from its flags and picks the ports and "
              f"addresses: {', '.join(ignored)}", file=sys.stderr)
    for var in COMPOSE_VARIABLES:
        if os.environ.get(var):
            print(f"ddtree up: not applied: {var} is read by compose only ({COMPOSE_VARIABLES[var]})", file=sys.stderr)
    spec = StackSpec(model_path=str(model), drafter_path=args.drafter, config_path=args.config,
                     scheduler_port=args.port, scheduler_host=args.host, draft_replicas=args.draft_replicas,
                     startup_timeout_s=args.startup_timeout,
                     extra_env={"DDTREE_VERIFIER_TP": str(args.tp)} if args.tp else {})
    stack = Stack(spec)
    stop = {"now": False, "signal": signal.SIGINT}

    def _on_signal(signum, frame) -> None:
        if stop["now"]:   # a second one: the stop waits for nothing (the scheduler's drain)
            stack.hurry()
            return
        stop["now"], stop["signal"] = True, signum

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        stack.start(should_stop=lambda: stop["now"])   # a signal stops the start-up too, not only the stack
    except StartupStopped:   # exits as a shell reports the signal (130 for Ctrl-C): not a stack that served
        print("ddtree up: stopped during start-up", file=sys.stderr)
        return 128 + int(stop["signal"])
    except SettingsError as exc:
        print(f"ddtree up: {exc}", file=sys.stderr)
        return 2
    except ServiceExited as exc:   # its own refusal of a setting or a checkpoint (exit 2) stays one
        print(f"ddtree up: {exc}", file=sys.stderr)
        return 2 if exc.code == 2 else 1
    except RuntimeError as exc:
        print(f"ddtree up: {exc}", file=sys.stderr)
        return 1
    here = stack.scheduler_address
    reach = "" if here == stack.scheduler_listen_address else f" (from this host: {here})"
    sched = stack.scheduler_settings
    flags = ("" if here == "127.0.0.1:50051" else f" --address {here}") + \
        (f" --tls-ca {sched.tls_cert}" if sched.tls_cert else "") + (" --token TOKEN" if sched.auth_token else "")
    if sched.tls_cert and os.environ.get("DDTREE_HEALTH_TLS_NAME"):   # a certificate not naming 127.0.0.1
        flags += f" --tls-server-name {os.environ['DDTREE_HEALTH_TLS_NAME']}"
    prompt = "--prompt 'def fibonacci(n):'" if sched.tokenizer_path else "--token-ids --prompt 1,2,3"
    print(f"ddtree up: serving {model} at {stack.scheduler_listen_address}{reach} "
          f"(try: {_this_command()} generate{flags} {prompt}); Ctrl-C stops", file=sys.stderr, flush=True)
    if not sched.tokenizer_path:
        print(f"ddtree up: {_no_tokenizer_note(model)}", file=sys.stderr, flush=True)
    if not sched.auth_token and not is_loopback(sched.host):
        print(f"ddtree up: {stack.scheduler_listen_address} answers anyone who reaches it: no scheduler.auth_token "
              "(DDTREE_SCHEDULER_AUTH_TOKEN)", file=sys.stderr, flush=True)
    report = _restart_reporter(sched.json_logs)
    try:
        stack.supervise(lambda: stop["now"], report=report)
    except StartupStopped:   # a signal while a service restarted
        pass
    except RuntimeError as exc:   # a crash loop
        report("stack_stopped", f"{exc}; stopping")
        return 1
    finally:
        stack.stop()
    if not sched.json_logs:   # the last line was a service's "stopping": said that all of it has
        print(f"ddtree up: stopped ({signal.Signals(stop['signal']).name})", file=sys.stderr, flush=True)
    return 0


def _this_command() -> str:
    """How to run `ddtree` again from this shell: `ddtree` where it is on PATH, else this process's
    own path (`make up` runs `.venv/bin/ddtree`; a hint saying `ddtree` failed there)."""
    import shutil

    here = Path(sys.argv[0])
    if here.name == "ddtree" and shutil.which("ddtree") != str(here.resolve()) and here.exists():
        return str(here)
    return "ddtree"


def _restart_reporter(json_logs: bool) -> Callable[..., None]:
    """How `ddtree up` tells of a service's restart, a failed one, a draft replica left down
    (`service_given_up`), or the crash loop that stops the stack (`stack_stopped`): a line for the
    console, or, where the services log JSON, a JSON event among theirs, with its fields (a plain
    line there broke a parser of the stack's log)."""
    if not json_logs:
        return lambda event, message, **fields: print(f"ddtree up: {message}", file=sys.stderr, flush=True)
    from services.common.logging import configure_logging, get_logger
    configure_logging("launcher", json_logs=True)
    log = get_logger("launcher")

    def report(event: str, message: str, **fields: object) -> None:
        (log.error if event == "stack_stopped" else log.warning)(event, message=message, **fields)
    return report


def _no_tokenizer_note(model: Path) -> str:
    """What `ddtree up` says of a model with neither tokenizer.json nor tiktoken.model: text
    prompts are refused (FAILED_PRECONDITION), which a user of a checkpoint that ships another
    tokenizer format met only at the first request."""
    other = sorted(p.name for p in model.glob("*") if p.name in ("tokenizer.model", "vocab.json"))
    note = f"{model} has no tokenizer.json or tiktoken.model: prompts must be token ids (ddtree generate --token-ids)"
    if other:
        note += (f"; its {', '.join(other)} is not read here: convert it to a Hugging Face tokenizer.json "
                 "(the `tokenizers` format) in the model directory for text prompts")
    return note


# The SDK's argument names as `ddtree generate`'s flags, for its refusals of a flag's value.
_GENERATE_FLAGS = {"timeout_s": "--timeout", "tls_ca": "--tls-ca", "tls_server_name": "--tls-server-name",
                   "token": "--token", "max_tokens": "--max-tokens", "temperature": "--temperature",
                   "top_p": "--top-p", "top_k": "--top-k", "seed": "--seed", "budget": "--budget",
                   "stop_token_ids": "--stop-token-ids", "stop": "--stop", "prompt": "--prompt"}
def _refused(message: str) -> str:
    """A refusal of the client's, led by the flag of the first argument it names."""
    for word in re.findall(r"[a-z_]+", message):
        if word in _GENERATE_FLAGS:
            if word == "timeout_s":   # the SDK's None is a flag left out here
                message = message.replace("or None (no deadline)", "or left out (no deadline)")
            return f"{_GENERATE_FLAGS[word]}: {message}"
    return message


def _unavailable_hint(args: argparse.Namespace, details: str) -> str:
    """What to check when no scheduler answered: the TLS set-up where its handshake failed, the
    host where it was not found, else whether a scheduler runs there at all."""
    low = details.lower()
    if args.tls_ca is not None and "wrong_version_number" in low:   # a plaintext server's answer to a TLS hello
        return f"the scheduler at --address {args.address} does not speak TLS: leave out --tls-ca"
    if args.tls_ca is not None and any(w in low for w in ("handshake", "certificate", "ssl", "hostname verification")):
        return ("the TLS handshake failed: does --tls-ca hold the CA that signed the scheduler's certificate, "
                "and does that certificate name the host (else --tls-server-name NAME)?")
    if any(w in low for w in ("dns", "resolve", "domain name")):
        return f"the host of --address {args.address} was not found"
    plain = " in plaintext" if args.tls_ca is None else ""
    hint = "is it running (ddtree up)" + (", or does it speak TLS (--tls-ca FILE)" if args.tls_ca is None else "")
    return f"no scheduler answered at {args.address}{plain}: {hint}?"


def _cmd_generate(args: argparse.Namespace) -> int:
    """Exit status: 0 done; 1 the call failed (no scheduler, a failure or deadline on the way: may
    work later); 2 a flag or the request is refused as given (here, or INVALID_ARGUMENT /
    OUT_OF_RANGE / FAILED_PRECONDITION from the server, or a failure it says no retry mends: fix
    it, do not retry); 130 Ctrl-C; 141 the output's reader went."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")   # gRPC's own handshake log lines beside the message
    import grpc

    from services.scheduler.client import Client, ClientError, Completion, address_error

    prompt: str | list[int] = args.prompt
    if args.token_ids:
        try:
            prompt = [int(t) for t in args.prompt.split(",")]
        except ValueError:
            print(f"ddtree generate: --token-ids: --prompt must be comma-separated integers, got {args.prompt!r}",
                  file=sys.stderr)
            return 2
    try:
        stop_ids = [int(t) for t in args.stop_token_ids.split(",") if t.strip()] if args.stop_token_ids else []
    except ValueError:
        print(f"ddtree generate: --stop-token-ids must be comma-separated integers, got {args.stop_token_ids!r}",
              file=sys.stderr)
        return 2
    bad_address = address_error(args.address)
    if bad_address:
        print(f"ddtree generate: --address {bad_address}", file=sys.stderr)
        return 2
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, budget=args.budget, mode=args.mode, stop=args.stop or (), stop_token_ids=stop_ids,
                  ignore_eos=args.ignore_eos, timeout_s=args.timeout)
    started = False       # output printed
    answered = False      # any message came back (the scheduler was reached)
    finish = None
    # Tokens streamed without text: a scheduler without a tokenizer sends only ids. It took the
    # prompt as ids then; a text prompt that went in means it has one, and empty text is the output.
    ids: list[int] = []
    out = Completion()    # --json: the output so far, printed at the end whatever ended it

    def flush_ids() -> None:
        nonlocal started
        if not started and ids:
            print(",".join(map(str, ids)), end="")
            started = True

    def print_json(error: dict | None = None) -> None:
        """The JSON object, also for a call that failed or was interrupted: the output before it,
        and the error (a caller parsing stdout got nothing at all)."""
        if args.json:
            print(json.dumps({"request_id": out.request_id, "text": out.text, "token_ids": out.token_ids,
                              "acceptance_lengths": out.acceptance_lengths, "mean_acceptance": out.mean_acceptance,
                              "finish_reason": out.finish_reason, "usage": out.usage.__dict__ if out.usage else None,
                              **({"error": error} if error is not None else {})}))
    try:
        with warnings.catch_warnings(record=True) as said:   # the token-in-clear one: a line, not a source quote
            warnings.simplefilter("always")
            client = Client(args.address, tls_ca=args.tls_ca, token=args.token, tls_server_name=args.tls_server_name)
    except ClientError as exc:   # a flag the client cannot use: nothing was sent
        print(f"ddtree generate: {_refused(exc.message)}", file=sys.stderr)
        return 2
    for warning in said:
        print(f"ddtree generate: warning: {warning.message}", file=sys.stderr)
    try:
        with client:
            try:
                chunks = client.stream(prompt, **kwargs)   # checks every argument; sends nothing yet
            except ClientError as exc:
                print(f"ddtree generate: {_refused(exc.message)}", file=sys.stderr)
                return 2
            if args.json:
                for chunk in chunks:
                    answered = True
                    out.add(chunk)
                finish = out.finish_reason
                print_json()
            else:
                for chunk in chunks:
                    answered = True
                    if chunk.text:
                        started = True
                        print(chunk.text, end="", flush=True)
                    elif not started and args.token_ids and not args.stop:
                        # (Text held back, a partial character, comes later; stop strings need a
                        # tokenizer, so with them empty text is the output.)
                        ids += chunk.token_ids
                    if chunk.finish_reason == "stop" and not started and ids:
                        ids.pop()   # the stop or end-of-sequence id: never part of the output, as in the text
                    finish = chunk.finish_reason or finish
                flush_ids()
                print()
    except KeyboardInterrupt:   # leaving the client's block cancelled the request
        flush_ids()   # the ids received so far are the output so far, as text would be
        if started:
            print()
        print_json({"code": "CANCELLED", "message": "interrupted", "retryable": False})
        print("ddtree generate: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # the reader went (`| head`): leaving the client's block cancelled the request
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit's flush
        return 141   # as a process that SIGPIPE ended
    except ClientError as exc:
        flush_ids()
        if started:
            print()  # end the partial output's line before the error
        print_json({"code": exc.code.name, "message": exc.message, "retryable": exc.retryable})
        said = f" (--timeout {args.timeout:g} s passed)" \
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and args.timeout is not None else ""
        print(f"ddtree generate: {exc.code.name}: {exc.message}{said}", file=sys.stderr)
        if exc.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                        grpc.StatusCode.FAILED_PRECONDITION,   # a text prompt where no tokenizer is
                        grpc.StatusCode.UNAUTHENTICATED):      # no or a wrong --token, or not the scheduler's port
            return 2
        if exc.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE) and not exc.retryable:
            return 2   # the server says no retry mends it (over gRPC's message size, a text that kills the tokenizer)
        if exc.code == grpc.StatusCode.UNAVAILABLE and not answered and not _answers(args):
            print(f"ddtree generate: {_unavailable_hint(args, exc.message)}", file=sys.stderr)
        return 1
    if finish == "aborted":   # another caller's Abort of this id: the output is cut short
        print("ddtree generate: the request was aborted (Abort of its id); the output is incomplete", file=sys.stderr)
        return 1
    return 0


def _answers(args: argparse.Namespace) -> bool:
    """Whether the scheduler at ``--address`` answers at all: an UNAVAILABLE it sent itself (a draft
    replica that died mid-request) must not read as "no scheduler answered"."""
    from services.scheduler.client import Client, ClientError

    try:
        with warnings.catch_warnings():   # said once already, by the call this one follows
            warnings.simplefilter("ignore")
            client = Client(args.address, timeout_s=3.0, tls_ca=args.tls_ca, token=args.token,
                            tls_server_name=args.tls_server_name)
        with client:
            client.model_info()
        return True
    except ClientError:
        return False


def _cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from services.common.make_checkpoint import make_random_checkpoint

    out = Path(args.out)
    if not args.force and ((out / "config.json").exists() or (out / "drafter" / "config.json").exists()):
        # One slip (`make-checkpoint models/demo`) replaced the trained demo pair with random weights.
        print(f"ddtree make-checkpoint: {out} already holds a checkpoint; --force replaces it with random "
              "weights", file=sys.stderr)
        return 2
    if args.vocab_size > MAX_RANDOM_VOCAB:   # the embeddings alone: a raw allocator traceback, minutes in
        print(f"ddtree make-checkpoint: --vocab-size {args.vocab_size}: at most {MAX_RANDOM_VOCAB} for a small random "
              "checkpoint", file=sys.stderr)
        return 2
    made = not out.exists()
    try:
        make_random_checkpoint(out, vocab_size=args.vocab_size, seed=args.seed,
                               int4=not args.bf16_experts)
    except BaseException as exc:
        if made:   # a directory it made and did not fill is no checkpoint: a half of one left behind misled
            shutil.rmtree(out, ignore_errors=True)
        if not isinstance(exc, (ValueError, OSError)):
            raise
        print(f"ddtree make-checkpoint: {exc}", file=sys.stderr)   # e.g. a vocabulary smaller than the byte alphabet
        return 2
    print(f"wrote a random target, drafter and tokenizer to {args.out}", file=sys.stderr)
    return 0


def _cmd_make_token(args: argparse.Namespace) -> int:
    from services.common.auth import INTERNAL_TOKEN_FILE_ENV, write_internal_token
    from services.common.settings import SettingsError

    try:
        wrote = write_internal_token(args.path)
    except (OSError, SettingsError) as exc:
        print(f"ddtree make-token: {getattr(exc, 'strerror', None) or exc}: {args.path}"
              if isinstance(exc, OSError) else f"ddtree make-token: {exc}", file=sys.stderr)
        return 2
    print(f"{'wrote a new' if wrote else 'kept the'} internal token in {args.path} "
          f"(give the services {INTERNAL_TOKEN_FILE_ENV}={args.path})", file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """The matrix against `--address`, or (`--spawn-stack MODEL`) against a stack started here,
    sized for the matrix and stopped at the end, also when the run is cut short by SIGTERM. A
    mistake (a bad setting, no server at the address, a file it cannot read or write) is one line."""
    from bench.matrix import MatrixParams
    from services.common.settings import MAX_BUDGET, SettingsError
    from services.scheduler.client import ClientError

    out_dir = Path(args.out).resolve().parent
    while not out_dir.exists():   # the run makes the folders it writes into
        out_dir = out_dir.parent
    for ok, flag in ((all(c >= 1 for c in args.contexts), f"--contexts {args.contexts}: prompt lengths must be >= 1"),
                     (all(c >= 1 for c in args.concurrency), f"--concurrency {args.concurrency}: must be >= 1 each"),
                     (all(1 <= b <= MAX_BUDGET for b in args.budgets),
                      f"--budgets {args.budgets}: must be in 1..{MAX_BUDGET} (autoregressive cells run anyway)"),
                     (args.max_tokens >= 1, f"--max-tokens {args.max_tokens}: must be >= 1"),
                     (args.cell_timeout > 0, f"--cell-timeout {args.cell_timeout:g}: must be > 0 seconds"),
                     (args.time_budget >= 0, f"--time-budget {args.time_budget:g}: must be >= 0 seconds (0 = none)"),
                     (args.warmup_tokens >= 0, f"--warmup-tokens {args.warmup_tokens}: must be >= 0"),
                     (args.vocab_high > MatrixParams.vocab_low, f"--vocab-high {args.vocab_high}: must be > "
                                                                  f"{MatrixParams.vocab_low} (ids are drawn from "
                                                                  f"{MatrixParams.vocab_low} up to it)"),
                     (args.draft_replicas >= 1, f"--draft-replicas {args.draft_replicas}: must be >= 1"),
                     (args.draft_replicas == 1 or bool(args.spawn_stack),
                      f"--draft-replicas {args.draft_replicas}: only with --spawn-stack (a running stack has its own)"),
                     (out_dir.is_dir() and os.access(out_dir, os.W_OK), f"--out {args.out}: {out_dir} is no directory "
                                                                         "this process can write in"),
                     (not Path(args.out).is_dir(), f"--out {args.out}: is a directory; name the result file")):
        if not ok:   # before a stack starts or a cell runs
            print(f"ddtree bench: {flag}", file=sys.stderr)
            return 2
    if args.prompt_file:   # read now, not once the stack is up (minutes on a GPU), and in one line
        from bench.matrix import load_token_stream
        try:
            load_token_stream(args.prompt_file)
        except OSError as exc:
            print(f"ddtree bench: --prompt-file {args.prompt_file}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        except (ValueError, KeyError, TypeError) as exc:
            print(f"ddtree bench: --prompt-file {args.prompt_file}: not a prompt file ({type(exc).__name__}: "
                  f"{str(exc)[:200]}); it holds {{\"prompts\": [{{\"ids\": [...]}}, ...]}}", file=sys.stderr)
            return 2
    try:
        return _run_bench(args)
    except SettingsError as exc:
        print(f"ddtree bench: {exc}", file=sys.stderr)
        return 2
    except ClientError as exc:
        where = "" if args.spawn_stack else f"{args.address}: "
        print(f"ddtree bench: {where}{exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"ddtree bench: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2


def _run_bench(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from google.protobuf.json_format import MessageToDict

    from bench.matrix import MatrixParams, check_fits, local_gpu_name, power_gpu_ids, run_matrix, stack_spec, write_results
    from services.common.launcher import Stack
    from services.scheduler.client import Client, ClientError

    params = MatrixParams(address=args.address, contexts=args.contexts, concurrencies=args.concurrency,
                          budgets=args.budgets, max_tokens=args.max_tokens, temperature=args.temperature,
                          draft_metrics=args.draft_metrics, scheduler_metrics=args.scheduler_metrics,
                          vocab_high=args.vocab_high, prompt_file=args.prompt_file,
                          cell_timeout_s=args.cell_timeout, time_budget_s=args.time_budget,
                          warmup_tokens=args.warmup_tokens, power=not args.no_power,
                          power_gpus=power_gpu_ids(args.power_gpus), tls_ca=args.tls_ca or "",
                          tls_server_name=args.tls_server_name or "", token=args.token or "")
    out = Path(args.out)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))   # unwind: stop the stack
    copy_gbps = _copy_gbps()
    extra: dict = {}
    with ExitStack() as scope:
        if args.spawn_stack:
            model = args.spawn_stack
            if not params.prompt_file and (Path(model) / "heldout_prompts.json").is_file():
                params.prompt_file = str(Path(model) / "heldout_prompts.json")
            spec, params.draft_metrics, params.scheduler_metrics = stack_spec(
                params, model, args.device, args.dtype, args.stack_log, draft_replicas=args.draft_replicas)
            print(f"ddtree bench: starting the stack on {model} ({args.device}, {args.dtype})", file=sys.stderr,
                  flush=True)
            try:
                stack = scope.enter_context(Stack(spec))
            except RuntimeError as exc:   # a service died or never became healthy: it says which
                print(f"ddtree bench: {exc}", file=sys.stderr)
                return 1
            params.address = stack.scheduler_address
            # as the services listen: a metrics port another process took at the start has moved
            params.draft_metrics = stack.metrics_address("draft") or ""
            params.scheduler_metrics = stack.metrics_address("scheduler") or ""
            extra = {"stack": {"model": model, "device": args.device, "dtype": args.dtype,
                               "draft_replicas": args.draft_replicas,
                               "env": {k: v for k, v in spec.extra_env.items() if "PORT" not in k}}}
        try:
            with Client(params.address, timeout_s=30.0, wait_for_ready=True, **params.client_options()) as client:
                info = client.model_info()
        except ClientError as exc:
            if exc.code.name != "DEADLINE_EXCEEDED":
                raise
            raise ClientError(exc.code, "no scheduler answered within 30 s (is it running? does it speak TLS: "
                              "--tls-ca FILE?)") from None
        try:
            check_fits(info, params)
        except ValueError as exc:
            print(f"ddtree bench: {exc}", file=sys.stderr)
            return 2
        extra["transport"] = info.transport
        extra["model_info"] = MessageToDict(info, preserving_proto_field_name=True)
        # What served the run, not this machine: a CPU stack on a GPU host, or a server at another
        # address, was written as a run on this host's GPU. Its copy bandwidth where this host has
        # the same GPU (a stack here), else none measured.
        gpu = info.device or "unknown"
        if gpu != local_gpu_name():   # (no copy is measured without a GPU here)
            copy_gbps = None
        if not params.prompt_file:   # a trained drafter accepts little of them: not its acceptance on text
            print("ddtree bench: prompts are synthetic token ids (no --prompt-file): acceptance and DDTree "
                  "speed-ups are not those of real text", file=sys.stderr, flush=True)

        def save(rows: list[dict], plot: bool = False) -> None:
            write_results(rows, params, out, copy_gbps=copy_gbps, commit=args.commit, extra=extra, plot=plot, gpu=gpu)

        rows = run_matrix(params, on_row=save)
        save(rows, plot=True)
    for r in rows:
        print(f"ctx={r['context']:>5} C={r['concurrency']:>4} {r['mode']:>14} b={r['budget'] or '-':>3} "
              f"agg={_fmt(r['agg_tok_s'], 9, 1)} tok/s (full batch {_fmt(r.get('full_batch_tok_s'), 9, 1).strip()})  "
              f"per-req={_fmt(r['per_req_tok_s'], 8, 1)}  "
              f"p50 tpot={_fmt(r['p50_tpot_ms'], 7, 2)} ms  acc={_fmt(r['mean_acceptance'], 4, 2)}{_paused(r)}{_waves(r)}  "
              f"{r['status']}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def _paused(row: dict) -> str:
    """A DDTree cell whose steps were not all tree steps: the scheduler paused speculation for
    part of it (its acceptance then counts those steps as 1, which read as a poor drafter)."""
    share = row.get("tree_step_share")
    if row["mode"] == "autoregressive" or share is None or share >= 1:
        return ""
    # at most 99: a share of 0.9996 read "trees 100% of steps" beside "speculation paused"
    return (f" (trees {min(round(share * 100), 99)}% of steps, {_fmt(row.get('tree_step_acceptance'), 4, 2).strip()} accepted a tree "
            "step: speculation paused, scheduler.spec_min_acceptance)")


def _waves(row: dict) -> str:
    """A cell the scheduler did not run all at once (its max_batch or KV cache below the concurrency)."""
    running = row.get("running_max")
    # Fewer than 3 readings of a cell of requests running for a while is no evidence either way.
    if running is None or running >= row["concurrency"] or row["status"] != "ok" or row.get("running_readings", 0) < 3:
        return ""
    return f" (at most {running} of {row['concurrency']} requests ran at once: the rest queued)"


def _copy_gbps() -> float | None:
    """The GPU's copy bandwidth, measured in this run (every GPU result file has it: BENCHMARKS.md, "Result files")."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from bench.common import measure_copy_gbps
    return round(measure_copy_gbps(), 1)


def _fmt(value: float | None, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else "-".rjust(width)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddtree", description="DDTree speculative decoding server")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start scheduler, draft and verifier as local processes")
    up.add_argument("--model", default=DEMO_MODEL, help="target checkpoint dir (drafter in <model>/drafter)")
    up.add_argument("--drafter", default=None, help="drafter checkpoint dir (default <model>/drafter)")
    up.add_argument("--config", default=None, help="TOML config file shared by the services")
    up.add_argument("--host", default="127.0.0.1",
                    help="scheduler host (the public API; 0.0.0.0 = every interface); draft and verifier stay on loopback")
    up.add_argument("--port", type=int, default=50051, help="scheduler port (the public API)")
    up.add_argument("--draft-replicas", type=int, default=1, help="draft processes in front of the verifier")
    up.add_argument("--tp", type=int, default=0, help="verifier tensor-parallel ranks (default: config, else 1)")
    up.add_argument("--startup-timeout", type=float, default=120.0, metavar="S",
                    help="seconds each service has to become healthy (default 120); a large model's verifier "
                    "needs longer (loading and compiling take minutes)")
    up.set_defaults(func=_cmd_up)

    gen = sub.add_parser("generate", help="call the running stack")
    gen.add_argument("--address", default="127.0.0.1:50051", help="the scheduler (default 127.0.0.1:50051)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--token-ids", action="store_true", help="--prompt is comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus cut (default 1: none)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut (default 0)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one)")
    gen.add_argument("--budget", type=int, default=0, help="tree budget 1..128 (0 = server default)")
    gen.add_argument("--mode", choices=["ddtree", "autoregressive"], default=None,
                     help="default: the server's (scheduler.default_mode, ddtree unless set)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--stop-token-ids", default=None, help="comma-separated token ids that end the output")
    gen.add_argument("--ignore-eos", action="store_true", help="generate past EOS, up to --max-tokens")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--json", action="store_true", help="print text, token ids and per-step acceptance")
    gen.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                     help=f"bearer token, when the server requires one (default: ${TOKEN_ENV}, which keeps it "
                     "out of the process list and the shell history)")
    gen.add_argument("--tls-ca", default=None, help="PEM file of the CA (or self-signed cert) to trust; enables TLS")
    gen.add_argument("--tls-server-name", default=None,
                     help="the name the server's certificate must hold, where it is not the --address host")
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="run one service in the foreground")
    serve.add_argument("service", choices=["scheduler", "draft", "verifier"])
    serve.add_argument("--config", default=None)
    serve.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                       help="a setting of this service, over the file and the environment (repeatable; "
                       "e.g. --set page_size=32; a list comma-separated)")
    serve.set_defaults(func=_cmd_serve)

    b = sub.add_parser("bench", help="the context x concurrency x mode matrix against a running stack")
    b.add_argument("--address", default="127.0.0.1:50051")
    b.add_argument("--tls-ca", default=None, help="PEM roots to trust: the scheduler speaks TLS")
    b.add_argument("--tls-server-name", default=None, help="the name its certificate holds, if not the address's")
    b.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                   help=f"the scheduler's bearer token (default: ${TOKEN_ENV})")
    b.add_argument("--contexts", type=int, nargs="+", default=[60, 1024])
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 64, 128])
    b.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32])
    b.add_argument("--max-tokens", type=int, default=512)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--draft-metrics", default="", help="host:port of the draft's /metrics (step-time split)")
    b.add_argument("--scheduler-metrics", default="",
                   help="host:port of the scheduler's /metrics (its loop time and the step round trip)")
    b.add_argument("--vocab-high", type=int, default=256, help="prompt ids are drawn below this")
    b.add_argument("--prompt-file", default="", help="JSON {'prompts': [{'ids': [...]}]} to cut prompts from "
                   "(default with --spawn-stack: <model>/heldout_prompts.json when present; else synthetic ids)")
    b.add_argument("--cell-timeout", type=float, default=300.0, help="seconds; a cell still running is cancelled")
    b.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds for warm-up and cells (0 = unbounded): the cell running at the end is cut "
                   "(timed_out), cells not started are recorded as skipped")
    b.add_argument("--warmup-tokens", type=int, default=8, help="tokens of the warm-up requests (0 = none)")
    b.add_argument("--no-power", action="store_true", help="do not sample GPU power (NVML / nvidia-smi)")
    b.add_argument("--power-gpus", default="", metavar="IDS",
                   help="GPUs whose power is sampled, comma-separated NVML indices or UUIDs (default: those "
                   "CUDA_VISIBLE_DEVICES names, else every GPU of this host)")
    b.add_argument("--commit", default="", help="commit to record (default: git HEAD, where there is a .git)")
    b.add_argument("--out", default="matrix-local.json",
                   help="result file, a PNG beside it (default: matrix-local.json here; the files under "
                   "bench/results/ are committed runs, named explicitly)")
    b.add_argument("--spawn-stack", default="", metavar="MODEL",
                   help="start scheduler, draft and verifier on MODEL here, sized for the matrix, and stop them after")
    b.add_argument("--device", default="cpu", help="with --spawn-stack: cpu or cuda")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="with --spawn-stack")
    b.add_argument("--stack-log", default=None, help="with --spawn-stack: file for the services' output")
    b.add_argument("--draft-replicas", type=int, default=1, metavar="N",
                   help="with --spawn-stack: draft replicas in front of the verifier, each with a batch of its own "
                   "in flight (the step-time split is the first replica's)")
    b.set_defaults(func=_cmd_bench)

    mk = sub.add_parser("make-checkpoint", help="write a small random target + drafter + tokenizer")
    mk.add_argument("out")
    mk.add_argument("--vocab-size", type=int, default=512,
                    help=f"tokenizer vocabulary, 258..{MAX_RANDOM_VOCAB} (default 512)")
    mk.add_argument("--seed", type=int, default=0, help="weights' seed (default 0)")
    mk.add_argument("--bf16-experts", action="store_true", help="routed experts unquantized")
    mk.add_argument("--force", action="store_true", help="replace a checkpoint already in DIR")
    mk.set_defaults(func=_cmd_make_checkpoint)

    tk = sub.add_parser("make-token", help="write a random internal token for draft and verifier ports "
                        "(kept if the file exists)")
    tk.add_argument("path")
    tk.set_defaults(func=_cmd_make_token)
    for command in sub.choices.values():
        command.set_defaults(command_parser=command)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # a subcommand's own flag: its usage, not the top level's list of subcommands
        given = sys.argv[1:] if argv is None else list(argv)
        before = given[:given.index(args.command)] if args.command in given else given
        (parser if set(extra) & set(before) else args.command_parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
