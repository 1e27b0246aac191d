"""Client SDK: synchronous `Client` and asyncio `AsyncClient` for the scheduler's public API.

    with Client("127.0.0.1:50051") as c:
        print(c.generate("def fibonacci(n):", max_tokens=64).text)
        for chunk in c.stream("import os", max_tokens=32):
            print(chunk.text, end="")
        with c.stream("class Stack:", max_tokens=512) as s:   # kept in a variable: `with` it, or close() it
            first = next(s)

Errors from the server raise `ClientError` carrying the gRPC status code, the server's message and
whether the same request may succeed later (`retryable`); arguments that cannot form a request raise
it too, with INVALID_ARGUMENT, when the call is made and before anything is sent.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import math
import numbers
import random
import struct
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field

import grpc

from ddtree.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["Client", "AsyncClient", "Stream", "AsyncStream", "ClientError", "Chunk", "Completion", "Usage",
           "address_error", "build_request", "ABORT_TIMEOUT_S"]

_MODES = {"ddtree": common_pb2.MODE_DDTREE, "autoregressive": common_pb2.MODE_AUTOREGRESSIVE, None: 0}
_FINISH = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in scheduler_pb2.FinishReason.items()}
# Past this a deadline overflows gRPC's int64 nanoseconds (~9.2e9 s) and fails the call at once.
MAX_TIMEOUT_S = 1e9
# The scheduler's word on a failed call, in its trailing metadata: "true" where the same request may
# succeed later as it is (`ClientError.retryable`).
RETRYABLE_METADATA = "ddtree-retryable"
# And "true" where the request never ran on a replica (refused at admission, failed while queued, or
# its first step found no connection to its replica):
# what a wait_for_ready stream sends again by itself (`_send_again`).
REFUSED_METADATA = "ddtree-refused"
# A wait_for_ready stream refused UNAVAILABLE before its request ran on a replica tries again after
# this, doubling up to RETRY_MAX_S (each wait 0.8-1.2x, so clients refused together do not come back together).
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 1.0

# abort()'s deadline where neither the call nor the client names one: an abort is one short call, and
# without a deadline one to a server that stopped answering (a frozen process) waited forever.
ABORT_TIMEOUT_S = 10.0


class _Unset(enum.Enum):
    """`timeout_s` not passed: the client's own applies (None passed means no deadline)."""

    UNSET = "unset"

    def __repr__(self) -> str:
        return "<the client's timeout_s>"


_UNSET = _Unset.UNSET


