"""The `cuda_ipc` transport: a ring of slots in GPU memory shared through a CUDA IPC handle.

The owner allocates the ring once, on its own GPU, and publishes a handle for it in the handshake;
the peer maps it once. Each message then names slot, offset, shape and dtype, exactly like `shm`.
The producer synchronises its stream before the message leaves, so the consumer never sees a
partial write; a slot is reused only after the consumer released it (or `release_all` when the
consumer's stream ended). Reads are zero-copy views on the owner's GPU, wherever the consumer runs:
a consumer on another GPU copies what it keeps to its own device itself (`.to(device)`), so every
cross-GPU copy is explicit at the call site.

Two GPUs of one host: the peer maps the ring on the owner's physical GPU, found by UUID, because a
process with another `CUDA_VISIBLE_DEVICES` numbers the GPUs differently; a GPU it cannot see at
all makes the attach fail (ValueError), and the handshake falls back to `shm`.

Lifetime: torch counts each share in a shared file and keeps the block (in its IPC "limbo") until
every consumer has decremented; a consumer that died never does, so the ring (slots x slot_bytes,
32 MiB for the verifier's) would stay allocated for the life of the owner, once per dead peer. Here
the ring lives as long as the owner's streams need it: the owner drops torch's count at once and
gives the peer a counter name that does not exist (torch's consumer-side release is best-effort, so
it is a no-op), and `close()`, called once the peer reads nothing more, frees it. CUDA leaves a read
through a mapping of freed memory undefined, so the verifier frees its ring when the stream ended
(the draft waited for its own reads of it before ending it), and the draft keeps its ring for its
next stream until a handshake shows that the verifier let go of it (`VerifierClient._ring`).

The handle travels as plain JSON (never pickle: a handshake is input from another process).

Unlike `shm`, a slot carries no sequence header the reader could check (the header would be one
more device read and sync a message): a message naming a slot that was released and rewritten is
read as the new contents, not refused. The slot protocol (released only by the consumer, or all at
once when its stream ended) is what keeps that from happening.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields

import torch

from ddtree.v1 import common_pb2
from services.common.logging import get_logger
from services.common.transport import (ALIGNMENT, RingFull, RingWriter, SlotRing, TensorReader, _dtype_name,
                                       _round_up, name_text, tensor_bytes)

__all__ = ["CudaIpcWriter", "CudaIpcReader", "RingFull", "RingHandle", "encode_ring_handle",
           "decode_ring_handle", "local_device_index"]

log = get_logger("transport")

INLINE_HOST_BYTES = 64 << 10   # host payloads up to this size go inline (see CudaIpcWriter.write)

_HANDLE_VERSION = 1
_NO_REFCOUNT = b"/ddtree-cuda-ipc-owner-counts"   # a counter file no process creates (see the module doc)
_TORCH_REFCOUNT_SLOTS = 10000   # entries in one of torch's CUDA IPC counter files (CUDA_IPC_REF_COUNTER_FILE_SIZE)


@dataclass(frozen=True)
class RingHandle:
    """What a peer needs to map the owner's ring: the fields of torch's `_share_cuda_()` tuple
    (the same eight `_new_shared_cuda` takes back), plus the owner's physical GPU."""

    device_index: int          # the owner's CUDA index, in the owner's numbering
    device_uuid: str           # the owner's physical GPU ("" where torch cannot say)
    handle: bytes              # cudaIpcMemHandle of the allocation that holds the ring
    size_bytes: int            # the ring's storage size
    offset_bytes: int          # where the storage starts inside that allocation
    ref_counter_handle: bytes  # torch's shared reference-count file for this share
    ref_counter_offset: int
    event_handle: bytes        # IPC event the peer waits on before its first read
    event_sync_required: bool


_BYTES_FIELDS = ("handle", "ref_counter_handle", "event_handle")


def encode_ring_handle(h: RingHandle) -> str:
    """The handshake's `*_ring` string for a cuda_ipc ring: JSON, bytes as base64."""
    doc = {k: base64.b64encode(v).decode() if k in _BYTES_FIELDS else v for k, v in asdict(h).items()}
    return json.dumps({"cuda_ipc": _HANDLE_VERSION, **doc}, separators=(",", ":"))


