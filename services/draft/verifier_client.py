"""The draft's end of the verify stream: handshake, shared rings, one request/response per step."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
import torch

from ddtree.v1 import verifier_pb2, verifier_pb2_grpc
from services.common.auth import token_metadata
from services.common.grpc_server import MAX_MESSAGE_BYTES, ServiceError, server_options
from services.common.logging import get_logger
from services.common.step_socket import StepSocketCall, StepSocketError
from services.common.transport import RingFull, TensorReader, TensorWriter, bundle_slot, make_reader, make_writer

__all__ = ["VerifierClient", "VerifyReply", "auto_offer", "next_offer", "private_copy", "readable_in_place"]

log = get_logger("draft")


def auto_offer(device: torch.device) -> list[str]:
    """What `transport = "auto"` offers, best first: a ring in GPU memory when this draft has a GPU,
    then POSIX shared memory, then the bytes inside the messages.

    Every address gets the shared rings, not only a loopback one: containers of one host (compose,
    `ipc: host`) reach each other by service name, yet share the IPC namespace and the GPUs. Where
    the verifier cannot map a ring (another host, another IPC namespace, a GPU it cannot see), the
    handshake moves on to the next kind, so a remote verifier costs two extra handshakes at connect.
    """
    return (["cuda_ipc"] if device.type == "cuda" else []) + ["shm", "inline"]


def next_offer(offer: Sequence[str], answered: str) -> list[str]:
    """What to offer after the verifier answered `answered` to `offer` (our ring is of offer[0]'s kind).

    The verifier answers another kind when it cannot use ours (no GPU, or our GPU is not visible
    to it); it registered nothing, so we hand-shake again with a ring of the kind it chose.
    """
    if answered not in offer[1:]:
        raise ValueError(f"verifier chose transport {answered!r}, which this draft did not offer after "
                         f"{offer[0]!r} (offered {list(offer)})")
    return list(offer[list(offer).index(answered):])


def readable_in_place(view: torch.Tensor, device: torch.device) -> bool:
    """Whether this draft can read a ring view where it lies: on the host, or on this draft's own
    GPU (a ring of another GPU is copied over instead, `private_copy`)."""
    if view.device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return view.device == torch.device("cuda", index)


def private_copy(view: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of a ring view on this draft's device, complete when this returns.

    The view lives where the verifier's ring lives (its GPU for cuda_ipc, maybe not ours), so the
    copy names our device explicitly; and it must have finished before the slot goes back to the
    verifier with the next request, which may come before any later sync on our side.
    """
    out = view.to(device, copy=True)
    if out.is_cuda:
        torch.cuda.current_stream(out.device).synchronize()   # a cross-GPU copy: our stream waits on it
    return out


@dataclass
class VerifyReply:
    response: verifier_pb2.VerifyResponse
    # [sum(committed), F]: a view of the verifier's ring where this draft can read it in place (see
    # `VerifierClient.step`), else a private copy on the draft's device
    features: torch.Tensor


class VerifierClient:
    """Keeps one stream open; a broken stream raises UNAVAILABLE and is re-opened by the next step
    or the replica's next probe (`DraftEngine.ensure_connected`)."""

    def __init__(self, address: str, transport: str, ring_slots: int, ring_slot_bytes: int,
                 device: str = "cpu", step_timeout_s: float = 60.0,
                 on_inline_fallback: Callable[[], None] | None = None, internal_token: str = "",
                 target_digest: str = "") -> None:
        """`device`: this draft's device; our ring lives there (cuda_ipc) and the features land there.
        `step_timeout_s`: a verifier that answers no step within this is taken for gone (a frozen
        process or a half-open connection would otherwise hold the draft's lock for ever).
        `on_inline_fallback`: called for each tree bundle too big for a ring slot (sent inline).
        `internal_token`: presented on every call (the verifier's `DDTREE_INTERNAL_TOKEN`).
        `target_digest`: `shared_weights_digest` of the target this draft read its embedding and
        lm_head from; a verifier that names another is refused ("": not checked)."""
        self.target_digest = target_digest
        self.address = address
        self._metadata = token_metadata(internal_token)
        self.step_timeout_s = step_timeout_s
        self.draft_id = f"draft-{uuid.uuid4().hex[:12]}"
        self.device = torch.device(device)
        self._offer = auto_offer(self.device) if transport == "auto" else [transport]
        self._ring_slots = ring_slots
        self._ring_slot_bytes = ring_slot_bytes
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._writer: TensorWriter | None = None
        self._kept_ring: TensorWriter | None = None   # our cuda_ipc ring, kept across streams (`_ring`)
        self._reader: TensorReader | None = None
        self._to_release: list[int] = []
        self._sequence = 0
        self._on_inline_fallback = on_inline_fallback
        self.handshake: verifier_pb2.HandshakeResponse | None = None
        self._connects = 0   # handshakes that opened a stream: from the second on, each is logged a reconnect
        self.lane = ""   # what the steps travel on: "socket" (services/common/step_socket.py) or "grpc" (VerifyStream)
        self.stream_changed = asyncio.Event()   # set when a verify stream opens or ends (health reads it)

    async def connect(self, feature_layer_ids: Sequence[int], hidden_size: int, vocab_size: int,
                      wait_s: float = 0.0) -> verifier_pb2.HandshakeResponse:
        """Handshakes and opens the stream; waits up to `wait_s` for the verifier to come up (start-up),
        otherwise fails at once with UNAVAILABLE so requests are not held while the verifier is down."""
        await self.close()
        self._channel = grpc.aio.insecure_channel(self.address, options=server_options())
        stub = verifier_pb2_grpc.VerifierStub(self._channel)
        offer = list(self._offer)
        if wait_s > 0:
            # The ring is made once the verifier's port answers, not for the whole wait: a draft
            # killed while it waited (SIGKILL; a container's end) left its ring in /dev/shm, as
            # only the verifier's mapping of it lets its name go.
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(self._channel.channel_ready(), wait_s)
            except asyncio.TimeoutError:
                await self.close()
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"verifier handshake failed: no connection within {wait_s:g} s") from None
            wait_s = max(wait_s - (time.monotonic() - t0), 1.0)   # what is left of it for the handshake
        while True:   # each round offers fewer kinds, so this ends
            try:
                self._writer = self._ring(offer[0])
            except (OSError, RuntimeError) as exc:   # /dev/shm or the GPU has no room: the next kind, if any
                why = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
                if len(offer) == 1:
                    await self.close()
                    raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"cannot make a {offer[0]} ring: {why}") from None
                log.warning("ring_create_failed", transport=offer[0], error=why, fallback=offer[1])
                offer = offer[1:]
                continue
            try:
                hs = await stub.Handshake(verifier_pb2.HandshakeRequest(
                    draft_id=self.draft_id, feature_layer_ids=list(feature_layer_ids), hidden_size=hidden_size,
                    vocab_size=vocab_size, transports=offer, draft_ring=self._writer.ring_name or "",
                    draft_ring_slot_bytes=self._writer.slot_bytes, draft_ring_slots=self._writer.num_slots),
                    wait_for_ready=wait_s > 0, timeout=wait_s if wait_s > 0 else 10.0, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                await self.close()
                raise ServiceError(exc.code(), f"verifier handshake failed: {exc.details()}") from None
            if hs.transport != offer[0]:   # it cannot use our ring's kind: offer a ring of the kind it chose
                try:
                    offer = next_offer(offer, hs.transport)
                except ValueError as exc:
                    await self.close()
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
                self._close_writer()
                continue
            try:
                self._reader = make_reader(hs.transport, hs.verifier_ring or None, hs.verifier_ring_slot_bytes,
                                           hs.verifier_ring_slots, prefix="ddtree-verifier-")
            except (OSError, ValueError, RuntimeError) as exc:   # e.g. the verifier's GPU is not visible here
                if len(offer) == 1:
                    await self.close()
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"cannot attach the verifier's {hs.transport} ring: {exc}") from None
                # The designed path to a verifier on another host or IPC namespace, but also a
                # permission or namespace mismatch a user would look for: say why.
                log.info("ring_attach_failed", transport=hs.transport, error=str(exc), fallback=offer[1])
                offer = offer[1:]   # the verifier drops the peer it made when we hand-shake again
                self._close_writer()
                continue
            break
        if self.target_digest and hs.target_digest and hs.target_digest != self.target_digest:
            await self.close()
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "the verifier's target is another model than draft.target_path (their embedding and "
                               f"lm_head differ: {hs.target_digest} against {self.target_digest}): the drafter would "
                               "draft for the wrong model; point draft.target_path at the verifier's checkpoint")
        if self._kept_ring is not None and self._writer is not self._kept_ring:   # settled on another kind: the
            self._kept_ring.close()   # verifier answered, so it let go of any old mapping of the ring first
            self._kept_ring = None
        self._writer.attached()   # the verifier mapped our ring in its handshake
        self._call = await self._step_socket(hs) if hs.step_socket else None
        self.lane = "socket" if self._call is not None else "grpc"
        if self._call is None:
            self._call = stub.VerifyStream(metadata=(("draft-id", self.draft_id), *self._metadata))
        self._call.add_done_callback(lambda _: self.stream_changed.set())
        self.stream_changed.set()
        self.handshake = hs
        self._connects += 1
        if self._connects > 1:   # whoever asked (a step, the scheduler's probe, the replica's own watch)
            log.info("verifier_reconnected", verifier=self.address, verifier_id=hs.verifier_id, transport=hs.transport,
                     lane=self.lane)
        return hs

    async def _step_socket(self, hs: verifier_pb2.HandshakeResponse) -> StepSocketCall | None:
        """The steps' socket the verifier offered, or None where this draft cannot reach it (another
        network namespace without `verifier.step_socket_dir`'s folder, another host), which keeps
        the gRPC stream."""
        try:
            return await StepSocketCall.open(hs.step_socket, hs.step_socket_key, verifier_pb2.VerifyResponse,
                                             MAX_MESSAGE_BYTES)
        except (OSError, asyncio.TimeoutError) as exc:
            log.info("step_socket_unreachable", verifier=self.address, error=str(exc) or type(exc).__name__)
            return None
        except StepSocketError as exc:   # refused: the handshake is no longer current (the verifier restarted)
            await self.close()
            raise ServiceError(exc.code, f"verifier step socket refused: {exc.details}") from None

    def _ring(self, kind: str) -> TensorWriter:
        """A ring of `kind` for the next handshake. A cuda_ipc ring is made once and offered again
        after a stream ends, not freed with it: CUDA leaves a read of freed memory through another
        process's mapping undefined, and the verifier may still read a step it queued before our
        wait for it timed out. Its answer to the next handshake is its word that it let go of our
        old stream (it retires a draft's old peer first), so the ring goes once a handshake settles
        on another kind, or at `close(final=True)`. An shm segment lives while anyone maps it."""
        if kind == "cuda_ipc" and self._kept_ring is not None:
            self._kept_ring.release_all()   # what the old stream held: the verifier reads none of it again
            return self._kept_ring
        writer = make_writer(kind, self._ring_slot_bytes, self._ring_slots, "ddtree-draft", device=self.device)
        if kind == "cuda_ipc":
            self._kept_ring = writer
        return writer

    def _close_writer(self) -> None:
        """Drops the current ring; a kept one stays for the next handshake (`_ring`)."""
        if self._writer is not None and self._writer is not self._kept_ring:
            self._writer.close()
        self._writer = None

    @property
    def connected(self) -> bool:
        """An open stream. One the verifier ended between steps (it restarted) is not: the next
        step hand-shakes again instead of writing to it."""
        return self._call is not None and not self._call.done()

    async def step(self, prefills: Sequence[verifier_pb2.PrefillItem], verify_ids: Sequence[str],
                   trees: Mapping[str, torch.Tensor] | None, release: Sequence[str]) -> VerifyReply:
        """Sends one step and waits for its answer.

        The answer's features stay in the verifier's ring where this draft can read them there
        (host memory, or this draft's GPU): their slot goes back to the verifier with the next
        step, so they must be consumed by then, on this device's current stream (the drafter's
        context commit does), or copied. A copy out of the ring and a stream sync cost 0.2 ms a
        step on the H200 machine (BENCHMARKS.md, T-split), on the critical path at C=1. Before the
        slot goes back, this device's stream is synchronised, so the verifier never overwrites
        what is still being read.
        """
        if self._call is None or self._writer is None or self._reader is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "verifier stream is not connected")
        if self._to_release and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()   # the last features are read
        self._sequence += 1
        before = self._writer.inline_fallbacks
        try:
            bundle = self._writer.write(trees) if trees is not None else None
        except (RingFull, OSError) as exc:   # every slot held (the verifier releases none), or /dev/shm full: start afresh
            raise await self._lost(f"draft ring: {exc}") from None
        if self._writer.inline_fallbacks != before and self._on_inline_fallback is not None:
            self._on_inline_fallback()
        req = verifier_pb2.VerifyRequest(sequence=self._sequence, prefills=prefills, verify_ids=list(verify_ids),
                                         release=list(release), released_slots=self._to_release)
        if bundle is not None:
            req.trees.CopyFrom(bundle)
        self._to_release = []
        try:
            async with asyncio.timeout(self.step_timeout_s):   # no extra task a step, as wait_for makes
                await self._call.write(req)
                resp = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise await self._lost(f"verifier stream broke: {exc.details()}", exc.code().name) from None
        except StepSocketError as exc:
            raise await self._lost(f"verifier stream broke: {exc.details}", exc.code.name) from None
        except asyncio.TimeoutError:
            raise await self._lost(f"the verifier answered no step within {self.step_timeout_s:g} s") from None
        except Exception as exc:  # noqa: BLE001 - e.g. InvalidStateError: the stream ended as we wrote
            raise await self._lost(f"verifier stream failed: {exc!r}") from None
        if resp is grpc.aio.EOF or resp is None:
            raise await self._lost("verifier closed the stream")
        if resp.sequence != self._sequence:   # an answer to another step (one cut between write and read)
            raise await self._lost(f"the verifier answered step {resp.sequence} to step {self._sequence}")
        try:
            slot = bundle_slot(resp.features)
            if slot is not None:   # returned to the verifier with the next request, even if it reads badly here
                self._to_release.append(slot)
            self._writer.release(resp.released_slots)
            view = self._reader.read(resp.features)["features"]
        except Exception as exc:  # noqa: BLE001 - a reply this draft cannot take: the step's state is the verifier's
            # alone now, so the stream ends (the verifier drops this draft's requests) and the step fails as lost
            if not isinstance(exc, (ValueError, KeyError)):   # not a bad message: a fault here, kept with its trace
                log.exception("verifier_reply_failed")
            raise await self._lost(f"unreadable verifier reply: {exc}") from None
        features = view if readable_in_place(view, self.device) else private_copy(view, self.device)   # [sum(committed), F]
        return VerifyReply(resp, features)

    async def _lost(self, message: str, code: str | None = None) -> ServiceError:
        """The stream ends in a step (it broke, went unanswered, or this draft's ring or the reply
        failed): said once here, with the verifier's address and gRPC's code (health's
        `not_serving` names neither), then closed; the step's error to raise."""
        log.warning("verifier_stream_lost", verifier=self.address, code=code, error=message)
        await self.close()
        return ServiceError(grpc.StatusCode.UNAVAILABLE, message)

    async def close(self, final: bool = False) -> None:
        """Ends the stream and frees the rings (a kept cuda_ipc ring only when `final`: the draft
        is going; see `_ring`); the handshake's answer is forgotten too, so nothing reports a
        verifier this draft no longer reaches."""
        self.handshake = None
        if self._reader is not None and self.device.type == "cuda" and torch.cuda.is_initialized():
            try:   # our reads of its ring are done before it can go (the verifier frees it when it sees the end)
                torch.cuda.current_stream(self.device).synchronize()
            except RuntimeError as exc:   # a GPU that faulted: the rest of the clean-up still runs
                log.error("draft_gpu_sync_failed", error=str(exc)[:500])
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        self._close_writer()
        if final and self._kept_ring is not None:
            self._kept_ring.close()
            self._kept_ring = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._to_release = []