class ClientError(Exception):
    """A call's failure: ``code`` (a `grpc.StatusCode`) and ``message`` (the server's details, or
    the client's reason where nothing was sent).

    ``retryable``: whether sending the same request again later may succeed. The scheduler says
    so where it refused or failed the request for its own state (no draft replica up, a full queue
    or cache, a stop: UNAVAILABLE or RESOURCE_EXHAUSTED), and not for what no retry mends (a bad
    field, a request over gRPC's message limit, a prompt that killed its tokenizer). Where no
    scheduler answered (the connection failed: UNAVAILABLE from gRPC itself) it is True, as gRPC
    means that code; a TLS mismatch fails that way too, so bound the retries. False for anything
    the client refused before sending, and for a passed deadline.

    ``partial``: from `generate`, what the request produced before it failed (a `Completion`,
    ``finish_reason`` None; empty where nothing came); None from other calls."""

    def __init__(self, code: grpc.StatusCode, message: str, retryable: bool | None = None,
                 partial: Completion | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retryable = code == grpc.StatusCode.UNAVAILABLE if retryable is None else retryable   # None: gRPC's meaning
        self.partial = partial

    def __reduce__(self) -> tuple:
        # Pickled as its fields: a process pool's worker that raised it broke the pool
        # (Exception's default rebuilds from args, the one formatted string).
        return type(self), (self.code, self.message, self.retryable, self.partial)


@dataclass
class Usage:
    """The server's count for a finished request (the last chunk carries it)."""

    prompt_tokens: int
    completion_tokens: int
    steps: int                 # verify steps (the prefill's first token is not one)
    mean_acceptance: float     # tokens a verify step, bonus token included
    tree_steps: int = 0        # of `steps`, those verified with a draft tree (others: autoregressive mode, or paused)


@dataclass
class Chunk:
    """One streamed message: the new tokens and text, the acceptance length of each step, and (the
    last one) why it finished and the usage."""

    request_id: str
    token_ids: list[int]
    text: str
    acceptance_lengths: list[int]
    finish_reason: str | None
    usage: Usage | None = None


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens if self.usage else 0

    @property
    def mean_acceptance(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    def add(self, chunk: Chunk) -> None:
        self.request_id = chunk.request_id
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.acceptance_lengths += chunk.acceptance_lengths
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage


def build_request(prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float | None = 0.0,
                  top_p: float | None = 1.0, top_k: int | None = 0, seed: int | None = None, budget: int = 0,
                  mode: str | None = None, stop: str | Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  ignore_eos: bool = False, request_id: str = "") -> scheduler_pb2.GenerateRequest:
    """A GenerateRequest; `prompt` is text or a list of token ids; budget 0 = server default.
    `stop` is one string or several. Raises `ClientError` (INVALID_ARGUMENT) naming the argument
    that cannot be sent: a value outside its wire type's range, a non-integer token id, text that
    is not valid Unicode."""
    if not (mode is None or isinstance(mode, str)) or mode not in _MODES:   # a list: TypeError (unhashable)
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"mode must be 'ddtree' or 'autoregressive', not {mode!r}")
    if not isinstance(ignore_eos, bool):
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"ignore_eos must be True or False, not {ignore_eos!r}")
    _check_types(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, budget=budget, max_tokens=max_tokens,
                 request_id=request_id)
    stops = [stop] if isinstance(stop, str) else _listed("stop", stop)
    for x in stops:
        if not isinstance(x, str):
            raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"stop: each stop must be text, got {x!r}")
    stop_token_ids = _listed("stop_token_ids", stop_token_ids)
    texts = [prompt] if isinstance(prompt, str) else []
    ids = [] if isinstance(prompt, str) else _listed("prompt", prompt)
    for name, values in (("prompt", ids), ("stop_token_ids", stop_token_ids)):
        bad = next((t for t in values if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
        if bad is not None:
            raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: token ids must be integers, got {bad!r}")
    req = scheduler_pb2.GenerateRequest(mode=_MODES[mode], ignore_eos=ignore_eos)
    if seed is not None and not 0 <= seed < 2**64:   # protobuf's own word: "Value out of range: -1"
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"seed must be in 0..{2**64 - 1} (got {seed})")
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if value is not None:
            _put(name, setattr, req.sampling, name, value)
    for name, value in (("temperature", temperature), ("top_p", top_p)):   # float32 on the wire
        sent = getattr(req.sampling, name)
        if value is not None and math.isfinite(value) and value != 0 and (sent == 0 or math.isinf(sent)):
            # 1e-50 would arrive as 0 (greedy; no nucleus cut), 1e39 as inf: not what was asked.
            raise ClientError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{name} = {value!r} is sent as a float32 and would arrive as {sent}")
    for name, value in (("max_tokens", max_tokens), ("budget", budget), ("request_id", request_id)):
        _put(name, setattr, req, name, value)
    _put("stop", req.stop.extend, stops)
    _put("stop_token_ids", req.stop_token_ids.extend, [int(t) for t in stop_token_ids])
    if texts:
        _put("prompt", setattr, req, "text", prompt)
    else:
        _put("prompt", req.token_ids.ids.extend, [int(t) for t in ids])
    for name, strings in (("request_id", [request_id]), ("stop", stops), ("prompt", texts)):
        for s in strings:  # text that is not valid Unicode would fail inside gRPC, unnamed
            _put(name, s.encode, "utf-8")
    return req


_NUMBERS = {"temperature": (numbers.Real, "a number"), "top_p": (numbers.Real, "a number"),
            "top_k": (numbers.Integral, "an integer"), "seed": (numbers.Integral, "an integer or None"),
            "budget": (numbers.Integral, "an integer"), "max_tokens": (numbers.Integral, "an integer")}


def _check_types(**values: object) -> None:
    """Each sampling or size argument of its kind, a bool never (True would be sent as 1), and
    ``request_id`` text: protobuf's own refusal names no argument ("bad argument type")."""
    for name, value in values.items():
        if name == "request_id":
            if not isinstance(value, str):
                raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"request_id must be text, not {value!r}")
            continue
        if value is None and name in ("temperature", "top_p", "top_k", "seed"):
            continue   # the server's default
        kind, want = _NUMBERS[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be {want}, not {value!r}")


def _listed(name: str, value) -> list:
    """``value`` (None: nothing, except for the prompt) as a list: any iterable but text and bytes,
    which would otherwise pass as characters or as token ids (b"hi" is [104, 105]), and a mapping
    (a dict passed as its keys); a set only where order does not matter (stop rules, not the prompt)."""
    if value is None and name != "prompt":
        return []
    if (isinstance(value, (str, bytes, bytearray, memoryview, Mapping)) or not hasattr(value, "__iter__")
            or (name == "prompt" and isinstance(value, Set))):
        want = "text or a list of token ids" if name == "prompt" else "a list"
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be {want}, not {type(value).__name__}")
    return list(value)


def _put(name: str, fn, *args) -> None:
    """``fn(*args)``, one argument's way into the message; what protobuf refuses names that argument."""
    try:
        fn(*args)
    except (ValueError, TypeError) as exc:
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"cannot send this request ({name}): {exc}") from None


def _chunk(msg: scheduler_pb2.GenerateResponse) -> Chunk:
    usage = None
    if msg.HasField("usage"):
        u = msg.usage
        usage = Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, steps=u.steps,
                      mean_acceptance=_float32_shortest(u.mean_acceptance), tree_steps=u.tree_steps)
    return Chunk(request_id=msg.request_id, token_ids=list(msg.token_ids), text=msg.text,
                 acceptance_lengths=list(msg.acceptance_lengths),
                 finish_reason=_finish(msg.finish_reason), usage=usage)


