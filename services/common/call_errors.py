"""What a call that goes wrong before or inside its handler answers, on every server of the stack.

* A request that does not parse (truncated bytes, a string field that is not UTF-8): gRPC parses it
  before any handler runs and ended the call with ``UNKNOWN: Unexpected <class 'DecodeError'>``.
  A unary request now gets INVALID_ARGUMENT naming the method. A streaming one (the services' links
  to each other, and reflection, open on the public port) fails where its handler reads it: it ends
  INVALID_ARGUMENT too, not as a handler's failure (INTERNAL, and a traceback logged for every such
  call: anyone could fill the log).
* An exception a handler did not expect (a bug): gRPC ended the call with ``UNKNOWN`` and the
  exception's text, and logged nothing the service's log shows. It is now logged as
  ``handler_failed`` with its traceback, and the call ends INTERNAL naming the method and the
  exception's type (not its text: that may hold what a client has no business reading).

A status a handler ends its call with (``context.abort``) and a cancellation pass as they are.
A synchronous handler (run in gRPC's thread pool, with a synchronous context) keeps its own way of
running: only a request that does not parse is answered for it.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Awaitable, Callable, Iterator
from contextlib import aclosing

import grpc

from services.common.logging import OncePer, get_logger

__all__ = ["CallErrorInterceptor"]

log = get_logger("grpc")

_HANDLERS = {  # (request streaming, response streaming): the handler's field, its factory
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class _Unparsed:
    """What the parser hands on in place of a request it could not parse."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class _UnparsedMessage(Exception):
    """Raised to a streaming handler for a message that does not parse (`CallErrorInterceptor`)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class CallErrorInterceptor(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT for a request or stream message that does not parse (`on_unparsed(method,
    message)` is told of each: the scheduler counts Generate's with its other refusals; the log
    says so at most once a minute), INTERNAL and a logged traceback for a handler's unexpected
    exception."""

    def __init__(self, on_unparsed: Callable[[str, str], None] | None = None) -> None:
        self._on_unparsed = on_unparsed
        self._unparsed_said = OncePer()   # the unparsed calls, logged at most once a minute

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        field, factory = _HANDLERS[(handler.request_streaming, handler.response_streaming)]
        strict = handler.request_deserializer
        checks_parse = not handler.request_streaming and strict is not None

        def tolerant(data: bytes) -> object:
            try:
                return strict(data)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or any parser's own
                return _Unparsed(exc)

        def marked(data: bytes) -> object:   # a stream's messages: the handler meets the failure as it reads
            try:
                return strict(data)
            except Exception as exc:  # noqa: BLE001 - see tolerant
                raise _UnparsedMessage(exc) from exc
        if strict is None:
            parser = None
        elif checks_parse:
            parser = tolerant
        else:
            parser = marked
        return factory(self._wrap(getattr(handler, field), details.method, checks_parse),
                       parser, handler.response_serializer)

    def _unparsed(self, request, method: str) -> str | None:
        """The refusal's message for a request that did not parse (told to `on_unparsed`), else None."""
        if not isinstance(request, (_Unparsed, _UnparsedMessage)):
            return None
        message = f"the request does not parse as the message {method} takes: {request.error}"
        if self._on_unparsed is not None:
            self._on_unparsed(method, message)
        # Said, not a traceback a call (anyone may send bytes to reflection on the public port), and
        # where no caller counts them: two images of different versions in one stack show up here.
        calls = self._unparsed_said.due()
        if calls is not None:
            log.warning("requests_unparsed", method=method, error=str(request.error)[:200], calls=calls)
        return message

    def _wrap(self, inner: Callable, method: str, checks_parse: bool) -> Callable:
        if not (inspect.iscoroutinefunction(inner) or inspect.isasyncgenfunction(inner)):
            def sync(request, context):   # runs where gRPC runs a sync handler, with its sync context
                message = self._unparsed(request, method) if checks_parse else None
                if message is not None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
                return inner(request, context)
            return sync

        async def refuse_unparsed(request, context: grpc.aio.ServicerContext) -> None:
            message = self._unparsed(request, method) if checks_parse else None
            if message is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

        async def failed(exc: Exception, context: grpc.aio.ServicerContext) -> None:
            if isinstance(exc, grpc.aio.AbortError):   # the handler's own status, already set
                raise exc
            unparsed = next((e for e in _causes(exc) if isinstance(e, _UnparsedMessage)), None)
            if unparsed is not None:   # a client's bad bytes, not a bug: no traceback
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self._unparsed(unparsed, method))
            log.error("handler_failed", method=method, error=f"{type(exc).__name__}: {exc}"[:500],
                      traceback="".join(traceback.format_exception(exc))[-4000:])
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method} ({type(exc).__name__}); "
                                                          "the service's log has its traceback (handler_failed)")

        if inspect.isasyncgenfunction(inner):
            async def responses(request, context):
                await refuse_unparsed(request, context)
                try:
                    async with aclosing(inner(request, context)) as inner_responses:   # its finally runs when the call ends
                        async for response in inner_responses:
                            yield response
                except Exception as exc:  # noqa: BLE001 - see failed
                    await failed(exc, context)
            return responses

        async def answer(request, context):
            await refuse_unparsed(request, context)
            try:
                return await inner(request, context)
            except Exception as exc:  # noqa: BLE001 - see failed
                await failed(exc, context)
        return answer


def _causes(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and what it was raised from (``raise ... from``: a handler may wrap what it met).
    Not what it was raised during: a bug in a clean-up that runs as a bad message unwinds the
    handler would pass for the client's bad bytes (INVALID_ARGUMENT, nothing logged)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__
