"""A request that does not parse gets INVALID_ARGUMENT, not gRPC's UNKNOWN with the exception's repr.

gRPC parses a request before any handler runs, and a message that fails (truncated bytes, a string
field that is not UTF-8) ends the call with ``UNKNOWN: Unexpected <class 'DecodeError'>: ...``.
The interceptor gives each unary-request method a parser that keeps the error instead, and a
handler that answers it with INVALID_ARGUMENT naming the message type. Streaming-request methods
(the services' own links to each other, reflection) are left as they are: no client of the public
API sends one.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from contextlib import aclosing

import grpc

__all__ = ["ParseErrorInterceptor"]


class _Unparsed:
    """What the parser hands on in place of a request it could not parse."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class ParseErrorInterceptor(grpc.aio.ServerInterceptor):
    """Answers a unary request that does not parse with INVALID_ARGUMENT.

    `on_refused(method, message)` is called for each such request (the scheduler counts and logs
    them with its other refusals).
    """

    def __init__(self, on_refused: Callable[[str, str], None] | None = None) -> None:
        self._on_refused = on_refused

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def tolerant(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or any parser's own
                return _Unparsed(exc)

        async def refuse(request: _Unparsed, context: grpc.aio.ServicerContext) -> None:
            message = f"the request does not parse as the message {details.method} takes: {request.error}"
            if self._on_refused is not None:
                self._on_refused(details.method, message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

        if handler.response_streaming:
            inner = handler.unary_stream
            if inspect.isasyncgenfunction(inner):
                async def behavior(request, context):
                    if isinstance(request, _Unparsed):
                        await refuse(request, context)
                    async with aclosing(inner(request, context)) as responses:   # its finally runs when the call ends
                        async for response in responses:
                            yield response
            else:
                async def behavior(request, context):
                    if isinstance(request, _Unparsed):
                        await refuse(request, context)
                    return await inner(request, context)
            return grpc.unary_stream_rpc_method_handler(behavior, tolerant, handler.response_serializer)

        inner = handler.unary_unary

        async def unary(request, context):
            if isinstance(request, _Unparsed):
                await refuse(request, context)
            response = inner(request, context)
            return await response if inspect.isawaitable(response) else response
        return grpc.unary_unary_rpc_method_handler(unary, tolerant, handler.response_serializer)