def _float32_shortest(value: float) -> float:
    """The fewest decimal digits that are still the wire's float32: protobuf widens a float field
    to the double nearest it, so a mean of 2.072 read back as 2.0720720291137695, beside the
    exact mean the client computes from the same steps."""
    packed = struct.pack("<f", value)
    for digits in range(1, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == packed:
            return short
    return value


def _finish(value: int) -> str | None:
    """The finish reason's name; a newer server's reason this client does not know as
    ``"unknown(N)"`` (a KeyError from inside the stream's read before)."""
    if not value:
        return None
    return _FINISH.get(value, f"unknown({value})")


def _error(exc: grpc.RpcError) -> ClientError:
    """``exc`` as a `ClientError`, retryable as the scheduler's trailing metadata says (where none
    came, a connection's UNAVAILABLE is)."""
    said = _said(exc, RETRYABLE_METADATA)
    return ClientError(exc.code(), exc.details() or "", None if said is None else said == "true")


def _said(exc: grpc.RpcError, key: str) -> str | None:
    """The value of ``key`` in the call's trailing metadata, None where it has none."""
    trailing = getattr(exc, "trailing_metadata", lambda: None)() or ()
    return next((v for k, v in trailing if k == key), None)


class _Retries:
    """A wait_for_ready stream's retries of a request the scheduler refused UNAVAILABLE before it ran
    on a replica (stopping, no draft replica up, or failed while queued): gRPC's wait_for_ready
    waits only for a connection, and a client told it waits for a restart failed at once. Not a
    request that failed after it started (a replica lost under it; one the request itself may
    have crashed), nor one whose connection broke (the server may still run it). Bounded by the
    stream's deadline (none: until closed)."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self._deadline: float | None = None
        self._wait = RETRY_FIRST_S
        self._refused: ClientError | None = None   # the last refusal

    def left(self) -> float | None:
        """The time left of the deadline for the next attempt (the whole timeout at the first);
        raises DEADLINE_EXCEEDED naming the last refusal where none is left (a wait overslept)."""
        if self.timeout is None:
            return None
        if self._deadline is None:
            self._deadline = time.monotonic() + self.timeout
        left = self._deadline - time.monotonic()
        if left <= 0 and self._refused is not None:
            raise self._expired()
        return left

    def pause(self, err: ClientError) -> float:
        """How long to wait before the next attempt; raises DEADLINE_EXCEEDED (naming ``err``) where
        the deadline comes first."""
        self._refused = err
        wait, self._wait = self._wait * random.uniform(0.8, 1.2), min(self._wait * 2, RETRY_MAX_S)
        left = self.left()
        if left is not None and left <= wait:
            raise self._expired()
        return wait

    def _expired(self) -> ClientError:
        message = self._refused.message if self._refused is not None else ""
        return ClientError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"the deadline ({self.timeout:g} s) passed while the scheduler refused the request, "
                           f"waiting for it to be ready (wait_for_ready): {message}")


def _start_call(start: Callable[..., object], retries: _Retries | None):
    """``start()``, or with a wait_for_ready stream's retries ``start`` with the deadline's time left."""
    return start() if retries is None else start(retries.left())


def _send_again(exc: grpc.RpcError, err: ClientError, retries: _Retries | None, answered: bool) -> bool:
    return (retries is not None and not answered and err.code == grpc.StatusCode.UNAVAILABLE and err.retryable
            and _said(exc, REFUSED_METADATA) == "true")


def _timeout(value: object) -> float | None:
    """`value` as a gRPC deadline: a positive, finite number of seconds, or None (no deadline).
    gRPC fails a call at once with an unnamed DEADLINE_EXCEEDED for 0, a negative number, NaN and
    even infinity, and a string breaks inside it as a TypeError at the first read."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value <= 0 or value > MAX_TIMEOUT_S):
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"timeout_s must be a positive number of seconds up to {MAX_TIMEOUT_S:g}, or None "
                          f"(no deadline), not {value!r}")
    return float(value)


_PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"


# Pings while a call is open, so that a call to a scheduler whose host vanished without closing
# the connection (a crash, a cut network: no FIN) ends UNAVAILABLE within about 30 s; without them
# a call with no deadline waited for good. The scheduler's servers take pings this often
# (`services.common.grpc_server.keepalive_options`); kept here so the SDK imports only grpc.
# max_pings_without_data 0: a streaming call sends no data after its request, and gRPC's default
# (two pings, then one a minute) took about 70 s to find a vanished host.
_KEEPALIVE = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
              ("grpc.http2.ping_timeout_ms", 10_000), ("grpc.http2.max_pings_without_data", 0)]