def decode_ring_handle(text: str) -> RingHandle:
    """Parses and type-checks a peer's handle; ValueError names what is wrong."""
    try:
        doc = json.loads(text)
    except (ValueError, TypeError):
        raise ValueError("cuda_ipc ring handle is not JSON (a peer of an older version?)") from None
    if not isinstance(doc, dict) or doc.get("cuda_ipc") != _HANDLE_VERSION:
        raise ValueError(f"cuda_ipc ring handle has no version {_HANDLE_VERSION} marker")
    values = {}
    for f in fields(RingHandle):
        if f.name not in doc:
            raise ValueError(f"cuda_ipc ring handle lacks {f.name!r}")
        v = doc[f.name]
        if f.name in _BYTES_FIELDS:
            try:
                v = base64.b64decode(v, validate=True) if isinstance(v, str) else None
            except binascii.Error:
                v = None
            ok = v is not None
        elif f.type == "bool":
            ok = isinstance(v, bool)
        elif f.type == "int":
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
        else:
            ok = isinstance(v, str)
        if not ok:
            raise ValueError(f"cuda_ipc ring handle field {f.name!r} has a bad value {doc[f.name]!r}")
        values[f.name] = v
    return RingHandle(**values)


def local_device_index(owner_uuid: str, owner_index: int, local_uuids: Sequence[str]) -> int:
    """This process's index of the owner's GPU.

    By UUID when known: the owner's index is in its own numbering, which differs from ours when the
    two processes were given different `CUDA_VISIBLE_DEVICES`. Without a UUID, trust the index.
    """
    if not owner_uuid:
        if not 0 <= owner_index < len(local_uuids):
            raise ValueError(f"the ring's owner is on cuda:{owner_index}; this process sees {len(local_uuids)} GPUs")
        return owner_index
    if owner_uuid in local_uuids:
        return list(local_uuids).index(owner_uuid)
    raise ValueError(f"the ring's owner GPU {owner_uuid} is not visible in this process "
                     f"(CUDA_VISIBLE_DEVICES); the peers cannot share GPU memory")


def _device_uuid(index: int) -> str:
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else ""


def _local_uuids() -> list[str]:
    return [_device_uuid(i) for i in range(torch.cuda.device_count())]


def _disown_share(ref_counter_handle: bytes, ref_counter_offset: int) -> bool:
    """Drops the count torch took for our one share, so `close()` frees the ring whatever the peer
    does; False where this torch cannot (the peer then keeps torch's own counting)."""
    try:
        torch.UntypedStorage._release_ipc_counter_cuda(ref_counter_handle, ref_counter_offset)
    except (AttributeError, RuntimeError, TypeError):
        return False
    return True


def _resolve(device: torch.device | str | None) -> torch.device:
    """A CUDA device with its index: "cuda" means the current device (see services.common.devices)."""
    d = torch.device(device if device is not None else "cuda")
    if d.type != "cuda":
        raise ValueError(f"a cuda_ipc ring lives on a GPU, not on {d}")
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


