"""The verifier's gRPC face: handshake, then one long-lived verify stream per draft replica.

Each request message carries prefills and trees for one step; the engine runs them and the answer
carries accepted tokens plus the committed tokens' target features, the bulk by shared buffer.
Calls into the engine are serialised (one forward at a time). Prefills, clean-ups and every step of
a tensor-parallel group run off the event loop, so health checks answer while they compute; a
verify-only step of one rank runs on the loop when the engine is free (`_inline`: a few ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import secrets
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from kernels.pdl import switch_from_env
from kernels.tree_mla import BACKEND_ENV, backend_from_env
from services.common import step_socket
from services.common.auth import internal_interceptors, internal_token
from services.common.checkpoint import read_config, require_checkpoint, shared_weights_digest
from services.common.devices import device_name, pin_device
from services.common.grpc_server import (IdleStreams, ServiceError, check_port_free, host_port, listen, new_server,
                                         serve_until_signal, warn_if_reachable)
from services.common.logging import configure_logging, get_logger
from services.common.metrics import Metrics, serve_metrics
from services.common.settings import (MAX_BUDGET, MAX_DRAFT_RING_SLOT_BYTES, MAX_DRAFT_RING_SLOTS, SettingsError,
                                      VerifierSettings)
from services.common.transport import (InlineWriter, RingFull, TensorReader, TensorWriter, bundle_slot, make_reader,
                                       make_writer, name_text, shape_text)
from services.verifier.engine import ItemOutcome, PrefillInput, StepOutcome, VerifierEngine, tree_shape_error
from services.verifier.kv_cache import PagedKVCache
from services.verifier.model import TargetModel
from services.verifier.parallel import TensorParallel, master_store
from services.verifier.ranks import (EngineGroup, GroupFailed, backend_for, check_rank_devices, first_exit, rank_device,
                                     spawn_workers, stop_workers, watch_workers)
from services.verifier.sampling import Sampling

__all__ = ["VerifierServicer", "build_engine", "serve", "warm_up"]

log = get_logger("verifier")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The most tree nodes a verify-only step may have to run on the event loop (`_inline`): a few
# milliseconds on a GPU at this size; a step of 128 trees of 129 nodes took 0.5 s on the K2 slice
# and 7 s on a CPU, every health check and handshake waiting behind it.
INLINE_MOST_NODES = 256
_Stage = tuple[str, float]   # a step stage's name (the `step_ms` label) and its milliseconds
TREE_FIELDS = ("tokens", "parents", "depths", "sizes")   # a verify step's tree bundle, in the engine's order


def sampling_from_proto(msg: common_pb2.SamplingParams) -> Sampling:
    """The seed is fixed here, on rank 0, so that every tensor-parallel rank draws the same tokens."""
    seed = msg.seed if msg.HasField("seed") else secrets.randbits(62)
    # proto3's 0 is "not set": nucleus off. A negative or NaN top_p is a caller's error, refused.
    return Sampling(temperature=msg.temperature, top_p=msg.top_p if msg.top_p != 0 else 1.0,
                    top_k=msg.top_k, seed=seed)


@dataclass
class _Peer:
    """One connected draft replica: its transports and the features slots it still reads."""

    draft_id: str
    writer: TensorWriter
    reader: TensorReader
    owner: str = ""          # what its stream admits is the engine's under this name: one per handshake
    streamed: bool = False   # its verify stream reached us (from then on the stream's end drops it)
    feature_layers: tuple[int, ...] = ()   # the target layers whose features it drafts from
    socket_key: bytes = b""  # what it presents on the step socket to stream there instead (services/common/step_socket.py)


class VerifierServicer(step_socket.ServesStepSocket, verifier_pb2_grpc.VerifierServicer):
    """Reads through `engine`; changes state only through `group`, so every TP rank follows."""

    def __init__(self, group: EngineGroup, settings: VerifierSettings, metrics: Metrics | None = None,
                 target_digest: str = "") -> None:
        """``target_digest``: `shared_weights_digest` of the checkpoint the engine loaded, told to
        each draft at its handshake ("": not known, not checked)."""
        self.group = group
        self.engine = group.engine
        self.settings = settings
        self.target_digest = target_digest
        self.metrics = metrics or Metrics("verifier")
        self.metrics.kv_pages_free.set(self.engine.cache.pages_free)
        self.metrics.kv_pages_total.set(self.engine.cache.num_pages)
        self.metrics.track_gpu_memory(self.engine.model_device)
        # Engine calls run in worker threads; a thread cannot be cancelled with the coroutine that
        # awaits it (a draft dying mid-step cancels its stream), so exclusion is a thread lock held
        # for the whole call, never an asyncio lock that a cancellation would release early.
        self._engine_lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._handshakes = itertools.count(1)
        self._handshake_lock = asyncio.Lock()
        self._group_stopped = False   # the workers were sent their stop (`stop_group`)
        self._cleanups: set[asyncio.Future] = set()   # stream clean-ups running past their handler
        self._idle = IdleStreams()   # stream handlers waiting for their draft's next step
        self.verifier_id = f"verifier-{uuid.uuid4().hex[:12]}"

    async def start_step_socket(self) -> str:
        """Listens for steps on a Unix socket where `verifier.step_socket` is on (an abstract name on
        Linux, or a socket file in `verifier.step_socket_dir`); returns the name offered to drafts
        from here on ("": none)."""
        return await self._open_step_socket(self.settings.step_socket, self.verifier_id, self._socket_peer,
                                            self._serve_steps, verifier_pb2.VerifyRequest,
                                            self.settings.peer_stream_timeout_s, self.settings.step_socket_dir)

    async def Handshake(self, request: verifier_pb2.HandshakeRequest,
                        context: grpc.aio.ServicerContext) -> verifier_pb2.HandshakeResponse:
        # One at a time: a handshake checks the connected drafts' feature layers, then awaits the
        # engine's switch to its own, then registers; two side by side would both pass the check.
        async with self._handshake_lock:
            return await self._handshake(request, context)

    async def _handshake(self, request: verifier_pb2.HandshakeRequest,
                         context: grpc.aio.ServicerContext) -> verifier_pb2.HandshakeResponse:
        cfg = self.engine.model.config
        if request.hidden_size != cfg.hidden_size or request.vocab_size != cfg.vocab_size:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"drafter expects hidden_size={request.hidden_size}, vocab_size={request.vocab_size}; "
                                f"target has hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}")
        layers = tuple(request.feature_layer_ids)
        try:   # checked here first: a call the other ranks refuse would end the group
            self.engine.check_feature_layers(list(layers))
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        fixed = tuple(self.settings.feature_layers)
        if fixed and layers != fixed:   # the start-up captured the graphs with these; a recapture would take long
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"draft {request.draft_id} drafts from target layers {list(layers)}; this verifier "
                                f"serves verifier.feature_layers = {list(fixed)} (point the drafter at a verifier of "
                                "its layers, or change the setting)")
        others = {p.feature_layers for p in self._peers.values() if p.draft_id != request.draft_id}
        if others and others != {layers}:   # one set for the engine: a second would re-point the first's features
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"draft {request.draft_id} drafts from target layers {list(layers)}; the drafts "
                                f"connected here use {[list(o) for o in others]} (a verifier serves one set; "
                                "point drafters of another kind at another verifier)")
        mine = (("cuda_ipc",) if self.settings.device.startswith("cuda") else ()) + ("shm", "inline")
        usable = [t for t in request.transports if t in mine]
        if not usable:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no common transport: draft offers {list(request.transports)}, verifier has {mine}")
        if request.draft_id in self._peers:   # the draft came back (its stream broke): what it had is gone
            await self._locked(self._retire_peer, request.draft_id)
        if len(self._peers) >= self.settings.max_peers:   # each holds two rings (shared or GPU memory) till it goes
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{len(self._peers)} drafts are connected here already (verifier.max_peers); "
                                "one must go first")
        kind = usable[0]
        if kind != request.transports[0]:   # the draft's ring is of its first choice: ask for one of ours
            return verifier_pb2.HandshakeResponse(transport=kind)
        if kind != "inline" and not (request.draft_ring_slots <= MAX_DRAFT_RING_SLOTS and
                                     request.draft_ring_slot_bytes <= MAX_DRAFT_RING_SLOT_BYTES):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"draft ring of {request.draft_ring_slots} x {request.draft_ring_slot_bytes} bytes: at most "
                                f"{MAX_DRAFT_RING_SLOTS} slots of {MAX_DRAFT_RING_SLOT_BYTES} (draft.ring_slots, "
                                "draft.ring_slot_bytes)")
        try:
            # copies: a draft that shrank its shm ring under a view of it would end this process (SIGBUS)
            reader = make_reader(kind, request.draft_ring or None, request.draft_ring_slot_bytes,
                                 request.draft_ring_slots, prefix="ddtree-draft-", copy=True)
        except (OSError, ValueError, RuntimeError) as exc:   # e.g. the draft's GPU is not visible here
            if len(usable) == 1:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot attach the draft's ring: {exc}")
            # The designed path where the draft is on another host or IPC namespace: not a warning.
            log.info("ring_attach_failed", draft_id=request.draft_id, transport=kind, error=str(exc),
                     fallback=usable[1])
            return verifier_pb2.HandshakeResponse(transport=usable[1])   # the draft retries with that kind
        try:
            writer = make_writer(kind, self.settings.ring_slot_bytes, self.settings.ring_slots, "ddtree-verifier",
                                 device=self.engine.model_device)
        except (OSError, RuntimeError) as exc:   # /dev/shm or the GPU has no room for another ring: refused, not a crash
            reader.close()
            why = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
            if len(usable) == 1:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot make a {kind} ring here: {why}")
            log.warning("ring_create_failed", draft_id=request.draft_id, transport=kind, error=why, fallback=usable[1])
            return verifier_pb2.HandshakeResponse(transport=usable[1])   # the draft retries with that kind
        except BaseException:   # anything else: the draft's ring is not left mapped behind the error
            reader.close()
            raise
        # The layers switch last, once nothing refuses the handshake: a refused one (no common
        # transport, say) re-pointed the draft's old stream at its layers, and recaptured every graph.
        try:
            await self._locked(self.group.call, "set_feature_layers", list(layers))
        except BaseException as exc:
            reader.close()
            writer.close()
            if isinstance(exc, ServiceError):
                await context.abort(exc.code, exc.message)
            raise
        peer = _Peer(request.draft_id, writer, reader, owner=f"{request.draft_id}#{next(self._handshakes)}",
                     feature_layers=layers, socket_key=secrets.token_bytes(step_socket.KEY_BYTES) if self.step_socket
                     else b"")
        self._peers[request.draft_id] = peer
        self._observe()
        # A draft that dies (or gives up on our ring) before opening its stream never runs the
        # stream's clean-up: its rings would stay mapped until we restart.
        asyncio.get_running_loop().call_later(
            self.settings.peer_stream_timeout_s,
            lambda: self._track(asyncio.ensure_future(self._expire_if_silent(peer))))
        log.info("handshake", draft_id=request.draft_id, transport=kind,
                 feature_layers=list(request.feature_layer_ids))
        return verifier_pb2.HandshakeResponse(
            transport=kind, verifier_ring=writer.ring_name or "", verifier_ring_slot_bytes=writer.slot_bytes,
            verifier_ring_slots=writer.num_slots, model_type=cfg.model_type, vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size, max_context=self.engine.max_context,
            eos_token_id=cfg.eos_token_id[0] if cfg.eos_token_id else -1, eos_token_ids=cfg.eos_token_id,
            tp_size=self.settings.tp, kv_capacity_tokens=self.engine.cache.capacity_tokens, kv_page_size=self.engine.cache.page_size,
            verifier_id=self.verifier_id, device=device_name(self.engine.model_device),
            feature_bytes_per_token=len(layers) * cfg.hidden_size * self.engine.model.dtype.itemsize,
            target_digest=self.target_digest, step_socket=self.step_socket if peer.socket_key else "",
            step_socket_key=peer.socket_key)

    async def VerifyStream(self, request_iterator: AsyncIterator[verifier_pb2.VerifyRequest],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[verifier_pb2.VerifyResponse]:
        draft_id = dict(context.invocation_metadata()).get("draft-id", "")
        peer = self._peers.get(draft_id)
        if peer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no handshake for draft-id {draft_id!r}; call Handshake first")
        try:
            async with contextlib.aclosing(self._serve_steps(peer, request_iterator)) as steps:
                async for resp in steps:
                    yield resp
        except ServiceError as exc:   # the stream itself is refused: the draft hand-shakes again
            await context.abort(exc.code, exc.message)

    def _socket_peer(self, key: bytes | None) -> _Peer:
        """The handshake a step socket's key names."""
        peer = next((p for p in self._peers.values() if step_socket.same_key(p.socket_key, key)), None)
        if peer is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "no handshake for this step socket key; call Handshake first")
        return peer

    async def _serve_steps(self, peer: _Peer, request_iterator: AsyncIterator[verifier_pb2.VerifyRequest]
                           ) -> AsyncIterator[verifier_pb2.VerifyResponse]:
        """One draft's stream of steps, from its gRPC stream or its step socket. A ServiceError
        raised out of here refuses the stream itself."""
        draft_id = peer.draft_id
        if peer.streamed:   # two streams would interleave steps on one pair of rings, and either's end drops both
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"draft {draft_id}: a verify stream of this handshake is already open; "
                               "hand-shake again to replace it")
        peer.streamed = True
        try:
            peer.writer.attached()   # the draft mapped our ring before it opened this stream
            requests = request_iterator.__aiter__()
            while (req := await self._idle.next(requests)) is not None:   # None: ended, or stopping
                t0 = time.perf_counter()
                stages: list[_Stage] = []
                try:
                    resp = self._inline(self._step, peer, req, stages) if self.settings.tp == 1 and not req.prefills \
                        and _tree_nodes(req.trees) <= INLINE_MOST_NODES else None
                    if resp is None:
                        resp = await self._locked(self._step, peer, req, stages)
                except ServiceError:   # the stream itself is refused: the draft hand-shakes again
                    raise
                except Exception:   # the engine failed the step (a CUDA error, a bug): say so here, not only downstream
                    log.exception("verify_step_failed", draft_id=draft_id, sequence=req.sequence)
                    raise
                if req.prefills or req.verify_ids:   # a release-only step is no decode step
                    stages.append(("stream_step", (time.perf_counter() - t0) * 1e3))
                try:
                    yield resp
                finally:   # the answer has gone (or the stream ended): at C=1 the draft waits for nothing here
                    self._record(stages)
        finally:
            # The stream ended (cleanly or because the draft died): nothing it held may leak. gRPC
            # cancels a dead draft's handler, and a cancelled await would cancel the clean-up before
            # its thread started (the dead draft's requests, KV pages and ring stayed), so it is shielded.
            cleanup = self._track(asyncio.ensure_future(self._locked(self._end_stream, draft_id, peer)))
            await asyncio.shield(cleanup)

    def end_idle_streams(self) -> None:
        """At shutdown: ends every verify stream between two steps, and every other one after its
        step in flight. An open stream kept the server's whole grace period (5 s) even when idle,
        and its draft saw the verifier as up until the process was gone; ended, the draft reports
        NOT_SERVING at once and hand-shakes again when it comes back. The step socket takes no new
        stream from here on either."""
        self._idle.end()
        self._stop_step_socket()

    def _track(self, future: asyncio.Future) -> asyncio.Future:
        """Keeps a background clean-up referenced until it finishes."""
        self._cleanups.add(future)
        future.add_done_callback(self._cleanups.discard)
        return future

    async def _expire_if_silent(self, peer: _Peer) -> None:
        def expire() -> bool:   # decided under the engine lock: the stream may open while it is awaited
            if peer.streamed or self._peers.get(peer.draft_id) is not peer:
                return False
            self._end_stream(peer.draft_id, peer)
            return True
        if not peer.streamed and await self._locked(expire):
            log.warning("peer_expired", draft_id=peer.draft_id, reason="no verify stream after the handshake",
                        timeout_s=self.settings.peer_stream_timeout_s)

    async def keep_awake(self, interval_s: float) -> None:
        """Sends the group a call that does nothing whenever no call went to it for `interval_s`
        (`EngineGroup.heartbeat`); a call in progress is a collective itself, so then none."""
        def beat() -> None:
            if self._engine_lock.acquire(blocking=False):
                try:
                    if not self._group_stopped:   # after the stop broadcast the workers are gone
                        self.group.heartbeat()
                finally:
                    self._engine_lock.release()
        await asyncio.to_thread(beat)   # at once: the workers have waited since their own start-up
        while True:   # a gap between two collectives is at most twice the interval
            await asyncio.sleep(interval_s)
            if time.monotonic() - self.group.last_call >= interval_s:
                await asyncio.to_thread(beat)

    def stop_group(self, timeout_s: float) -> bool:
        """Broadcast the workers' stop once no engine call is running (a step still in flight after
        the server's grace would otherwise interleave its collectives with the stop). False when
        the engine stayed busy for `timeout_s`: the workers are then left to the SIGTERM."""
        if not self._engine_lock.acquire(timeout=timeout_s):
            return False
        try:
            self._group_stopped = True
            self.group.stop()
        finally:
            self._engine_lock.release()
        return True

    def mark_group_stopped(self) -> None:
        """The workers are being ended without their stop broadcast (the engine stayed busy)."""
        self._group_stopped = True

    def _inline(self, fn, *args):
        """Runs `fn` on the event loop's thread when the engine lock is free at once, else returns
        None (the caller then takes a worker thread). For verify-only steps of one rank: they are
        short (bounded by the trees' nodes), and a worker thread's hand-off both ways cost 0.2-0.3
        ms a step, which at C=1 is on the critical path. Prefills, which can run long, clean-ups,
        and every step with TP ranks (whose collectives wait on the other ranks, and would keep the
        loop from reporting a dead rank) keep their worker thread (`_locked`). Health checks and
        handshakes wait for the inline step in progress, a few milliseconds."""
        if not self._engine_lock.acquire(blocking=False):
            return None
        try:
            return fn(*args)
        finally:
            self._engine_lock.release()

    async def _locked(self, fn, *args):
        """Runs `fn` in a worker thread holding the engine lock for all of it."""
        def run():
            with self._engine_lock:
                return fn(*args)
        return await asyncio.to_thread(run)

    def _end_stream(self, draft_id: str, peer: _Peer) -> int:
        # Only this handshake's requests: an old stream whose end is noticed late must not free
        # those the draft admitted since on its new one. After the workers' stop (the server is
        # going) no call may reach the group: rank 0 alone would wait on workers that are gone.
        freed = 0
        try:
            freed = 0 if self._group_stopped else self.group.call("release_owner", peer.owner)
        except GroupFailed:   # a rank died: the group goes, and what the stream held with it (said once, as rank_died)
            pass
        finally:   # a release that failed must not leave the rings mapped as well
            if self._peers.get(draft_id) is peer:
                self._drop_peer(draft_id)
        self._observe()
        log.info("stream_closed", draft_id=draft_id, requests_freed=freed)
        return freed

    def _retire_peer(self, draft_id: str) -> None:
        peer = self._peers.get(draft_id)
        if peer is not None:
            try:
                if not self._group_stopped:
                    self.group.call("release_owner", peer.owner)
            except GroupFailed:   # as in `_end_stream`
                pass
            finally:
                self._drop_peer(draft_id)

    def _drop_peer(self, draft_id: str) -> None:
        peer = self._peers.pop(draft_id, None)
        if peer is None:   # its stream's clean-up came first
            return
        peer.writer.release_all()
        peer.writer.close()
        peer.reader.close()

    def _step(self, peer: _Peer, req: verifier_pb2.VerifyRequest,
              stages: list[_Stage] | None = None) -> verifier_pb2.VerifyResponse:
        """The step's answer; its stages' times go to ``stages``, for the metrics to observe once
        the answer has gone (`_record`)."""
        stages = [] if stages is None else stages
        if self._peers.get(peer.draft_id) is not peer:   # expired, or the draft hand-shook again since
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"draft {peer.draft_id}: this stream's handshake is no longer current; hand-shake again")
        t0 = time.perf_counter()
        inputs, rejected = [], {}   # rejected: by position in req.prefills (an id may come twice)
        room = self.engine.cache.capacity_tokens   # the most prompt tokens any step can commit
        for k, p in enumerate(req.prefills):
            why, code = None, grpc.StatusCode.INVALID_ARGUMENT   # this request fails alone; the others go on
            length = p.prompt_offset + len(p.token_ids)
            if length >= self.engine.max_context:   # refused here, not on every rank after a broadcast of it
                why = f"prompt has {length} tokens; max context is {self.engine.max_context}"
            elif len(p.token_ids) > room:   # past the whole cache: copied, broadcast and admitted one by one for nothing
                why, code = "KV cache full (the step's prompts hold more tokens than the cache)", \
                    grpc.StatusCode.RESOURCE_EXHAUSTED
            else:
                try:
                    sampling = sampling_from_proto(p.sampling)
                except ValueError as exc:
                    why = f"sampling: {exc}"
            if why is not None:
                rejected[k] = verifier_pb2.ItemResult(request_id=p.request_id, error_code=code.value[0],
                                                      error_message=why)
                continue
            room -= len(p.token_ids)
            inputs.append(PrefillInput(p.request_id, list(p.token_ids), sampling, p.reserve_tokens,
                                       owner=peer.owner, more=p.prompt_continues, offset=p.prompt_offset))
        new = {x.request_id for x in inputs if x.offset == 0 and x.token_ids}
        could = self.engine.active_requests + sum(1 for rid in new if not self.engine.holds(rid))
        if len(req.verify_ids) > could:
            # More trees than requests held here: a million one-node trees of unknown ids took the
            # event loop (or, with ranks, every rank) for seconds, all to be refused one by one.
            # (Only new prompts the server keeps count, each id once and none held already: padded
            # with refused, empty or repeated ones, it passed.)
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"draft {peer.draft_id}: a step of {len(req.verify_ids)} trees, more than the "
                               f"{could} requests it could verify")
        try:
            peer.writer.release(req.released_slots)
        except ValueError as exc:   # a draft that names slots our ring does not have is out of step with it
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"draft {peer.draft_id}: released_slots: {exc}") from None
        if req.release:
            self.group.call("release", list(req.release), peer.owner)
        # A verify-only step makes no prefill call (with TP, that is one broadcast to the ranks less).
        prefill = self.group.call("prefill", inputs) if inputs else None
        released: list[int] = []
        if req.verify_ids:
            verify = self._verify(peer, req)
            commit_ms = self.engine.take_commit_ms()
            if commit_ms is not None:
                stages.append(("commit", commit_ms))
            slot = _slot_or_none(req.trees)
            if slot is not None:   # read and copied into the forward: the draft may reuse the slot
                released.append(slot)
        else:
            verify = None
        if inputs or verify is not None:
            stages.append(("verify", (time.perf_counter() - t0) * 1e3))
        parts = [o.features for o in (prefill, verify) if o is not None and o.features.shape[0]]
        features = self.engine.cat_features(parts)
        t_write = time.perf_counter()
        before = peer.writer.inline_fallbacks
        try:
            bundle = peer.writer.write({"features": features})
            inline = "slot_too_small" if peer.writer.inline_fallbacks != before else None
        except (RingFull, OSError) as exc:   # every slot held, or /dev/shm full: the step is committed, its
            inline = "ring_full" if isinstance(exc, RingFull) else "ring_error"   # features must still reach it
            log.warning(inline, draft_id=peer.draft_id, slots=peer.writer.num_slots, error=str(exc))
            bundle = InlineWriter().write({"features": features})
            peer.writer.inline_fallbacks += 1
        if inline is not None:
            self.metrics.ring_inline_fallbacks.labels(inline).inc()
        if features.shape[0]:
            stages.append(("features", (time.perf_counter() - t_write) * 1e3))
        return verifier_pb2.VerifyResponse(
            sequence=req.sequence,
            prefills=_in_order(req.prefills, rejected, prefill.items if prefill is not None else []),
            verifies=[_item_pb(o) for o in verify.items] if verify is not None else [],
            features=bundle, released_slots=released, verify_ms=(time.perf_counter() - t0) * 1e3)

    def _verify(self, peer: _Peer, req: verifier_pb2.VerifyRequest) -> StepOutcome:
        """The step's trees verified; a bundle that cannot be read or split into the step's trees
        fails those trees with its reason, and the stream, the draft's other requests and (with
        tensor parallelism) the other ranks go on."""
        ids = list(req.verify_ids)
        try:
            in_slot = _check_tree_refs(len(ids), req.trees)   # sizes first, from the message: what is read is no more
            trees = peer.reader.read(req.trees)
        except ValueError as exc:   # the transport's account of a bundle it cannot read
            trees, error = {}, ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"tree bundle: {exc}")
        else:
            missing = [k for k in TREE_FIELDS if k not in trees]
            error = ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"the tree bundle lacks {missing}") if missing else None
        if error is None:
            # Copies, not views of the draft's ring: checked once and then read again by the engine,
            # a view the draft changed in between could put an index past its table on the GPU (a
            # device assert ends the process, for every draft). A reader of copies made them already,
            # as the message's own bytes (small host trees, every C=1 step's) were.
            args = [trees[k].clone() if in_slot and not peer.reader.copies else trees[k] for k in TREE_FIELDS]
            # Here first, before the call goes to the other ranks: a bundle of millions of nodes was
            # pickled to every rank (and onto every GPU, with NCCL) only for each to refuse it.
            error = tree_shape_error(len(ids), *args)
        if error is None:
            if self.settings.tp > 1:   # the call is pickled to the workers: host tensors
                args = [t.to("cpu") for t in args]
            try:   # the engine checks the trees' shapes before any collective too, on every rank alike
                return self.group.call("verify", ids, *args, peer.owner)
            except GroupFailed:   # not these trees' fault: the stream ends (the draft hand-shakes again)
                raise
            except ServiceError as exc:
                error = exc
        log.warning("verify_refused", draft_id=peer.draft_id, requests=len(ids), error=error.message)
        return StepOutcome([ItemOutcome(rid, error=error) for rid in ids], self.engine.cat_features([]))

    def _record(self, stages: list[_Stage]) -> None:
        """A step's stage times and the gauges, observed after its answer went out: off the path
        from the engine's result to the draft, which at C=1 is every step's."""
        for stage, ms in stages:
            self.metrics.step_ms.labels(stage).observe(ms)
        self._observe()

    def _observe(self) -> None:
        """Gauges that show whether a dead draft gave everything back: KV pages, requests, peers,
        ring slots (and, read at scrape time, the GPU bytes its ring held)."""
        peers = list(self._peers.values())
        self.metrics.kv_pages_free.set(self.engine.cache.pages_free)
        self.metrics.running.set(self.engine.active_requests)
        self.metrics.peers.set(len(peers))
        self.metrics.ring_slots_in_use.set(sum(p.writer.slots_in_use for p in peers))