def _channel_args(tls_ca: str | bytes | None, token: str | None,
                  tls_server_name: str | None) -> tuple[grpc.ChannelCredentials | None, list]:
    """TLS credentials (a CA file path or PEM bytes; b"" trusts the system roots), the bearer
    token, and channel options. A server that restarts is reached again within about a second:
    gRPC's default reconnect back-off grows towards two minutes, and a long-lived client kept
    failing UNAVAILABLE for seconds after the scheduler was back. (Not `min_reconnect_backoff_ms`:
    that is the time a connection attempt may take, and a short one fails far clients.)

    A CA that holds no PEM certificate (a key, a DER file, the wrong path's contents) is refused
    here by name: gRPC takes it and fails every call's handshake with an error naming nothing. So
    is `tls_server_name` without `tls_ca`, which a plaintext channel would silently ignore."""
    creds = None
    options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000), *_KEEPALIVE]
    if tls_server_name and tls_ca is None:
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"tls_server_name ({tls_server_name!r}) needs tls_ca: without it the channel is "
                          "plaintext and has no server name to check")
    if tls_ca is not None:
        if isinstance(tls_ca, bytes):
            roots, what = tls_ca, "the tls_ca bytes"
        else:
            try:
                with open(tls_ca, "rb") as fh:
                    roots = fh.read()
            except OSError as exc:
                raise ClientError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"tls_ca: cannot read {tls_ca}: {exc.strerror}") from None
            what = str(tls_ca)
        if (roots or not isinstance(tls_ca, bytes)) and _PEM_CERTIFICATE not in roots:
            raise ClientError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"tls_ca: {what} is not a PEM certificate (no {_PEM_CERTIFICATE.decode()} line)")
        creds = grpc.ssl_channel_credentials(root_certificates=roots or None)
        if token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
    return creds, options


class Stream(Iterator[Chunk]):
    """The chunks of one `Client.stream` call: an iterator, and a context manager whose exit (as
    `close()`) cancels the request on the server.

    The call starts at the first chunk read; reading it to its end, an error and an exception
    while waiting (Ctrl-C) end it. A stream left early goes on decoding on the server, holding a
    batch slot and KV, until it is closed: `for chunk in c.stream(...): break` closes it as the
    loop drops the stream, but one kept in a variable lives as long as the variable, so use
    `with c.stream(...) as s:` or call `s.close()`.

    Threads may share one stream: each read takes the next chunk (reads wait their turn; gRPC's
    call failed two at once with a ValueError and ended the stream for the others)."""

    def __init__(self, start: Callable[..., grpc.Call], *, retries: _Retries | None = None,
                 client_closed: Callable[[], bool] = lambda: False) -> None:
        self._start = start   # with `retries`, called with the deadline's time left
        self._retries = retries
        self._client_closed = client_closed
        self._call: grpc.Call | None = None
        self._closed = False
        self._answered = False   # a chunk came: the request is not sent again
        self._woken = threading.Event()   # close() ends a retry's wait
        self._reading = threading.Lock()

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        with self._reading:
            return self._next()

    def _next(self) -> Chunk:
        while not self._closed:
            try:
                if self._call is None:
                    self._call = _start_call(self._start, self._retries)
                    if self._closed:   # closed from another thread while the call was being made
                        self._call.cancel()
                msg = next(self._call)
            except grpc.RpcError as exc:
                closed_here = self._closed   # close() from another thread: the reader ends, as at the end
                err = _error(exc)
                if not closed_here and _send_again(exc, err, self._retries, self._answered):
                    try:
                        wait = self._retries.pause(err)
                    except ClientError:
                        self.close()
                        raise
                    self._call = None
                    try:
                        self._woken.wait(wait)
                    except BaseException:   # Ctrl-C while waiting
                        self.close()
                        raise
                    if self._client_closed() and not self._closed:   # as a closed client says it to a read
                        self.close()
                        raise _closed_under("stream")
                    continue
                self.close()
                if closed_here:   # its cancel, or a failure that crossed it (a retry's refusal): moot now
                    raise StopIteration from None
                if exc.code() == grpc.StatusCode.CANCELLED and self._client_closed():   # as AsyncClient says it
                    raise _closed_under("stream") from None
                raise err from None
            except BaseException:
                self.close()
                raise
            self._answered = True
            return _chunk(msg)
        raise StopIteration

    def close(self) -> None:
        """Cancels the request on the server (nothing where it has ended); later reads end at once."""
        self._closed = True
        self._woken.set()
        if self._call is not None:
            self._call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # An inline `for ... in c.stream(...): break` drops the stream here: its request ends now.
        if getattr(self, "_call", None) is not None and not self._closed:
            self._call.cancel()