class _RingViews:
    """A ring's bytes seen as each dtype a tensor in it has (made once a dtype): a tensor's place in
    a slot is then one strided view, where indexing, slicing and two views made four tensors a call,
    each some microseconds of host time on every step's path (the features, each C=1 step)."""

    def __init__(self, buf: torch.Tensor) -> None:
        assert buf.is_contiguous() and buf.storage_offset() == 0
        self._buf = buf                                  # [slots, slot bytes] uint8
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def at(self, slot: int, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """``shape`` of ``dtype`` at byte ``offset`` of ``slot``. Bounds are the caller's: the reader
        checks a peer's slot, offset and byte count before (`TensorReader.read`)."""
        if offset % dtype.itemsize:   # a floor division would place it some bytes early, silently
            raise ValueError(f"slot offset {offset} is not a multiple of {dtype}'s {dtype.itemsize} bytes")
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self._buf.view(-1).view(dtype)
        strides, step = [], 1
        for d in reversed(shape):   # contiguous, as torch makes them
            strides.append(step)
            step *= max(d, 1)
        return typed.as_strided(tuple(shape), strides[::-1], (slot * self._buf.shape[1] + offset) // dtype.itemsize)


class CudaIpcWriter(RingWriter):
    """Owns a ring on `device` (default: the current CUDA device) and copies each bundle into a slot."""

    kind = "cuda_ipc"

    def __init__(self, slot_bytes: int, num_slots: int, device: torch.device | str | None = None) -> None:
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be >= 1, got {slot_bytes}")
        dev = _resolve(device)
        self._ring = SlotRing(num_slots)
        self._slot_bytes = _round_up(slot_bytes, ALIGNMENT)
        self._buf = torch.empty(num_slots, self._slot_bytes, dtype=torch.uint8, device=dev)  # [slots, bytes]
        self._views = _RingViews(self._buf)
        share = self._buf.untyped_storage()._share_cuda_()   # (device, handle, size, offset, rc, rc_off, ev, sync)
        index, handle, size_bytes, offset_bytes, rc_handle, rc_offset, event_handle, event_sync = share
        if _disown_share(rc_handle, rc_offset):
            rc_handle, rc_offset = _NO_REFCOUNT, 0
        self._name = encode_ring_handle(RingHandle(
            device_index=int(index), device_uuid=_device_uuid(dev.index), handle=handle, size_bytes=int(size_bytes),
            offset_bytes=int(offset_bytes), ref_counter_handle=rc_handle, ref_counter_offset=int(rc_offset),
            event_handle=event_handle, event_sync_required=bool(event_sync)))
        self._lock = threading.Lock()
        self.inline_fallbacks = 0

    @property
    def device(self) -> torch.device:
        return self._buf.device

    def write(self, tensors: Mapping[str, torch.Tensor]) -> common_pb2.TensorBundle:
        """Tensors may live anywhere (CPU, this GPU, another GPU): the copy into the slot is ordered
        before the sync below in every case (a cross-GPU copy makes this device's stream wait on it)."""
        layout, cursor = [], 0
        for name, t in tensors.items():
            _dtype_name(t.dtype)   # an unsupported dtype is refused before a slot is taken
            cursor = _round_up(cursor, ALIGNMENT)
            layout.append((name, t, cursor))
            cursor += t.nbytes
        bundle = common_pb2.TensorBundle()
        # Small host tensors (a step's trees: a few hundred ints) ride in the message itself: a slot
        # would cost a host-to-device copy and a stream sync here and a copy back on the reader.
        small_host = cursor <= INLINE_HOST_BYTES and all(not t.is_cuda for t in tensors.values())
        if cursor == 0 or cursor > self._slot_bytes or small_host:   # nothing to share, too big, or tiny
            if cursor > self._slot_bytes:
                with self._lock:
                    self.inline_fallbacks += 1
            for name, t in tensors.items():
                bundle.tensors.add(name=name, dtype=_dtype_name(t.dtype), shape=tuple(t.shape),
                                   inline_data=tensor_bytes(t))
            return bundle
        with self._lock:
            if self._buf is None:
                raise RuntimeError("cuda_ipc ring is closed")
            slot, sequence = self._ring.acquire()
            try:
                for name, t, offset in layout:
                    nbytes = t.nbytes
                    self._views.at(slot, offset, t.dtype, t.shape).copy_(t, non_blocking=True)
                    ref = bundle.tensors.add(name=name, dtype=_dtype_name(t.dtype), shape=tuple(t.shape))
                    ref.slot.slot, ref.slot.offset, ref.slot.nbytes, ref.slot.sequence = slot, offset, nbytes, sequence
                torch.cuda.current_stream(self._buf.device).synchronize()   # visible before the message leaves
            except BaseException:   # no message names the slot: a failed write held it for good
                self._ring.release([slot])
                raise
        return bundle

    def close(self) -> None:
        """Frees the ring now (see the module doc): call it once the peer reads nothing more."""
        with self._lock:
            self._buf = self._views = None  # type: ignore[assignment]   # the views hold the memory too


def _open_ring(h: RingHandle, index: int, num_slots: int, slot_bytes: int) -> torch.Tensor:
    """Maps the owner's ring on this process's `index` (the owner's GPU); [num_slots, slot_bytes] uint8."""
    torch.cuda.init()
    # torch maps the named counter file and decrements an int64 at the offset when the mapping is
    # released: accept only a counter file of torch's own naming and size (the owner's fallback
    # where it cannot disown its count), never an arbitrary file a peer names.
    rc_handle, rc_offset = h.ref_counter_handle, h.ref_counter_offset
    if not (rc_handle.startswith(b"/torch_") and 0 <= rc_offset < _TORCH_REFCOUNT_SLOTS):
        rc_handle, rc_offset = _NO_REFCOUNT, 0
    storage = torch.UntypedStorage._new_shared_cuda(index, h.handle, h.size_bytes, h.offset_bytes,
                                                    rc_handle, rc_offset, h.event_handle, h.event_sync_required)
    buf = torch.empty((0,), dtype=torch.uint8, device=torch.device("cuda", index))
    return buf.set_(storage, 0, (num_slots, slot_bytes), (slot_bytes, 1))


def _mapped_bytes(base: int, index: int) -> int | None:
    """The size of the mapping that starts at `base` on GPU `index`, from the driver
    (`cuMemGetAddressRange`); None where it cannot say (no libcuda, an error, or `base` not the
    start of a mapping: logged, the ring then taken as before). Why: torch maps a peer's handle at
    whatever size and offset the peer declares, and a ring declared past its allocation gave views
    past it, whose first read is an illegal address that ends this process's CUDA context."""
    try:
        query = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    start, size = ctypes.c_uint64(), ctypes.c_size_t()
    with torch.cuda.device(index):
        status = query(ctypes.byref(start), ctypes.byref(size), ctypes.c_uint64(base))
    if status != 0 or start.value != base:
        log.warning("cuda_ipc_ring_unbounded", status=status, mapping_start=start.value, base=base)
        return None
    return size.value


class CudaIpcReader(TensorReader):
    """Maps a peer's ring on the peer's GPU; reads are views there (copy to your device to keep them)."""

    kind = "cuda_ipc"

    def __init__(self, ring_name: str, slot_bytes: int, num_slots: int) -> None:
        h = decode_ring_handle(ring_name)
        stride = _round_up(slot_bytes, ALIGNMENT)
        if num_slots < 1 or num_slots * stride > h.size_bytes:
            raise ValueError(f"cuda_ipc ring has {h.size_bytes} bytes, handshake says {num_slots} x {slot_bytes}")
        index = local_device_index(h.device_uuid, h.device_index, _local_uuids())
        self._buf = _open_ring(h, index, num_slots, stride)                        # [slots, bytes] on the owner's GPU
        self._views = _RingViews(self._buf)
        try:   # the mapping starts `offset_bytes` before the ring (torch maps the owner's whole allocation)
            mapped = _mapped_bytes(self._buf.data_ptr() - h.offset_bytes, index)
            if mapped is not None and h.offset_bytes + num_slots * stride > mapped:
                raise ValueError(f"cuda_ipc ring: its allocation holds {mapped} bytes, the handle and handshake say "
                                 f"{num_slots} x {slot_bytes} from byte {h.offset_bytes}")
        except BaseException:
            self._buf = self._views = None   # type: ignore[assignment]  # unmaps the peer's memory
            raise

    @property
    def device(self) -> torch.device:
        """The owner's GPU, as this process numbers it: where views from `read` live."""
        return self._buf.device

    def _slot_view(self, ref: common_pb2.TensorRef, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero-copy view on the owner's GPU."""
        if ref.slot.slot >= self._buf.shape[0]:
            raise ValueError(f"tensor {name_text(ref.name)} names slot {ref.slot.slot} but the ring has {self._buf.shape[0]}")
        if ref.slot.offset + ref.slot.nbytes > self._buf.shape[1]:
            raise ValueError(f"tensor {name_text(ref.name)}: bytes [{ref.slot.offset}, {ref.slot.offset + ref.slot.nbytes}) "
                             f"fall outside a {self._buf.shape[1]}-byte slot")
        if ref.slot.nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=self._buf.device)
        return self._views.at(ref.slot.slot, ref.slot.offset, dtype, shape)

    def close(self) -> None:
        self._buf = self._views = None  # type: ignore[assignment]
