"""A scheduler lane's step stream to its draft replica: one message each way a step.

A unary call a step cost about twice what a message on an open stream does (call set-up, headers,
the call's own completion), and at C=1 that is on every step's critical path. The stream opens on
the first step and again on the step after it failed. A step that fails, by the draft's error, a
broken stream or the step timeout, closes it and raises `StepFailed` with the gRPC code that ended
it (the lane fails its requests UNAVAILABLE, naming that code); so does a step for requests
admitted before its stream ended since the last step (the draft restarted, or the connection
dropped): the draft frees what a stream admitted when it ends. A step of new prompts only opens a
new stream.

Where the draft offers a step socket (`OpenStepSocket`: a draft of this host's network namespace,
`services/common/step_socket.py`), a new stream opens there instead of on gRPC, and reads the same.
"""

from __future__ import annotations

import asyncio

import grpc

from ddtree.v1 import draft_pb2, draft_pb2_grpc
from services.common.grpc_server import MAX_MESSAGE_BYTES
from services.common.logging import get_logger
from services.common.step_socket import StepSocketCall, StepSocketError

__all__ = ["DraftLink", "StepFailed"]

log = get_logger("scheduler")


class StepFailed(Exception):
    """A step that did not come back; the lane marks its replica down either way and fails its
    running requests UNAVAILABLE, naming this code where it is another."""

    def __init__(self, code: grpc.StatusCode, details: str, delivered: bool = True) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.delivered = delivered   # False: the step never reached the replica (no connection to it)


_CORE_FAILURE = "Internal error from Core"
_NO_CONNECTION = "failed to connect to all addresses"


class DraftLink:
    """One lane's stream; `step` sends a step and waits for its answer, one step at a time."""

    def __init__(self, stub: draft_pb2_grpc.DraftStub, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.stub = stub
        self.metadata = metadata   # the internal token, where one is set
        self._call: grpc.aio.StreamStreamCall | StepSocketCall | None = None
        self.lane = ""   # what the open stream is on: "socket" or "grpc"

    async def step(self, request: draft_pb2.StepRequest, timeout: float) -> draft_pb2.StepResponse:
        if self._call is not None and self._call.done():   # it ended between steps (a draft restarted)
            self._call = None
            if any(not item.prompt_token_ids or item.prompt_offset for item in request.items):
                # The draft let go of what that stream admitted: these requests' state is gone. The
                # step itself went nowhere, so the new prompts in it reached no replica.
                raise StepFailed(grpc.StatusCode.UNAVAILABLE, "the step stream ended between steps", delivered=False)
        fresh = self._call is None
        call = self._call
        try:
            # Not wait_for: on Python 3.11 it returns the answer when the step is cancelled as the
            # answer arrives (gh-86296), and a lane being stopped stepped on.
            async with asyncio.timeout(timeout):
                if fresh:
                    self._call = call = await self._open()
                resp = await self._exchange(call, request)
        except asyncio.TimeoutError:   # (no call: the stream's opening took all of it, and the step was never sent)
            self.close()
            raise StepFailed(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer to a step within {timeout:g} s",
                             delivered=call is not None) from None
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details()
            if code == grpc.StatusCode.INTERNAL and call is not None:   # a write to a stream that is ending: its end says why
                try:
                    code, details = await asyncio.wait_for(call.code(), 1.0), await call.details()
                except (asyncio.TimeoutError, grpc.aio.AioRpcError):
                    pass
            if code == grpc.StatusCode.INTERNAL and details == _CORE_FAILURE:
                # gRPC's own words for a connection that broke under the call (a draft killed
                # mid-step), no status a draft sends: the replica is gone, as UNAVAILABLE says.
                code, details = grpc.StatusCode.UNAVAILABLE, "the step stream's connection broke"
            self.close()
            # gRPC's words where a new stream found no connection (the replica died before it was
            # marked down): the step never reached it, so neither did the prompts it began.
            unreached = fresh and code == grpc.StatusCode.UNAVAILABLE and _NO_CONNECTION in (details or "")
            # (no call: the step socket's offer failed, and the step was never sent)
            raise StepFailed(code, details or code.name, delivered=call is not None and not unreached) from None
        except StepSocketError as exc:   # the socket stream ended with a status, or broke (or refused its key)
            self.close()
            raise StepFailed(exc.code, exc.details, delivered=call is not None) from None
        except Exception as exc:  # noqa: BLE001 - e.g. InvalidStateError: the stream ended as we wrote
            self.close()
            raise StepFailed(grpc.StatusCode.UNAVAILABLE, f"the step stream failed: {exc!r}") from None
        if resp is grpc.aio.EOF:
            self.close()
            raise StepFailed(grpc.StatusCode.UNAVAILABLE, "the draft ended the step stream")
        return resp

    async def _open(self) -> grpc.aio.StreamStreamCall | StepSocketCall:
        """A new stream: on the draft's step socket where it offers one this scheduler reaches, else gRPC
        (asked again for each new stream: a draft that was restarting when one was refused offers it
        again). The offer's call fails as a step would (a replica gone fails it UNAVAILABLE, undelivered)."""
        try:
            offer = await self.stub.OpenStepSocket(draft_pb2.OpenStepSocketRequest(), metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:   # (a draft of an older release: gRPC only)
                raise
            offer = draft_pb2.StepSocketOffer()
        if offer.name:
            try:
                call = await StepSocketCall.open(offer.name, offer.key, draft_pb2.StepResponse, MAX_MESSAGE_BYTES)
                self.lane = "socket"
                return call
            except (OSError, asyncio.TimeoutError) as exc:   # another network namespace without the socket's folder, another host
                log.info("step_socket_unreachable", error=str(exc) or type(exc).__name__)
        self.lane = "grpc"
        return self.stub.StepStream(metadata=self.metadata)

    @staticmethod
    async def _exchange(call: grpc.aio.StreamStreamCall, request: draft_pb2.StepRequest):
        await call.write(request)
        return await call.read()

    def close(self) -> None:
        """Ends the stream (the draft finishes a step in flight, its engine lock held); the next
        step opens another."""
        if self._call is not None:
            self._call.cancel()
            self._call = None