class AsyncStream(AsyncIterator[Chunk]):
    """The chunks of one `AsyncClient.stream` call: an async iterator, and an async context manager
    whose exit (as `aclose()`) cancels the request on the server.

    As with `Stream`, a loop over an inline `c.stream(...)` that breaks ends the request as the
    stream is dropped, but `break` closes no (async) iterator: a stream kept in a variable runs on
    until `async with c.stream(...) as s:` exits or `await s.aclose()`."""

    def __init__(self, start: Callable[..., grpc.aio.UnaryStreamCall], *,
                 client_closed: Callable[[], bool] = lambda: False, retries: _Retries | None = None) -> None:
        self._start = start   # with `retries`, called with the deadline's time left
        self._client_closed = client_closed
        self._retries = retries
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._closed = False
        self._answered = False   # a chunk came: the request is not sent again
        self._woken = asyncio.Event()   # aclose() ends a retry's wait
        self._read_cancelled = False   # a read's task was cancelled: the request ended with it
        self._reading = asyncio.Lock()   # two tasks reading at once: one waited for ever

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        async with self._reading:
            return await self._next()

    async def _next(self) -> Chunk:
        while True:
            if self._closed:
                if self._read_cancelled:   # not the output's end: an idle timeout (wait_for) cut it
                    raise ClientError(grpc.StatusCode.CANCELLED, "an earlier read of this stream was cancelled, "
                                      "which cancelled its request; its output is incomplete")
                raise StopAsyncIteration
            try:
                msg = await self._read()
            except _Retry as retry:
                try:
                    await asyncio.wait_for(self._woken.wait(), retry.wait)
                except TimeoutError:
                    pass
                except asyncio.CancelledError:   # the task cancelled while waiting: as during a read
                    self._cancel()
                    self._read_cancelled = _cancelling()
                    raise
                if self._client_closed() and not self._closed:   # as a closed client says it to a read
                    self._cancel()
                    raise _closed_under("stream")
                continue
            if msg is grpc.aio.EOF:
                self._closed = True
                raise StopAsyncIteration
            self._answered = True
            return _chunk(msg)

    async def _read(self) -> object:
        """The call's next message (started here at first); raises `_Retry` where a wait_for_ready
        stream is to send its request again."""
        try:
            if self._call is None:
                self._call = _start_call(self._start, self._retries)
            return await self._call.read()
        except BaseException as exc:
            closed_here = self._closed
            if isinstance(exc, grpc.RpcError):
                err = _error(exc)
                if not closed_here and _send_again(exc, err, self._retries, self._answered):
                    try:
                        wait = self._retries.pause(err)
                    except ClientError:
                        self._cancel()
                        raise
                    self._call = None
                    raise _Retry(wait) from None
            self._cancel()
            self._read_cancelled = isinstance(exc, asyncio.CancelledError) and _cancelling()
            if isinstance(exc, grpc.RpcError):
                if closed_here:   # a failure that crossed aclose() (a retry's refusal): moot now
                    raise StopAsyncIteration from None
                raise err from None
            # aclose() from another task: gRPC raises CancelledError in this reader, which no one cancelled.
            if closed_here and isinstance(exc, asyncio.CancelledError) and not _cancelling():
                raise StopAsyncIteration from None
            # The client closed under the stream: as `Client` says it, not a cancellation of this task.
            if isinstance(exc, asyncio.CancelledError) and not _cancelling() and self._client_closed():
                raise _closed_under("stream") from None
            raise

    def _cancel(self) -> None:
        self._closed = True
        self._woken.set()
        if self._call is not None:
            self._call.cancel()

    async def aclose(self) -> None:
        """Cancels the request on the server (nothing where it has ended); later reads end at once."""
        self._cancel()
        self._read_cancelled = False

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._cancel()

    def __del__(self) -> None:
        # An inline `async for ... in c.stream(...): break` drops the stream here: its request ends
        # now (gRPC's own call is not collected at once, and went on decoding to max_tokens).
        if getattr(self, "_call", None) is not None and not self._closed:
            self._call.cancel()


class _Retry(Exception):
    """An `AsyncStream` read's word that its request goes again after ``wait`` seconds."""

    def __init__(self, wait: float) -> None:
        super().__init__(wait)
        self.wait = wait


def _closed_under(what: str) -> ClientError:
    """A stream or call the client's close ended, said the same way by `Client` and `AsyncClient`."""
    return ClientError(grpc.StatusCode.CANCELLED, f"the client was closed while this {what} was open")