def _tree_nodes(bundle: common_pb2.TensorBundle) -> int:
    """The nodes a step's tree bundle declares (its tokens' length; 0 where it names none)."""
    # Not multiplied out past one dimension (`_check_tree_refs` refuses it): 40k dimensions took seconds.
    return max((math.prod(ref.shape) if len(ref.shape) <= 1 else sys.maxsize
                for ref in bundle.tensors if ref.name == "tokens"), default=0)


def _check_tree_refs(num_trees: int, bundle: common_pb2.TensorBundle) -> bool:
    """ValueError where the tree bundle names a tensor other than `TREE_FIELDS`, one twice, or one of
    more elements than `num_trees` trees of the largest budget have, or spans several slots:
    checked on the message, before a byte of it is read (a draft's ring is its own: a slot of it
    declared gigabytes long was read in full, and one span named under a thousand names was read a
    thousand times, a private copy each; a bundle over two slots was read, and neither given back).
    Returns whether the bundle is in a slot (else its bytes are the message's own)."""
    in_slot = bundle_slot(bundle) is not None   # raises for several slots
    most = num_trees * (MAX_BUDGET + 1)
    names = [ref.name for ref in bundle.tensors]
    extra = [n for n in names if n not in TREE_FIELDS]
    if extra or len(set(names)) != len(names):
        raise ValueError(f"tree bundle names [{', '.join(name_text(n) for n in names[:8])}"
                         f"{', ...' if len(names) > 8 else ''}]: expected each of {list(TREE_FIELDS)} once")
    for ref in bundle.tensors:
        shape = ref.shape
        if len(shape) > 1 or (shape[0] if shape else 1) > most:
            raise ValueError(f"tensor {name_text(ref.name)} of shape {shape_text(shape)}: {num_trees} trees "
                             f"have at most {most} nodes, one dimension")
    return in_slot


