"""Client SDK: synchronous `Client` and asyncio `AsyncClient` for the scheduler's public API.

    with Client("127.0.0.1:50051") as c:
        print(c.generate("def fibonacci(n):", max_tokens=64).text)
        for chunk in c.stream("import os", max_tokens=32):
            print(chunk.text, end="")

Errors from the server raise `ClientError` carrying the gRPC status code and the server's message;
arguments that cannot form a request raise it too, with INVALID_ARGUMENT, before anything is sent.
"""

from __future__ import annotations

import numbers
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from ddtree.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["Client", "AsyncClient", "ClientError", "Chunk", "Completion", "Usage", "build_request"]

_MODES = {"ddtree": common_pb2.MODE_DDTREE, "autoregressive": common_pb2.MODE_AUTOREGRESSIVE, None: 0}
_FINISH = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in scheduler_pb2.FinishReason.items()}


class ClientError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass
class Usage:
    """The server's count for a finished request (the last chunk carries it)."""

    prompt_tokens: int
    completion_tokens: int
    steps: int                 # verify steps (the prefill's first token is not one)
    mean_acceptance: float     # tokens a verify step, bonus token included


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


def build_request(prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = 0, seed: int | None = None, budget: int = 0,
                  mode: str | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  ignore_eos: bool = False, request_id: str = "") -> scheduler_pb2.GenerateRequest:
    """A GenerateRequest; `prompt` is text or a list of token ids; budget 0 = server default.
    `stop` is one string or several. Raises `ClientError` (INVALID_ARGUMENT) naming the argument
    that cannot be sent: a value outside its wire type's range, a non-integer token id, text that
    is not valid Unicode."""
    if mode not in _MODES:
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"mode must be 'ddtree' or 'autoregressive', not {mode!r}")
    if not isinstance(ignore_eos, bool):
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"ignore_eos must be True or False, not {ignore_eos!r}")
    stops = [stop] if isinstance(stop, str) else _listed("stop", stop)
    stop_token_ids = _listed("stop_token_ids", stop_token_ids)
    texts = [prompt] if isinstance(prompt, str) else []
    ids = [] if isinstance(prompt, str) else _listed("prompt", prompt)
    for name, values in (("prompt", ids), ("stop_token_ids", stop_token_ids)):
        bad = next((t for t in values if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
        if bad is not None:
            raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: token ids must be integers, got {bad!r}")
    req = scheduler_pb2.GenerateRequest(mode=_MODES[mode], ignore_eos=ignore_eos)
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if value is not None:
            _put(name, setattr, req.sampling, name, value)
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


def _listed(name: str, value) -> list:
    """``value`` (None: nothing, except for the prompt) as a list: any iterable but text and bytes,
    which would otherwise pass as characters or as token ids (b"hi" is [104, 105])."""
    if value is None and name != "prompt":
        return []
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not hasattr(value, "__iter__"):
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
                      mean_acceptance=u.mean_acceptance)
    return Chunk(request_id=msg.request_id, token_ids=list(msg.token_ids), text=msg.text,
                 acceptance_lengths=list(msg.acceptance_lengths),
                 finish_reason=_FINISH[msg.finish_reason] if msg.finish_reason else None, usage=usage)


def _error(exc: grpc.RpcError) -> ClientError:
    return ClientError(exc.code(), exc.details() or "")


def _channel_args(tls_ca: str | bytes | None, token: str | None,
                  tls_server_name: str | None) -> tuple[grpc.ChannelCredentials | None, list]:
    """TLS credentials (a CA file path or PEM bytes; b"" trusts the system roots), the bearer
    token, and channel options. A server that restarts is reached again within about a second:
    gRPC's default reconnect back-off grows towards two minutes, and a long-lived client kept
    failing UNAVAILABLE for seconds after the scheduler was back. (Not `min_reconnect_backoff_ms`:
    that is the time a connection attempt may take, and a short one fails far clients.)"""
    creds = None
    options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
    if tls_ca is not None:
        try:
            roots = tls_ca if isinstance(tls_ca, bytes) else open(tls_ca, "rb").read()
        except OSError as exc:
            raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"tls_ca: cannot read {tls_ca}: {exc.strerror}") from None
        creds = grpc.ssl_channel_credentials(root_certificates=roots or None)
        if token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
    return creds, options


