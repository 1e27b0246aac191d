"""Step messages between two services of one host over a Unix socket instead of a gRPC stream.

At C=1 every step crosses draft -> verifier -> draft once, on the critical path, and scheduler ->
draft -> scheduler beside the draft's work ahead. A step's messages on an open grpc.aio stream
took 285 us a round trip on an H100 host, on a Unix socket under asyncio 89 us (355 against 156 on
a 2-core machine; `python -m bench.step_socket_bench`, bench/results/step-socket-*.json).

Set-up stays on gRPC (checks, rings, the internal token); only the step messages move. The serving
side (the verifier for its drafts, a draft for its schedulers) listens on an abstract socket name
(Linux; no file to leave behind, and only its network namespace sees it), or, where its setting
names a folder (`step_socket_dir`), on a socket file there: containers that share the folder (a
volume) reach it from their own network namespaces. It hands each caller a random key through a
token-checked gRPC call (the verifier's Handshake, the draft's OpenStepSocket). The caller sends
the key as its first frame: it names the handshake (as the verify stream's `draft-id` metadata
does) and proves the caller got it over gRPC. A caller that cannot reach the name (another network
namespace without the folder, another host) keeps gRPC.

A frame is a kind byte, the payload's length (4 bytes, little-endian), then the payload: a
serialised protobuf message (`MESSAGE`), or a gRPC status code (4 bytes) and its details in UTF-8
(`ERROR`, after which the sender closes), as an aborted gRPC stream would say.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import socket
import struct
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from services.common.grpc_server import MAX_MESSAGE_BYTES, ServiceError
from services.common.logging import get_logger

__all__ = ["MESSAGE", "ERROR", "KEY_BYTES", "ServesStepSocket", "StepSocketError", "StepSocketCall", "StepSocketServer",
           "available",
           "connect", "listen", "log_name", "messages", "open_server", "parse", "read_frame", "same_key", "socket_name",
           "write_error", "write_message"]

MESSAGE, ERROR = 0, 1
KEY_BYTES = 16
_HEADER = struct.Struct("<BI")
_MOST_ERROR_BYTES = 1 << 16   # an ERROR frame's status and details, whatever a MESSAGE may hold
_CODES = {c.value[0]: c for c in grpc.StatusCode}
MAX_KEYLESS = 64   # connections waiting for their key at once; more are closed as they come
M = TypeVar("M", bound=Message)
_log = get_logger("server")


def available(folder: str = "") -> bool:
    """Abstract socket names are Linux's; socket files, any host with Unix sockets."""
    return hasattr(socket, "AF_UNIX") if folder else sys.platform.startswith("linux")


def socket_name(server_id: str, folder: str = "") -> str:
    """What a server listens on: an abstract name (leading NUL), or a socket file in ``folder``."""
    return os.path.join(folder, f"ddtree-steps-{server_id}.sock") if folder else f"\0ddtree-steps-{server_id}"


def log_name(name: str) -> str:
    """A step socket's name for a log line: a file's path, an abstract name written with a leading
    "@" (as `ss -x` shows it), "" for none."""
    return "@" + name[1:] if name.startswith("\0") else name


def same_key(held: bytes, presented: bytes | None) -> bool:
    return bool(held) and presented is not None and hmac.compare_digest(held, presented)


async def listen(name: str, handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
                 ) -> asyncio.AbstractServer:
    """Serves ``handle`` on the name. The socket is bound here and handed over: uvloop passes a path
    to libuv as a C string, which ends at an abstract name's leading NUL (EINVAL). A socket file is
    made its owner's alone (the key is checked all the same), and removed again where the start
    fails after the bind (the service goes on on gRPC; the file would outlive it in a shared folder)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    is_file, bound = not name.startswith("\0"), False
    try:
        sock.bind(name)
        bound = True
        if is_file:
            os.chmod(name, 0o600)
        sock.listen(64)
        return await asyncio.start_unix_server(handle, sock=sock)
    except BaseException:
        sock.close()
        if bound and is_file:
            with contextlib.suppress(OSError):
                os.unlink(name)
        raise


async def connect(name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The caller's end (made here, as `listen` says why)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Not blocking: a listener whose backlog is full (its loop stalled) would hold this whole
        # event loop in the call; refused at once (BlockingIOError, an OSError) instead.
        sock.setblocking(False)
        sock.connect(name)
        return await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


class StepSocketError(Exception):
    """The other end ended the stream with a status (an ERROR frame), or broke the framing."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def write_message(writer: asyncio.StreamWriter, message: Message | bytes) -> None:
    payload = message if isinstance(message, bytes) else message.SerializeToString()
    writer.write(_HEADER.pack(MESSAGE, len(payload)) + payload)