def _slot_or_none(bundle: common_pb2.TensorBundle) -> int | None:
    try:
        return bundle_slot(bundle)
    except ValueError:   # several slots: refused before it is read (`_check_tree_refs`); none is given back
        return None


def _in_order(prefills, rejected: dict[int, verifier_pb2.ItemResult], done) -> list[verifier_pb2.ItemResult]:
    """The step's prefill results in request order: the engine's, with the rejected ones (by
    position: an id sent twice, once with bad sampling, has two results) between."""
    items = iter(done)
    return [rejected[k] if k in rejected else _item_pb(next(items)) for k in range(len(prefills))]


def _item_pb(o) -> verifier_pb2.ItemResult:
    if o.error is not None:
        return verifier_pb2.ItemResult(request_id=o.request_id, error_code=o.error.code.value[0],
                                       error_message=o.error.message)
    return verifier_pb2.ItemResult(request_id=o.request_id, token_ids=o.tokens, committed=o.committed)


def check_feature_layers_setting(settings: VerifierSettings) -> None:
    """``verifier.feature_layers`` and ``verifier.max_context`` against the checkpoint, from its
    config alone (before the weights: minutes on a large model)."""
    config = read_config(Path(settings.model_path))
    depth = config.get("num_hidden_layers")
    bad = [i for i in settings.feature_layers if isinstance(depth, int) and i >= depth]
    if bad:
        raise SettingsError(f"verifier.feature_layers: {bad} outside the target's {depth} layers (0..{depth - 1})")
    longest = config.get("max_position_embeddings")
    if isinstance(longest, int) and settings.max_context > longest:
        raise SettingsError(f"verifier.max_context: {settings.max_context} is past the model's "
                            f"max_position_embeddings ({longest})")