def _check_open(closed: bool) -> None:
    if closed:  # gRPC's own error here is a ValueError or its UsageError, not a status
        raise ClientError(grpc.StatusCode.FAILED_PRECONDITION, "this client is closed")


def _metadata(tls_ca, token) -> tuple:
    # Over TLS the token rides in call credentials; plaintext (loopback) sends it as metadata.
    return (("authorization", f"Bearer {token}"),) if token and tls_ca is None else ()


class Client:
    """`wait_for_ready=False` (default) fails at once with UNAVAILABLE when no server is listening;
    True waits for the server to come up, bounded by `timeout_s`."""

    def __init__(self, address: str, timeout_s: float | None = None, wait_for_ready: bool = False, *,
                 tls_ca: str | bytes | None = None, token: str | None = None,
                 tls_server_name: str | None = None) -> None:
        creds, options = _channel_args(tls_ca, token, tls_server_name)
        self._channel = (grpc.secure_channel(address, creds, options) if creds
                         else grpc.insecure_channel(address, options))
        self._md = _metadata(tls_ca, token)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self.timeout_s = timeout_s
        self.wait_for_ready = wait_for_ready
        self._closed = False

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[Chunk]:
        _check_open(self._closed)
        timeout = kwargs.pop("timeout_s", self.timeout_s)
        call = self._stub.Generate(build_request(prompt, **kwargs), timeout=timeout,
                                   wait_for_ready=self.wait_for_ready, metadata=self._md)
        try:
            for msg in call:
                yield _chunk(msg)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()  # a caller that stops reading (break, close) ends the request on the server now

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        out = Completion()
        for chunk in self.stream(prompt, **kwargs):
            out.add(chunk)
        return out

    def abort(self, request_id: str) -> bool:
        _check_open(self._closed)
        try:
            return self._stub.Abort(scheduler_pb2.AbortRequest(request_id=request_id), metadata=self._md).found
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def model_info(self) -> common_pb2.ModelInfo:
        _check_open(self._closed)
        try:
            return self._stub.GetModelInfo(common_pb2.GetModelInfoRequest(), wait_for_ready=self.wait_for_ready,
                                           metadata=self._md,
                                           timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _error(exc) from None


class AsyncClient:
    """The asyncio twin of `Client`, for many concurrent streams from one process."""

    def __init__(self, address: str, timeout_s: float | None = None, wait_for_ready: bool = False, *,
                 tls_ca: str | bytes | None = None, token: str | None = None,
                 tls_server_name: str | None = None) -> None:
        creds, options = _channel_args(tls_ca, token, tls_server_name)
        self._channel = (grpc.aio.secure_channel(address, creds, options) if creds
                         else grpc.aio.insecure_channel(address, options))
        self._md = _metadata(tls_ca, token)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self.timeout_s = timeout_s
        self.wait_for_ready = wait_for_ready
        self._closed = False

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        await self._channel.close()

    async def stream(self, prompt: str | Sequence[int], **kwargs) -> AsyncIterator[Chunk]:
        _check_open(self._closed)
        timeout = kwargs.pop("timeout_s", self.timeout_s)
        call = self._stub.Generate(build_request(prompt, **kwargs), timeout=timeout,
                                   wait_for_ready=self.wait_for_ready, metadata=self._md)
        try:
            async for msg in call:
                yield _chunk(msg)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()  # `break` / `aclose()` would otherwise leave the request running to the end

    async def generate(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        out = Completion()
        async for chunk in self.stream(prompt, **kwargs):
            out.add(chunk)
        return out

    async def abort(self, request_id: str) -> bool:
        _check_open(self._closed)
        try:
            return (await self._stub.Abort(scheduler_pb2.AbortRequest(request_id=request_id), metadata=self._md)).found
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def model_info(self) -> common_pb2.ModelInfo:
        _check_open(self._closed)
        try:
            return await self._stub.GetModelInfo(common_pb2.GetModelInfoRequest(),
                                                 wait_for_ready=self.wait_for_ready, metadata=self._md,
                                                 timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _error(exc) from None