def _cancelling() -> bool:
    """Whether the running task is being cancelled (then its CancelledError must go on)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _abort_request(request_id: str) -> scheduler_pb2.AbortRequest:
    if not isinstance(request_id, str):   # protobuf's TypeError, or None read as "", found nothing
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"request_id must be text, not {request_id!r}")
    return scheduler_pb2.AbortRequest(request_id=request_id)


def _check_open(closed: bool) -> None:
    if closed:  # gRPC's own error here is a ValueError or its UsageError, not a status
        raise ClientError(grpc.StatusCode.FAILED_PRECONDITION, "this client is closed")


def _check_token(token: str | None) -> None:
    # An HTTP/2 header value: gRPC itself would fail each call with INTERNAL ("Illegal header value").
    if token is not None and (not isinstance(token, str) or not all(" " <= c <= "~" for c in token)):
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT,
                          "token must be text of printable ASCII characters (it is sent in a header)")


def _warn_token_in_clear(address: str, token: str | None, tls_ca: str | bytes | None) -> None:
    """A token sent without TLS to another host can be read on the way: said once, not refused
    (a private network may be what the user has)."""
    if not token or tls_ca is not None or address.startswith(("unix:", "unix-abstract:")) or _loopback(address):
        return
    warnings.warn(f"the bearer token goes to {address} without TLS: anyone on the way can read it "
                  "(tls_ca= makes the channel TLS)", stacklevel=4)   # the line that made the client


def _metadata(tls_ca, token) -> tuple:
    # Over TLS the token rides in call credentials; plaintext (loopback) sends it as metadata.
    return (("authorization", f"Bearer {token}"),) if token and tls_ca is None else ()


class _Calls:
    """What `Client` and `AsyncClient` share: the channel's set-up and each call's deadline."""

    def __init__(self, address: str, timeout_s: float | None, wait_for_ready: bool, tls_ca: str | bytes | None,
                 token: str | None, tls_server_name: str | None) -> None:
        why = address_error(address)
        if why:
            raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"address {why}")
        self.timeout_s = _timeout(timeout_s)
        if not isinstance(wait_for_ready, bool):   # "no" read as true
            raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"wait_for_ready must be True or False, not {wait_for_ready!r}")
        self.wait_for_ready = wait_for_ready
        _check_token(token)
        self._creds, self._options = _channel_args(tls_ca, token, tls_server_name)
        self._md = _metadata(tls_ca, token)
        self._closed = False
        _warn_token_in_clear(address, token, tls_ca)

    def _deadline(self, timeout_s: float | None | _Unset) -> float | None:
        return self.timeout_s if timeout_s is _UNSET else _timeout(timeout_s)

    def _short_deadline(self, timeout_s: float | _Unset, call: str) -> float:
        """A short call (abort, model_info) always has one: the call's, else the client's, else
        ABORT_TIMEOUT_S; without one, a call to a server that stopped answering waited forever."""
        if timeout_s is _UNSET:
            return self.timeout_s if self.timeout_s is not None else ABORT_TIMEOUT_S
        if timeout_s is None:
            raise ClientError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{call}'s timeout_s must be a positive number of seconds (it is always bounded)")
        return _timeout(timeout_s)


# gRPC target schemes an address may carry; other "scheme://" forms (http://) are no gRPC target.
_TARGET_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:")


def address_error(address: str) -> str | None:
    """Why ``address`` is no HOST:PORT (or gRPC target), or None: gRPC took "http://host:1", and
    "host" as port 443, and failed later with UNAVAILABLE, which read as "is it running?"."""
    if not isinstance(address, str):
        return f"must be a HOST:PORT string, got {type(address).__name__}"
    if address.startswith(("unix:", "unix-abstract:")):
        return None
    if any(c.isspace() for c in address):   # " host:1" (an env file's) failed later, UNAVAILABLE "Misformatted"
        return f"has white space in it: {address!r}"
    if address.startswith(_TARGET_SCHEMES):
        for host, port in _hosts_ports(address):
            if address.startswith("dns:") and not port:   # gRPC dialled 443, as for a bare "host"
                return f"must name its port (dns:HOST:PORT), got {address!r}"
            if port and (not port.isdigit() or not 0 < int(port) < 65536):
                return f"has no TCP port (1..65535) in {address!r}"
        return None
    if "://" in address:
        return f"takes HOST:PORT, not a URL: {address!r}"
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return f"must be HOST:PORT (e.g. 127.0.0.1:50051), got {address!r}"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):   # gRPC took it all as a host name
        return f"an IPv6 address goes in brackets, [ADDRESS]:PORT (e.g. [::1]:50051), got {address!r}"
    if not 0 < int(port) < 65536:   # gRPC dialled the port modulo 65536: :99999 reached :34463
        return f"has no TCP port (1..65535) in {address!r}"
    return None


def _hosts_ports(address: str) -> list[tuple[str, str]]:
    """The hosts and ports ("" when none) of a TCP address, with or without a gRPC target scheme
    (``dns://authority/`` included); every entry of an ``ipv4:`` / ``ipv6:`` list."""
    rest = address
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if rest.startswith(scheme):
            rest = rest[len(scheme):]
            if rest.startswith("//"):
                rest = rest[2:].partition("/")[2]
            break
    out = []
    for entry in rest.split(","):
        if entry.startswith("["):   # [v6]:port
            host, _, after = entry[1:].partition("]")
            out.append((host, after.removeprefix(":")))
        elif entry.count(":") > 1:   # a bare IPv6 address (ipv6:::1): no port
            out.append((entry, ""))
        else:
            host, _, port = entry.partition(":")
            out.append((host, port))
    return out


def _loopback(address: str) -> bool:
    """Whether a TCP address names this host alone ("localhost" or loopback IPs, by value: a DNS
    name that starts with "127." is no loopback; a list, only if every entry is)."""
    def one(host: str) -> bool:
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False
    return all(one(host) for host, _ in _hosts_ports(address))


class Client(_Calls):
    """`wait_for_ready=False` (default) fails at once with UNAVAILABLE when no server is listening;
    True waits for the server to come up, bounded by `timeout_s` (each call's deadline in seconds;
    None: streams have none, `abort` and `model_info` take ABORT_TIMEOUT_S), and a stream the
    scheduler refuses UNAVAILABLE before its request ran on a replica (stopping, no draft replica
    up) sends its request again until it is taken or the deadline passes (`_Retries`). `tls_ca` is a CA certificate's PEM
    file (or its bytes; b"" trusts the system roots) and makes the channel TLS; `tls_server_name`
    is the name to check the server's certificate for, where it is not the address's host.
    Raises `ClientError` (INVALID_ARGUMENT) for an address that is no HOST:PORT (or gRPC target such
    as `unix:/path`), a timeout that is no positive number, a `tls_ca`
    that cannot be read or is no PEM certificate, and `tls_server_name` without `tls_ca`."""

    def __init__(self, address: str, timeout_s: float | None = None, wait_for_ready: bool = False, *,
                 tls_ca: str | bytes | None = None, token: str | None = None,
                 tls_server_name: str | None = None) -> None:
        super().__init__(address, timeout_s, wait_for_ready, tls_ca, token, tls_server_name)
        self._channel = (grpc.secure_channel(address, self._creds, self._options) if self._creds
                         else grpc.insecure_channel(address, self._options))
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float | None = 0.0,
               top_p: float | None = 1.0, top_k: int | None = 0, seed: int | None = None, budget: int = 0,
               mode: str | None = None, stop: str | Sequence[str] = (), stop_token_ids: Sequence[int] = (),
               ignore_eos: bool = False, request_id: str = "",
               timeout_s: float | None | _Unset = _UNSET) -> Stream:
        """Generates from `prompt`, a `Chunk` at a time as the server sends them.

        prompt: text (the server tokenizes it) or a list of token ids.
        max_tokens: the most tokens to generate (fewer where the context ends first: "length").
        temperature: 0 is greedy; else between 1e-6 and 1e4. top_p, top_k: nucleus and top-k cuts
            of the sampled distribution (1.0 and 0: none). None leaves one unset: greedy, no cut.
        seed: reproduces a sampled output for the same prompt and sampling parameters, whatever the
            mode and budget (in bfloat16 only beside the same requests: README); None: random.
        budget: draft-tree nodes a verify step, 1..128; 0: the server's default.
        mode: "ddtree" (speculative) or "autoregressive" (a token a step); None: the server's default.
        stop: one string or several; the text ends before the first one completed.
        stop_token_ids: ids that end the output (kept in token_ids, not in the text).
        ignore_eos: go on past the model's end-of-sequence ids.
        request_id: the id `abort()` takes, unique among running requests; "": the server picks
            one (each chunk's `request_id`).
        timeout_s: a deadline for the whole stream in seconds; None: none; not given: the client's.

        Returns a `Stream`, read by iterating it. Leaving a loop over an inline
        `c.stream(...)` early cancels the request; a stream kept in a variable is cancelled when
        it is closed: use `with c.stream(...) as s:` or `s.close()`, or it runs on the server
        until the variable goes.

        Raises `ClientError` at this call for what cannot be sent or has no meaning
        (INVALID_ARGUMENT, naming the argument) and on a closed client (FAILED_PRECONDITION), a
        misspelt argument's TypeError too; while reading, the server's refusals and failures
        (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ALREADY_EXISTS, UNAVAILABLE, UNAUTHENTICATED, ...)
        and DEADLINE_EXCEEDED when `timeout_s` passes."""
        _check_open(self._closed)
        req = build_request(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, budget=budget, mode=mode, stop=stop, stop_token_ids=stop_token_ids,
                            ignore_eos=ignore_eos, request_id=request_id)
        timeout = self._deadline(timeout_s)

        def start(left: float | None = None) -> grpc.Call:
            _check_open(self._closed)
            return self._stub.Generate(req, timeout=timeout if left is None else left,
                                       wait_for_ready=self.wait_for_ready, metadata=self._md)
        return Stream(start, retries=_Retries(timeout) if self.wait_for_ready else None,
                      client_closed=lambda: self._closed)

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float | None = 0.0,
                 top_p: float | None = 1.0, top_k: int | None = 0, seed: int | None = None, budget: int = 0,
                 mode: str | None = None, stop: str | Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                 ignore_eos: bool = False, request_id: str = "",
                 timeout_s: float | None | _Unset = _UNSET) -> Completion:
        """The whole output of `stream` with the same arguments (its docstring says each), as one
        `Completion`. Raises what `stream` raises; an error ends the request on the server, and the
        output that came before it is the error's ``partial``."""
        out = Completion(request_id=request_id)
        try:   # an argument refused before anything is sent fails with an empty partial too
            chunks = self.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 seed=seed, budget=budget, mode=mode, stop=stop, stop_token_ids=stop_token_ids,
                                 ignore_eos=ignore_eos, request_id=request_id, timeout_s=timeout_s)
            with chunks:
                for chunk in chunks:
                    out.add(chunk)
        except ClientError as exc:
            exc.partial = out
            raise
        return out

    def abort(self, request_id: str, *, timeout_s: float | _Unset = _UNSET) -> bool:
        """Ends the running or queued request `request_id` (its stream ends "aborted"); False where
        no such request runs. Waits at most `timeout_s` (not given: the client's timeout_s, else
        ABORT_TIMEOUT_S), then raises `ClientError` DEADLINE_EXCEEDED; UNAVAILABLE when no server
        is reached (and `wait_for_ready` is False)."""
        _check_open(self._closed)
        timeout = self._short_deadline(timeout_s, "abort")
        try:
            return self._stub.Abort(_abort_request(request_id), timeout=timeout,
                                    wait_for_ready=self.wait_for_ready, metadata=self._md).found
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def model_info(self, *, timeout_s: float | _Unset = _UNSET) -> common_pb2.ModelInfo:
        """The served model's limits; waits at most `timeout_s` (not given: the client's timeout_s,
        else ABORT_TIMEOUT_S)."""
        _check_open(self._closed)
        timeout = self._short_deadline(timeout_s, "model_info")
        try:
            return self._stub.GetModelInfo(common_pb2.GetModelInfoRequest(), wait_for_ready=self.wait_for_ready,
                                           metadata=self._md, timeout=timeout)
        except grpc.RpcError as exc:
            raise _error(exc) from None