def write_error(writer: asyncio.StreamWriter, code: grpc.StatusCode, details: str) -> None:
    payload = struct.pack("<I", code.value[0]) + details.encode()
    writer.write(_HEADER.pack(ERROR, len(payload)) + payload)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """The next MESSAGE frame's payload; None at a clean end (EOF between frames). An ERROR frame
    raises its status; a frame over ``max_bytes``, of an unknown kind, or cut short raises
    INVALID_ARGUMENT / UNAVAILABLE (nothing larger is ever read into memory)."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise StepSocketError(grpc.StatusCode.UNAVAILABLE, "the step socket closed inside a frame") from None
    kind, size = _HEADER.unpack(header)
    if kind not in (MESSAGE, ERROR):
        raise StepSocketError(grpc.StatusCode.INVALID_ARGUMENT, f"step socket frame of unknown kind {kind}")
    if size > (max(max_bytes, _MOST_ERROR_BYTES) if kind == ERROR else max_bytes):
        raise StepSocketError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"step socket frame of {size} bytes, more than the {max_bytes} allowed")
    try:
        payload = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise StepSocketError(grpc.StatusCode.UNAVAILABLE, "the step socket closed inside a frame") from None
    if kind == ERROR:
        code = _CODES.get(struct.unpack_from("<I", payload)[0] if size >= 4 else -1, grpc.StatusCode.UNKNOWN)
        raise StepSocketError(code, payload[4:].decode(errors="replace"))
    return payload


def parse(payload: bytes, message_type: type[M]) -> M:
    try:
        return message_type.FromString(payload)
    except DecodeError as exc:
        raise StepSocketError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"step socket frame is no {message_type.DESCRIPTOR.name}: {exc}") from None


async def messages(reader: asyncio.StreamReader, message_type: type[M], max_bytes: int) -> AsyncIterator[M]:
    """The frames of a stream as messages, until its clean end."""
    while (payload := await read_frame(reader, max_bytes)) is not None:
        yield parse(payload, message_type)


class StepSocketCall(Generic[M]):
    """The caller's end of a step socket, with what the services use of a grpc.aio stream call
    (write, read, done, cancel, add_done_callback), so a step reads the same on both.

    A reader task takes every frame as it comes, so an end between steps (the server stopped or
    restarted) is seen at once, as gRPC's call sees it: `done()` and the callbacks tell health."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response_type: type[M],
                 max_bytes: int) -> None:
        self._writer = writer
        self._replies: asyncio.Queue[M | object] = asyncio.Queue()
        self._callbacks: list[Callable[[StepSocketCall], None]] = []
        self._done = False
        self._end: StepSocketError | None = None   # why it ended; None: in order (EOF)
        self._task = asyncio.ensure_future(self._read_all(reader, response_type, max_bytes))

    @classmethod
    async def open(cls, name: str, key: bytes, response_type: type[M], max_bytes: int,
                   timeout_s: float = 10.0) -> StepSocketCall[M]:
        """Connects and presents ``key``; the server's empty MESSAGE frame says it took it. Raises
        OSError where the name cannot be reached (another network namespace, a server gone, its
        backlog full), StepSocketError where the server refused the key, asyncio.TimeoutError where
        it did not answer."""
        reader, writer = await connect(name)
        try:
            write_message(writer, key)
            ack = await asyncio.wait_for(read_frame(reader, 0), timeout_s)
            if ack is None:
                raise StepSocketError(grpc.StatusCode.UNAVAILABLE, "the step socket closed at its start")
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, response_type, max_bytes)

    async def _read_all(self, reader: asyncio.StreamReader, response_type: type[M], max_bytes: int) -> None:
        try:
            async for message in messages(reader, response_type, max_bytes):
                self._replies.put_nowait(message)
            self._finish(None)
        except asyncio.CancelledError:
            self._finish(StepSocketError(grpc.StatusCode.CANCELLED, "step socket closed by this side"))
            raise
        except StepSocketError as exc:
            self._finish(exc)
        except OSError as exc:   # reset by a peer that died
            self._finish(StepSocketError(grpc.StatusCode.UNAVAILABLE, f"step socket: {exc}"))

    def _finish(self, end: StepSocketError | None) -> None:
        if self._done:
            return
        self._done = True
        self._end = end
        self._replies.put_nowait(_ENDED)
        self._writer.close()
        for callback in self._callbacks:
            callback(self)

    async def write(self, message: Message) -> None:
        if self._done:   # what ended it, as grpc.aio's write raises the status the stream ended with
            raise self._end or StepSocketError(grpc.StatusCode.UNAVAILABLE, "the step socket is closed")
        write_message(self._writer, message)
        await self._writer.drain()

    async def read(self) -> M | object:
        """The next reply; grpc.aio.EOF once the server ended the stream in order."""
        item = await self._replies.get()
        if item is not _ENDED:
            return item
        self._replies.put_nowait(_ENDED)   # every later read says the same
        if self._end is not None:
            raise self._end
        return grpc.aio.EOF

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        self._task.cancel()
        self._finish(StepSocketError(grpc.StatusCode.CANCELLED, "step socket closed by this side"))

    def add_done_callback(self, callback: Callable[[StepSocketCall], None]) -> None:
        if self._done:
            callback(self)
        else:
            self._callbacks.append(callback)


_ENDED = object()   # a call's queue: the stream ended (`StepSocketCall._end` says how)