def build_engine(settings: VerifierSettings, tp: TensorParallel | None = None) -> VerifierEngine:
    """Start-up phases: load weights (this rank's slice), size the KV cache. Each logs what it decided."""
    dtype = _DTYPES[settings.dtype]
    tp = tp or TensorParallel(0, 1)
    torch.set_num_threads(settings.cpu_threads)
    device = str(pin_device(rank_device(settings.device, tp.rank), "verifier.device"))   # Triton, graphs, rings follow it
    t0 = time.perf_counter()
    require_checkpoint(settings.model_path, "verifier.model_path")
    check_feature_layers_setting(settings)   # before the weights: minutes on a large model
    model = TargetModel.load(Path(settings.model_path), dtype=dtype, device=device, tp=tp)
    cfg = model.config
    log.info("weights_loaded", path=settings.model_path, layers=cfg.num_hidden_layers, rank=tp.rank, tp=tp.size,
             seconds=round(time.perf_counter() - t0, 2))
    tp.align()   # the warm-up's collectives and the workers' wait for calls time out; loading may not
    if settings.max_context > cfg.max_position_embeddings:
        raise SettingsError(f"verifier.max_context: {settings.max_context} is past the model's "
                            f"max_position_embeddings ({cfg.max_position_embeddings})")
    max_context = settings.max_context or cfg.max_position_embeddings
    num_pages = -(-settings.kv_capacity_tokens // settings.page_size)
    try:
        cache = PagedKVCache(cfg.num_hidden_layers, num_pages, settings.page_size,
                             cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype, torch.device(device))
    except (torch.OutOfMemoryError, RuntimeError) as exc:   # the CPU allocator raises RuntimeError
        need = num_pages * settings.page_size * cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        raise SettingsError(f"verifier.kv_capacity_tokens: {settings.kv_capacity_tokens} tokens need "
                            f"{need * dtype.itemsize / 2**30:.1f} GiB on {device} beside the weights, more than "
                            f"there is ({str(exc).splitlines()[0][:120]})") from None
    log.info("kv_cache_sized", pages=num_pages, page_size=settings.page_size, tokens=num_pages * settings.page_size,
             max_context=max_context)
    engine = VerifierEngine(model, cache, max_context=max_context, prefill_chunk=settings.prefill_chunk,
                            prefill_graphs=settings.prefill_graphs)
    if settings.feature_layers:   # before the captures, which bake them in
        engine.set_feature_layers(settings.feature_layers)
    if settings.cuda_graphs and model.capturable:
        graphs = engine.enable_graphs(batch_buckets=settings.graph_batches, node_buckets=settings.graph_nodes)
        log.info("cuda_graphs", batch_buckets=list(graphs.batch_buckets), node_buckets=list(graphs.node_buckets))
        if not settings.feature_layers:
            log.warning("feature_layers_unset", graphs=len(graphs.batch_buckets) * len(graphs.node_buckets),
                        advice="the first drafter's handshake captures every graph again with its layers (long on a "
                               "large model: the drafter may time out); set verifier.feature_layers to its "
                               "dflash_config.target_layer_ids")
    elif settings.cuda_graphs and model.device.type == "cuda":
        log.warning("cuda_graphs_off", reason="MoE experts run the torch loop (needs INT4 experts and a "
                    "bfloat16/float16 dtype for the fused kernel); verify runs eagerly")
    if model.device.type == "cuda" and settings.warmup_budgets:
        warm_up(engine, settings)
    return engine


def warm_up(engine: VerifierEngine, settings: VerifierSettings) -> None:
    """The start-up's compiles and captures. It runs the largest step the graph buckets allow, so
    a GPU without room for it beside the weights and the KV cache fails the start with the
    settings to change, rather than the first large batch mid-serving with a traceback."""
    t0 = time.perf_counter()
    try:
        engine.warm_up(settings.warmup_budgets)
    except torch.OutOfMemoryError as exc:
        graphs = engine.graphs
        also = (f" or drop the largest entry of verifier.graph_batches or verifier.graph_nodes (the warm-up runs "
                f"{graphs.batch_buckets[-1]} trees of {graphs.node_buckets[-1]} nodes)"
                if graphs is not None and graphs.batch_buckets and graphs.node_buckets else "")
        raise SettingsError(
            f"the verifier's warm-up ran out of GPU memory beside the weights and a KV cache of "
            f"{settings.kv_capacity_tokens} tokens: lower verifier.kv_capacity_tokens{also}. "
            f"{str(exc).splitlines()[0][:120]}") from None
    log.info("verifier_warm", budgets=list(settings.warmup_budgets), seconds=round(time.perf_counter() - t0, 2),
             graphs=len(engine.graphs.captured) if engine.graphs is not None else 0)


_FAILED_GROUP_EXIT_S = 30.0   # a group that lost a rank has this long to stop in order, then rank 0 exits
_START_UP_SETTLE_S = 2.0      # a worker died during rank 0's start-up: rank 0's own error may follow this soon


def _end_start_up(reason: str, workers: list, settled: threading.Event) -> None:
    """A worker died after the group formed, while rank 0 still loads or warms up: rank 0 may sit
    in a collective that waits for it (NCCL: until `tp_timeout_s`, then an abort and a crash
    dump), so the start ends now, naming the rank; exit 3 as `ddtree serve` exits on UNAVAILABLE.
    Unless rank 0 settles its start itself within a moment: a worker that died of the error rank 0
    is about to raise (its KV cache does not fit) leaves that error, which names the setting."""
    if settled.wait(_START_UP_SETTLE_S):
        return
    log.error("rank_died", reason=reason, during="start-up")
    print(f"ddtree serve verifier: UNAVAILABLE: {reason} during the verifier's start-up", file=sys.stderr, flush=True)
    stop_workers(workers, grace_s=0.0)
    os._exit(3)


def kernel_overrides(settings: VerifierSettings) -> str | None:
    """The kernel override variables (README "Kernel choice"), each refused by name where it does
    not parse, before the weights load; returns the tree-attention backend forced, if one is."""
    try:
        backend = backend_from_env()
        switch_from_env()
        # Read by the GPU's fused MoE only: the CPU path never loads its kernels (nor Triton).
        if os.environ.get("DDTREE_INT4_MOE_CONFIG") and settings.device.startswith("cuda"):
            from kernels.int4_moe import config_from_env
            config_from_env()
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    if backend in ("hopper", "triton") and not settings.device.startswith("cuda"):   # else ignored: said, not guessed
        raise SettingsError(f"{BACKEND_ENV}={backend}: a GPU kernel, and verifier.device is {settings.device}; "
                            "unset it (or 'reference') to serve on the CPU")
    return backend


async def serve(settings: VerifierSettings, config_path: str | None = None) -> None:
    configure_logging("verifier", settings.json_logs)
    # Ports first: one that cannot be had fails start-up now, not after the weights load.
    check_port_free(settings.host, settings.port, "verifier.port")
    token = internal_token()   # asked of every draft's calls
    kernel_overrides(settings)
    check_rank_devices(settings)
    metrics = Metrics("verifier")
    metrics_port = serve_metrics(metrics, settings.host, settings.metrics_port)
    workers = []
    tp = TensorParallel(0, 1)
    starting = None
    try:
        if settings.tp > 1:
            store = master_store(settings.tp)
            workers = spawn_workers(settings, config_path, f"tcp://127.0.0.1:{store.port}")
            # Watched from here: a worker that exited while the process group formed left rank 0
            # waiting tp_timeout_s, then failing with a bare store timeout instead of its rank.
            starting = watch_workers(workers, lambda reason: _end_start_up(reason, workers, starting))
            tp = TensorParallel(0, settings.tp, backend=backend_for(settings), timeout_s=settings.tp_timeout_s,
                                device=rank_device(settings.device, 0), peers_gone=lambda: first_exit(workers),
                                store=store)
        engine = build_engine(settings, tp)
        group = EngineGroup(engine, tp)
        server, health = new_server([verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name],
                                    internal_interceptors(token))
        servicer = VerifierServicer(group, settings, metrics, shared_weights_digest(Path(settings.model_path)))
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        # Its port may have been taken while the weights loaded: the workers go with this failure too.
        port = listen(server, host_port(settings.host, settings.port), "verifier.port")
        warn_if_reachable(settings.host, "verifier.host", bool(token))
        await server.start()
        await servicer.start_step_socket()
    except BaseException:
        if starting is not None:
            starting.set()   # this start-up's own end, not a rank's death
        stop_workers(workers, grace_s=0.0)   # the others would wait for this rank until their limits
        raise
    if starting is not None:
        starting.set()
    log.info("serving", address=host_port(settings.host, port), tp=settings.tp, metrics_port=metrics_port,
             step_socket=step_socket.log_name(servicer.step_socket))
    died: list[str] = []
    loop = asyncio.get_running_loop()

    def on_death(reason: str) -> None:
        # A lost rank ends the group: report NOT_SERVING now, then stop (the supervisor restarts it).
        if died:   # the watchdog and a failed call may both see it
            return
        died.append(reason)
        log.error("rank_died", reason=reason)
        loop.call_soon_threadsafe(health.enter_graceful_shutdown)
        os.kill(os.getpid(), signal.SIGTERM)
        # The shutdown joins threads that may sit in a collective no dead rank will finish (NCCL,
        # the one-shot all-reduce): bounded, so the supervisor gets an exit to restart from.
        deadline = threading.Timer(_FAILED_GROUP_EXIT_S, os._exit, (3,))
        deadline.daemon = True   # an exit in order does not wait for it
        deadline.start()

    group.on_failure = on_death
    watchdog = watch_workers(workers, on_death)
    # Idle workers wait for the next call in a collective with the compute collectives' timeout.
    awake = asyncio.ensure_future(servicer.keep_awake(settings.tp_timeout_s / 4)) if workers else None
    try:
        await serve_until_signal(server, health, on_stop=servicer.end_idle_streams)
    finally:
        await servicer.close_step_socket(grace_s=5.0)   # gRPC's stop gave its own streams as long
        if awake is not None:
            awake.cancel()
        watchdog.set()  # from here on a worker leaving is the shutdown, not a failure
        # ... and so is a call that fails on it: a prefill still running past the grace fails once
        # its workers get the SIGTERM below, and reported a dead rank (rank_died, exit 3).
        group.on_failure = None
        stopped = False
        if workers and not died:
            try:
                stopped = servicer.stop_group(timeout_s=10.0)
            except Exception:  # noqa: BLE001 - a worker already gone; it is being reaped below
                pass
            if not stopped:   # the clean-ups still waiting for the engine must not call the workers
                servicer.mark_group_stopped()
        # Workers leave on the stop broadcast; after a rank died the others may sit in a collective.
        stop_workers(workers, grace_s=10.0 if stopped else 0.0)
    if died:
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, died[0])