class AsyncClient(_Calls):
    """The asyncio twin of `Client` (the same arguments and errors), for many concurrent streams
    from one process. Make it inside the event loop that uses it (in a coroutine: `async with
    AsyncClient(...) as c:`), and use it in that loop only: its channel belongs to one loop, and
    elsewhere gRPC failed with RuntimeErrors ("attached to a different loop", "Event loop is
    closed"). Both are refused with `ClientError` FAILED_PRECONDITION."""

    def __init__(self, address: str, timeout_s: float | None = None, wait_for_ready: bool = False, *,
                 tls_ca: str | bytes | None = None, token: str | None = None,
                 tls_server_name: str | None = None) -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            raise ClientError(grpc.StatusCode.FAILED_PRECONDITION,
                              "AsyncClient must be made inside a running event loop (in a coroutine), "
                              "the one that uses it") from None
        super().__init__(address, timeout_s, wait_for_ready, tls_ca, token, tls_server_name)
        self._channel = (grpc.aio.secure_channel(address, self._creds, self._options) if self._creds
                         else grpc.aio.insecure_channel(address, self._options))
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    def _check_usable(self) -> None:
        _check_open(self._closed)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not self._loop:
            raise ClientError(grpc.StatusCode.FAILED_PRECONDITION,
                              "this AsyncClient belongs to another event loop: make one in each loop that uses it")

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        await self._channel.close()

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float | None = 0.0,
               top_p: float | None = 1.0, top_k: int | None = 0, seed: int | None = None, budget: int = 0,
               mode: str | None = None, stop: str | Sequence[str] = (), stop_token_ids: Sequence[int] = (),
               ignore_eos: bool = False, request_id: str = "",
               timeout_s: float | None | _Unset = _UNSET) -> AsyncStream:
        """`Client.stream` for asyncio (the same arguments and errors, raised at this call or while
        reading), not a coroutine: it returns an `AsyncStream` at once, for `async for`. A stream
        kept in a variable is cancelled when it is closed: `async with c.stream(...) as s:` or
        `await s.aclose()`; else it runs on the server until the variable goes."""
        self._check_usable()
        req = build_request(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, budget=budget, mode=mode, stop=stop, stop_token_ids=stop_token_ids,
                            ignore_eos=ignore_eos, request_id=request_id)
        timeout = self._deadline(timeout_s)

        def start(left: float | None = None) -> grpc.aio.UnaryStreamCall:
            self._check_usable()
            return self._stub.Generate(req, timeout=timeout if left is None else left,
                                       wait_for_ready=self.wait_for_ready, metadata=self._md)
        return AsyncStream(start, client_closed=lambda: self._closed,
                           retries=_Retries(timeout) if self.wait_for_ready else None)

    async def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float | None = 0.0,
                       top_p: float | None = 1.0, top_k: int | None = 0, seed: int | None = None, budget: int = 0,
                       mode: str | None = None, stop: str | Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                       ignore_eos: bool = False, request_id: str = "",
                       timeout_s: float | None | _Unset = _UNSET) -> Completion:
        """`Client.generate` for asyncio: the whole output as one `Completion`; the arguments and
        errors are `Client.stream`'s, and an error's ``partial`` the output before it. A cancelled
        task ends its request on the server."""
        out = Completion(request_id=request_id)
        try:   # an argument refused before anything is sent fails with an empty partial too
            chunks = self.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 seed=seed, budget=budget, mode=mode, stop=stop, stop_token_ids=stop_token_ids,
                                 ignore_eos=ignore_eos, request_id=request_id, timeout_s=timeout_s)
            async with chunks:
                async for chunk in chunks:
                    out.add(chunk)
        except ClientError as exc:
            exc.partial = out
            raise
        return out

    async def abort(self, request_id: str, *, timeout_s: float | _Unset = _UNSET) -> bool:
        """`Client.abort` for asyncio: bounded by `timeout_s` the same way."""
        self._check_usable()
        timeout = self._short_deadline(timeout_s, "abort")
        try:
            return (await self._stub.Abort(_abort_request(request_id), timeout=timeout,
                                           wait_for_ready=self.wait_for_ready, metadata=self._md)).found
        except grpc.RpcError as exc:
            raise _error(exc) from None
        except asyncio.CancelledError:
            self._raise_if_closed_under()
            raise

    async def model_info(self, *, timeout_s: float | _Unset = _UNSET) -> common_pb2.ModelInfo:
        """`Client.model_info` for asyncio."""
        self._check_usable()
        timeout = self._short_deadline(timeout_s, "model_info")
        try:
            return await self._stub.GetModelInfo(common_pb2.GetModelInfoRequest(),
                                                 wait_for_ready=self.wait_for_ready, metadata=self._md,
                                                 timeout=timeout)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        except asyncio.CancelledError:
            self._raise_if_closed_under()
            raise

    def _raise_if_closed_under(self) -> None:
        """A call the channel's close cancelled, not its task: as a stream says it (a bare
        CancelledError reads as a cancellation of the task to gather and TaskGroup)."""
        if self._closed and not _cancelling():
            raise _closed_under("call") from None