class StepSocketServer(Generic[M]):
    """The serving end: each connection presents a key, which ``start`` turns into what ``steps``
    serves (or refuses with a ServiceError: an ERROR frame with its status), then its requests are
    answered in order, as the gRPC stream handler it stands beside answers them.

    ``steps(handle, requests)`` is the service's own stream of answers, shared with its gRPC
    handler; a ServiceError out of it ends the stream with that status."""

    def __init__(self, name: str, start: Callable[[bytes | None], object],
                 steps: Callable[[object, AsyncIterator[M]], AsyncIterator[Message]], request_type: type[M],
                 key_timeout_s: float) -> None:
        self.name = name
        self._start = start
        self._steps = steps
        self._request_type = request_type
        self._key_timeout_s = key_timeout_s
        self._server: asyncio.AbstractServer | None = None
        self._streams: set[asyncio.Task] = set()
        self._keyless: set[asyncio.Task] = set()   # connected, key not yet presented

    async def open(self) -> None:
        self._server = await listen(self.name, self._serve)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if len(self._keyless) >= MAX_KEYLESS:   # connections that present no key hold no more descriptors
            writer.close()
            return
        self._streams.add(me)
        self._keyless.add(me)
        try:
            key = await asyncio.wait_for(read_frame(reader, KEY_BYTES), self._key_timeout_s)
            handle = self._start(key)
            self._keyless.discard(me)
            write_message(writer, b"")   # taken: the caller's open returns
            requests = messages(reader, self._request_type, MAX_MESSAGE_BYTES)
            async with contextlib.aclosing(self._steps(handle, requests)) as answers:
                async for answer in answers:
                    write_message(writer, answer)
                    await writer.drain()
        except (ServiceError, StepSocketError) as exc:
            with contextlib.suppress(OSError):
                write_error(writer, exc.code, exc.message if isinstance(exc, ServiceError) else exc.details)
        except (asyncio.TimeoutError, OSError):   # no key in time, or a caller gone mid-answer: no one to tell
            pass
        except asyncio.CancelledError:   # ended by `close` or `stop_accepting`: the caller sees the socket close
            pass
        except Exception as exc:  # noqa: BLE001 - a fault in the service: said here and to the caller, as gRPC would
            _log.exception("step_socket_stream_failed")
            with contextlib.suppress(OSError):
                write_error(writer, grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}")
        finally:
            self._streams.discard(me)
            self._keyless.discard(me)
            writer.close()

    def stop_accepting(self) -> None:
        """No new connection; those that have not presented a key yet are ended. A socket file
        goes (the streams on it stay open)."""
        if self._server is not None:
            self._server.close()
            if not self.name.startswith("\0"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.name)
            self._server = None
        for task in list(self._keyless):
            task.cancel()

    async def close(self, grace_s: float) -> None:
        """Takes no new stream; gives those open ``grace_s`` to end (the service ends its idle ones,
        a step in progress finishes), then cancels the rest, as gRPC's stop does to its own."""
        self.stop_accepting()
        if self._streams:
            _, late = await asyncio.wait(list(self._streams), timeout=grace_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)


async def open_server(enabled: bool, server_id: str, start: Callable[[bytes | None], object],
                      steps: Callable[[object, AsyncIterator[M]], AsyncIterator[Message]], request_type: type[M],
                      key_timeout_s: float, folder: str = "") -> StepSocketServer | None:
    """A service's step socket, listening, where its setting is on and the platform has the kind of
    name asked for (``folder``: a socket file there, made if missing; else an abstract name); None
    otherwise, or where this host refuses (a sandbox, a folder it cannot write: logged), and the
    service's gRPC stream then serves alone."""
    if not (enabled and available(folder)):
        return None
    server = StepSocketServer(socket_name(server_id, folder), start, steps, request_type, key_timeout_s)
    try:
        if folder:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        await server.open()
    except OSError as exc:
        _log.warning("step_socket_unavailable", name=log_name(server.name), error=str(exc))
        return None
    return server


class ServesStepSocket:
    """What a servicer with a step socket beside its gRPC stream shares: the socket's name as
    offered (`step_socket`, "" where none), its stop with the service's idle streams, its close.
    The servicer's own `end_idle_streams` ends its idle streams and calls `_stop_step_socket`."""

    step_socket = ""
    _sockets: StepSocketServer | None = None

    async def _open_step_socket(self, enabled: bool, server_id: str, start: Callable[[bytes | None], object],
                                steps: Callable[[object, AsyncIterator[M]], AsyncIterator[Message]],
                                request_type: type[M], key_timeout_s: float, folder: str = "") -> str:
        self._sockets = await open_server(enabled, server_id, start, steps, request_type, key_timeout_s, folder)
        self.step_socket = self._sockets.name if self._sockets is not None else ""
        return self.step_socket

    def _stop_step_socket(self) -> None:
        """No new stream on it, and its name no longer offered (the service is stopping)."""
        self.step_socket = ""
        if self._sockets is not None:
            self._sockets.stop_accepting()

    async def close_step_socket(self, grace_s: float) -> None:
        """Ends the idle streams on it and gives the others ``grace_s`` (`StepSocketServer.close`)."""
        self.end_idle_streams()  # type: ignore[attr-defined]
        if self._sockets is not None:
            await self._sockets.close(grace_s)
