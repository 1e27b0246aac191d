"""Tensor transports between the draft and verifier processes.

gRPC carries control messages; bulk tensors travel either by reference through a ring of
fixed-size slots in shared memory ("shm"; GPU memory for "cuda_ipc", see cuda_ipc.py) or by value inside the protobuf
("inline", different hosts). Both sides speak `common_pb2.TensorBundle`, so the kind is a
stream-setup choice and the engine code never branches on it. Views a reader returns live where
the ring lives (host memory, or the owner's GPU for cuda_ipc); a consumer copies what it keeps
onto its own device.

Slot protocol (shm):
* The producer (`TensorWriter`) owns the ring: it creates the segment, hands out slots and
  unlinks its name once the consumer has attached (`attached()`; else on `close()`). The consumer
  (`TensorReader`) only attaches by name. A mapping lives as long as the views into it.
* One bundle occupies one slot; tensors inside are 64-byte aligned. A bundle that does not fit
  a slot goes inline instead (counted in `inline_fallbacks`) so a rare large message never
  stalls a stream.
* Every slot starts with a 64-byte header whose first word is the sequence number of its
  current contents (0 while being written). The message carries the sequence it expects, so a
  reader given a stale message (slot released and rewritten) fails loudly instead of silently
  decoding someone else's tensors.
* A slot is reused only after the consumer releases it, or after the owner learns the consumer
  is gone and calls `release_all()`.
* The owner writes through the segment's file descriptor, never through a mapping, and so does a
  `copy=True` reader (the verifier's of a draft's ring): a peer can shrink a segment it holds,
  and a load or store into a mapped page past the new end is SIGBUS, which ends the process and,
  for the verifier, every draft's stream. A write there grows the segment again; a read there
  comes back short and is refused as a bad message. A zero-copy reader (the draft's of its
  verifier's ring) trusts the ring's owner.
"""

from __future__ import annotations

import abc
import errno
import itertools
import math
import os
import secrets
import struct
import sys
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch

from ddtree.v1 import common_pb2

__all__ = [
    "ALIGNMENT",
    "SLOT_HEADER_BYTES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_KINDS",
    "RingFull",
    "SlotRing",
    "TensorWriter",
    "RingWriter",
    "TensorReader",
    "InlineWriter",
    "InlineReader",
    "ShmWriter",
    "ShmReader",
    "make_writer",
    "make_reader",
    "bundle_slot",
    "tensor_bytes",
]

ALIGNMENT = 64
SLOT_HEADER_BYTES = 64
SUPPORTED_KINDS = ("cuda_ipc", "shm", "inline")

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "int32": torch.int32,
    "int64": torch.int64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in SUPPORTED_DTYPES.items()}
_NUMPY_DTYPES = frozenset(d for d in SUPPORTED_DTYPES.values() if d is not torch.bfloat16)

# Header words (int64, this host's byte order) at the start of each slot.
_HDR_SEQUENCE = 0
_HDR_USED_BYTES = 1
_WORD = struct.Struct("=q")


class RingFull(RuntimeError):
    """Every slot is held by the consumer; the producer must wait for a release (backpressure)."""


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a dtype; refuses dtypes the other side might not decode identically."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"transport does not support dtype {dtype}; supported: {', '.join(SUPPORTED_DTYPES)}"
        ) from None


def _wire_dtype(ref: common_pb2.TensorRef) -> torch.dtype:
    try:
        return SUPPORTED_DTYPES[ref.dtype]
    except KeyError:
        raise ValueError(f"tensor {name_text(ref.name)} has unsupported dtype {name_text(ref.dtype)}") from None


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous host copy; works for bf16/bool where numpy does not."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)  # [nbytes]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, in C order. A host tensor goes through numpy where it has the dtype: two
    calls where `_as_bytes` makes six, and a step's trees go this way every step (each call is
    microseconds)."""
    if t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and not t.requires_grad:
        return t.numpy().tobytes()
    return _as_bytes(t).numpy().tobytes()


# A shape's rank and size, bounded before torch sees it: an empty shape with huge other dimensions
# ([0, 2**62, 2**62]) passed the byte count and raised RuntimeError (stride overflow) in torch, which
# the services' message checks, catching ValueError, did not take for a bad message.
MAX_RANK = 8
MAX_ELEMENTS = 1 << 40


def shape_text(shape: Sequence[int]) -> str:
    """A peer's shape for a message, its first dimensions only: a refusal that repeated a shape of
    60000 dimensions in every request's result turned a 2 MB message into a 384 MB reply."""
    dims = ", ".join(str(d) for d in shape[:MAX_RANK])
    return f"[{dims}]" if len(shape) <= MAX_RANK else f"[{dims}, ... ({len(shape)} dimensions)]"


def name_text(name: str) -> str:
    """A peer's tensor name for a message, cut as `shape_text` cuts a shape."""
    return repr(name) if len(name) <= 64 else f"{name[:64]!r}... ({len(name)} characters)"


def _expected_nbytes(ref: common_pb2.TensorRef, dtype: torch.dtype) -> int:
    # The rank first: a product over tens of thousands of large dimensions took seconds, on the event loop.
    # One pass over a tuple: each read of the message's repeated field costs more than the arithmetic.
    shape = ref.shape
    if len(shape) > MAX_RANK:
        raise ValueError(f"tensor {name_text(ref.name)} has an implausible shape {shape_text(shape)}")
    elements = bound = 1
    for d in tuple(shape):
        if d < 0:
            bound = MAX_ELEMENTS + 1
            break
        elements *= d
        bound *= d or 1
    if bound > MAX_ELEMENTS:
        raise ValueError(f"tensor {name_text(ref.name)} has an implausible shape {shape_text(shape)}")
    return elements * dtype.itemsize


@dataclass(frozen=True)
class _Placement:
    """Where one tensor of a bundle lives inside a slot."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the slot (header included)
    data: torch.Tensor  # [nbytes] uint8, host


def _plan(tensors: Mapping[str, torch.Tensor]) -> tuple[list[_Placement], int]:
    """Lay the bundle out behind the slot header; returns placements and payload bytes used."""
    placements: list[_Placement] = []
    cursor = SLOT_HEADER_BYTES
    for name, tensor in tensors.items():
        dtype = _dtype_name(tensor.dtype)
        data = _as_bytes(tensor)
        cursor = _round_up(cursor, ALIGNMENT)
        placements.append(_Placement(name, dtype, tuple(tensor.shape), cursor, data))
        cursor += data.numel()
    return placements, cursor - SLOT_HEADER_BYTES


def _inline_bundle(placements: Iterable[_Placement]) -> common_pb2.TensorBundle:
    bundle = common_pb2.TensorBundle()
    for p in placements:
        bundle.tensors.add(name=p.name, dtype=p.dtype, shape=p.shape, inline_data=p.data.numpy().tobytes())
    return bundle


def _decode_inline(ref: common_pb2.TensorRef) -> torch.Tensor:
    """Owned copy of an inline payload (a bytearray, so the tensor is writable)."""
    dtype = _wire_dtype(ref)
    expected = _expected_nbytes(ref, dtype)
    if len(ref.inline_data) != expected:
        raise ValueError(
            f"tensor {name_text(ref.name)}: inline payload has {len(ref.inline_data)} bytes, "
            f"shape {shape_text(ref.shape)} of {ref.dtype} needs {expected}"
        )
    if expected == 0:
        return torch.empty(tuple(ref.shape), dtype=dtype)
    flat = torch.frombuffer(bytearray(ref.inline_data), dtype=dtype)
    return flat if len(ref.shape) == 1 else flat.reshape(tuple(ref.shape))   # 1-D (every tree tensor): as read


def bundle_slot(bundle: common_pb2.TensorBundle) -> int | None:
    """The slot a bundle occupies (what the consumer must release), or None if fully inline."""
    slots = {ref.slot.slot for ref in bundle.tensors if ref.WhichOneof("payload") == "slot"}
    if len(slots) > 1:
        raise ValueError(f"bundle references several slots {sorted(slots)}; one bundle uses one slot")
    return slots.pop() if slots else None


class SlotRing:
    """Slot bookkeeping shared by every by-reference transport (shm, cuda_ipc).

    Knows nothing about memory: it hands out free slot indices with a fresh sequence number and
    takes them back. Sequence numbers are globally increasing per ring, so each write of any slot
    gets a number it never had before.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(num_slots))
        self._in_use: set[int] = set()
        self._next_sequence = 1  # 0 marks a slot that is being written or was never written

    @property
    def slots_in_use(self) -> int:
        with self._lock:
            return len(self._in_use)

    def acquire(self) -> tuple[int, int]:
        """Take the least recently freed slot (spreads reuse, so stale reads are caught early)."""
        with self._lock:
            if not self._free:
                raise RingFull(f"all {self.num_slots} slots are in use; the consumer has not released any")
            slot = self._free.popleft()
            self._in_use.add(slot)
            sequence = self._next_sequence
            self._next_sequence += 1
            return slot, sequence

    def release(self, slots: Iterable[int]) -> None:
        """Return slots; releasing a free slot is a no-op so a late release after release_all is
        harmless. A slot out of range, or more slots than the ring has, releases none of them (a
        peer's list of millions was walked under the lock, on the event loop, for seconds)."""
        slots = list(itertools.islice(slots, self.num_slots + 1))
        if len(slots) > self.num_slots:
            raise ValueError(f"more slots released than the ring's {self.num_slots}")
        bad = [s for s in slots if not 0 <= s < self.num_slots]
        if bad:
            raise ValueError(f"slot {bad[0]} out of range for a ring of {self.num_slots} slots")
        with self._lock:
            for slot in slots:
                if slot in self._in_use:
                    self._in_use.remove(slot)
                    self._free.append(slot)

    def release_all(self) -> None:
        with self._lock:
            self._free.extend(sorted(self._in_use))
            self._in_use.clear()


class TensorWriter(abc.ABC):
    """Producer side of a transport. Subclasses define where the bytes go."""

    kind: str = ""
    inline_fallbacks: int = 0

    @abc.abstractmethod
    def write(self, tensors: Mapping[str, torch.Tensor]) -> common_pb2.TensorBundle:
        """Puts the bundle where the consumer can read it; returns the message that names it."""

    def release(self, slots: Iterable[int]) -> None:
        """The consumer finished reading these slots."""

    def release_all(self) -> None:
        """The consumer is gone (stream ended or died): reclaim every slot it held."""

    @property
    def slots_in_use(self) -> int:
        return 0

    @property
    def ring_name(self) -> str | None:
        return None

    @property
    def slot_bytes(self) -> int:
        return 0

    @property
    def num_slots(self) -> int:
        return 0

    def close(self) -> None:
        """Free the transport's resources; idempotent."""

    def attached(self) -> None:
        """The consumer has attached the ring: a name it was found by can go (shm unlinks it)."""

    def __enter__(self) -> TensorWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RingWriter(TensorWriter):
    """A writer that owns a ring of slots (shm, cuda_ipc): the slot bookkeeping they share.

    Subclasses set `_ring` (SlotRing), `_name`, `_slot_bytes` and `_lock` (serialises writes
    against `release_all`, so a slot reclaimed from a dead consumer is never handed out while a
    write into it is still copying).
    """

    _ring: SlotRing
    _name: str
    _slot_bytes: int
    _lock: threading.Lock

    @property
    def slots_in_use(self) -> int:
        return self._ring.slots_in_use

    @property
    def ring_name(self) -> str | None:
        return self._name

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def num_slots(self) -> int:
        return self._ring.num_slots

    def release(self, slots: Iterable[int]) -> None:
        self._ring.release(slots)

    def release_all(self) -> None:
        with self._lock:
            self._ring.release_all()


class TensorReader:
    """Consumer side of a transport: inline refs are decoded here, slot refs checked for size and
    handed to the subclass's `_slot_view` (where the ring lives is all that differs)."""

    kind: str = ""
    copies: bool = False   # every tensor `read` returns owns its memory (no view of a ring)

    def read(self, bundle: common_pb2.TensorBundle) -> dict[str, torch.Tensor]:
        """Views into a ring are valid until the slot is released; copy anything kept longer."""
        out: dict[str, torch.Tensor] = {}
        for ref in bundle.tensors:
            if ref.WhichOneof("payload") != "slot":
                out[ref.name] = _decode_inline(ref)
                continue
            dtype = _wire_dtype(ref)
            expected = _expected_nbytes(ref, dtype)
            if ref.slot.nbytes != expected:
                raise ValueError(
                    f"tensor {name_text(ref.name)}: slot ref has {ref.slot.nbytes} bytes, shape "
                    f"{shape_text(ref.shape)} of {ref.dtype} needs {expected}"
                )
            if ref.slot.offset % dtype.itemsize:   # a device view there fails (RuntimeError); writers align
                raise ValueError(f"tensor {name_text(ref.name)}: slot offset {ref.slot.offset} is not a multiple of its "
                                 f"{dtype.itemsize}-byte elements")
            out[ref.name] = self._slot_view(ref, dtype, tuple(ref.shape))
        return out

    def _slot_view(self, ref: common_pb2.TensorRef, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        raise ValueError(f"tensor {name_text(ref.name)} references a shared slot but this reader is inline-only")

    def is_current(self, bundle: common_pb2.TensorBundle) -> bool:
        """Whether zero-copy views of `bundle` still show its contents (always true for inline)."""
        return True

    def close(self) -> None:
        """Detach; idempotent."""

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InlineWriter(TensorWriter):
    """Bytes inside the protobuf: for peers on different hosts, no shared state to leak."""

    kind = "inline"

    def write(self, tensors: Mapping[str, torch.Tensor]) -> common_pb2.TensorBundle:
        placements, _ = _plan(tensors)
        return _inline_bundle(placements)


class InlineReader(TensorReader):
    kind = "inline"
    copies = True


class _QuietSharedMemory(SharedMemory):
    """SharedMemory whose finaliser tolerates live zero-copy views (BufferError) at shutdown."""

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, BufferError):
            pass


def _tracker_name(shm: SharedMemory) -> str:
    return getattr(shm, "_name", "/" + shm.name)


def _attach_untracked(name: str) -> SharedMemory:
    """Attach without letting this process's resource_tracker unlink the owner's segment at exit."""
    if sys.version_info >= (3, 13):
        return _QuietSharedMemory(name=name, create=False, track=False)
    shm = _QuietSharedMemory(name=name, create=False)
    resource_tracker.unregister(_tracker_name(shm), "shared_memory")
    return shm


def _close_segment(shm: SharedMemory, unlink: bool) -> None:
    """Closes the descriptor and drops this object's hold on the mapping, and optionally unlinks;
    used as a weakref finaliser. The mapping is not unmapped here: the zero-copy views a reader
    returned hold the segment's memoryview, which holds the mapping, and it goes with the last of
    them. (``shm.close()`` unmapped it under live views, and the next read of one was a SIGSEGV:
    ``torch.frombuffer`` takes no buffer export that would have made it refuse.)"""
    shm._buf = None    # the memoryview: the views keep it (and through it the mmap) alive
    shm._mmap = None
    if shm._fd >= 0:
        os.close(shm._fd)
        shm._fd = -1
    if unlink:
        _unlink_segment(shm)


def _unlink_segment(shm: SharedMemory) -> None:
    """Removes the segment's name (the mapping lives on where it is mapped)."""
    if sys.version_info < (3, 13):
        # An attached process sharing our tracker may have unregistered the name; re-register
        # (idempotent) so unlink()'s own unregister does not make the tracker complain.
        resource_tracker.register(_tracker_name(shm), "shared_memory")
    try:
        shm.unlink()
    except FileNotFoundError:  # someone else unlinked it; just stop tracking the name
        if sys.version_info < (3, 13) or getattr(shm, "_track", True):   # 3.13: tracked unless track=False
            resource_tracker.unregister(_tracker_name(shm), "shared_memory")


def _drop_mapping(shm: SharedMemory) -> None:
    """Unmaps a segment this process then reaches through its descriptor alone (see the module
    doc: a peer that shrinks the segment cannot make a pread or pwrite fault)."""
    shm._buf.release()
    shm._mmap.close()
    shm._buf = None
    shm._mmap = None


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Writes all of `data` at `offset`; a short write is retried from where it stopped."""
    while data:
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "the shared-memory segment takes no more bytes")
        data, offset = data[n:], offset + n


def _reserve(shm: SharedMemory, size: int) -> None:
    """Backs a new segment with memory now. A POSIX segment is only sized, not reserved: touching
    a page that /dev/shm has no room for kills the process with SIGBUS (a verifier died in a
    handshake once a container's 64 MB /dev/shm was used up). Raises ``OSError`` (ENOSPC) with the
    segment unlinked instead; a filesystem that cannot reserve is left as it was."""
    try:
        os.posix_fallocate(shm._fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return
        _close_segment(shm, True)
        raise OSError(exc.errno, f"no room for a {size >> 20} MiB shared-memory ring in /dev/shm ({exc.strerror}): "
                      "give it more (compose: ipc: host; docker: --shm-size) or fewer ring slots "
                      "(verifier.ring_slots / ring_slot_bytes, draft.ring_slots / ring_slot_bytes)") from None


def _slot_stride(slot_bytes: int) -> int:
    return SLOT_HEADER_BYTES + _round_up(slot_bytes, ALIGNMENT)


class ShmWriter(RingWriter):
    """Owner of a POSIX shared-memory ring; copies each bundle into one free slot."""

    kind = "shm"

    def __init__(self, slot_bytes: int, num_slots: int, name_prefix: str) -> None:
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be >= 1, got {slot_bytes}")
        if "/" in name_prefix:
            raise ValueError(f"name_prefix must not contain '/': {name_prefix!r}")
        self._ring = SlotRing(num_slots)
        self._slot_bytes = slot_bytes
        self._stride = _slot_stride(slot_bytes)
        name = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        self._shm = _QuietSharedMemory(name=name, create=True, size=self._stride * num_slots)
        _reserve(self._shm, self._stride * num_slots)   # a new segment reads as zeros: no slot is current
        _drop_mapping(self._shm)   # written through the descriptor only (the module doc says why)
        self._name = self._shm.name
        # Serialises writes against each other and against release_all, so a slot reclaimed from a
        # dead consumer is never handed out while a write into it is still copying.
        self._lock = threading.Lock()
        self._closed = False
        self._named = True
        self.inline_fallbacks = 0
        self._finalizer = weakref.finalize(self, _close_segment, self._shm, True)

    def attached(self) -> None:
        """Unlinks the ring's name once the consumer has mapped it: both mappings live on, and a
        kill that takes this process's resource tracker with it (a container's, a process
        group's) leaves nothing behind in /dev/shm. Named until then, a ring leaked a crash, and
        with ``ipc: host`` into the host's /dev/shm, until ENOSPC sent every stream inline."""
        with self._lock:
            if self._closed or not self._named:
                return
            self._named = False
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _close_segment, self._shm, False)
        try:
            _unlink_segment(self._shm)
        except OSError:   # best effort: a name that stays is what every ring had before
            pass

    def write(self, tensors: Mapping[str, torch.Tensor]) -> common_pb2.TensorBundle:
        placements, used = _plan(tensors)
        if used == 0:
            return _inline_bundle(placements)  # nothing to share; do not tie up a slot
        with self._lock:
            if self._closed:
                raise RuntimeError(f"shm ring {self._name} is closed")
            if used > self._slot_bytes:
                self.inline_fallbacks += 1
                return _inline_bundle(placements)
            slot, sequence = self._ring.acquire()
            base = slot * self._stride
            bundle = common_pb2.TensorBundle()
            try:
                self._put_word(base, _HDR_SEQUENCE, 0)   # readers of an old message now see a mismatch
                for p in placements:
                    _pwrite_all(self._shm._fd, memoryview(p.data.numpy()), base + p.offset)
                    ref = bundle.tensors.add(name=p.name, dtype=p.dtype, shape=p.shape)
                    ref.slot.slot = slot
                    ref.slot.offset = p.offset
                    ref.slot.nbytes = p.data.numel()
                    ref.slot.sequence = sequence
                self._put_word(base, _HDR_USED_BYTES, used)
                self._put_word(base, _HDR_SEQUENCE, sequence)   # published last: contents are complete
            except OSError as exc:   # /dev/shm had no room for a page (e.g. one a peer freed by shrinking the ring)
                self._ring.release([slot])
                raise OSError(exc.errno, f"shm ring {self._name}: cannot write slot {slot}: {exc.strerror or exc}") from None
            return bundle

    def _put_word(self, base: int, word: int, value: int) -> None:
        _pwrite_all(self._shm._fd, memoryview(_WORD.pack(value)), base + _WORD.size * word)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._finalizer()


class ShmReader(TensorReader):
    """Attaches to a producer's ring and returns zero-copy views into it, or with `copy` private
    copies read through the descriptor (see the module doc: for a reader the ring's owner must not
    be able to end)."""

    kind = "shm"

    def __init__(self, ring_name: str, slot_bytes: int, num_slots: int, copy: bool = False) -> None:
        self._shm = _attach_untracked(ring_name)
        self.copies = copy
        if os.fstat(self._shm._fd).st_uid != os.geteuid():   # a ring is its peer's, of this service's user
            self._shm.close()
            raise ValueError(f"shm ring {ring_name} belongs to another user")
        self._stride = _slot_stride(slot_bytes)
        self._payload_bytes = self._stride - SLOT_HEADER_BYTES
        self._num_slots = num_slots
        needed = self._stride * num_slots
        if self._shm.size < needed:
            size = self._shm.size
            self._shm.close()
            raise ValueError(
                f"shm ring {ring_name} has {size} bytes but slot_bytes={slot_bytes}, "
                f"num_slots={num_slots} needs {needed}; reader and writer disagree on the ring layout"
            )
        self._copied: tuple[int, int, int] | None = None   # slot, sequence, used: the header `read` took
        if copy:
            _drop_mapping(self._shm)
        self._finalizer = weakref.finalize(self, _close_segment, self._shm, False)

    def _pread(self, nbytes: int, offset: int) -> torch.Tensor:
        """[nbytes] uint8, a private copy of the segment's bytes at `offset`."""
        out = torch.empty(nbytes, dtype=torch.uint8)
        buf, got = memoryview(out.numpy()), 0
        while got < nbytes:
            n = os.preadv(self._shm._fd, [buf[got:]], offset + got)
            if n == 0:
                raise ValueError(f"shm ring {self._shm.name} ends at byte {offset + got}, inside what a message "
                                 "names: its owner shrank it")
            got += n
        return out

    def read(self, bundle: common_pb2.TensorBundle) -> dict[str, torch.Tensor]:
        # copy: the slot's header once a bundle, then each tensor's own bytes once its reference
        # is checked against it (never a span the peer's words name: `used`, an offset)
        self._copied = None
        try:
            return super().read(bundle)
        finally:
            self._copied = None

    def _header(self, slot: int) -> tuple[int, int]:
        if self.copies:
            words = self._pread(2 * _WORD.size, slot * self._stride).view(torch.int64)
        else:
            words = torch.frombuffer(self._shm.buf, dtype=torch.int64, count=2, offset=slot * self._stride)
        return int(words[_HDR_SEQUENCE]), int(words[_HDR_USED_BYTES])

    def _slot_header(self, slot: int) -> tuple[int, int]:
        """Sequence and used bytes of the slot the bundle in `read` names, read once."""
        if self._copied is None or self._copied[0] != slot:
            self._copied = (slot, *self._header(slot))
        return self._copied[1], self._copied[2]

    def _check_slot(self, ref: common_pb2.TensorRef) -> None:
        s = ref.slot
        if s.slot >= self._num_slots:
            raise ValueError(f"tensor {name_text(ref.name)} names slot {s.slot} but the ring has {self._num_slots}")
        # The messages say what is wrong, not what the slot holds: they go back to the message's
        # sender, who is not always the ring's writer.
        current, used = self._slot_header(s.slot) if self.copies else self._header(s.slot)
        if current != s.sequence:
            raise ValueError(
                f"tensor {name_text(ref.name)}: slot {s.slot} does not hold sequence {s.sequence}; the slot was "
                "released and overwritten (stale message) or is mid-write"
            )
        # `used` is the writer's word: bounded by the slot too, or a message for one slot read the next
        if s.offset < SLOT_HEADER_BYTES or s.offset + s.nbytes > SLOT_HEADER_BYTES + min(used, self._payload_bytes):
            raise ValueError(
                f"tensor {name_text(ref.name)}: bytes [{s.offset}, {s.offset + s.nbytes}) fall outside the payload "
                f"written to slot {s.slot}"
            )

    def _slot_view(self, ref: common_pb2.TensorRef, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        self._check_slot(ref)
        if ref.slot.nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        start = ref.slot.slot * self._stride + ref.slot.offset
        if self.copies:
            return self._pread(ref.slot.nbytes, start).view(dtype).reshape(shape)
        return torch.frombuffer(self._shm.buf, dtype=dtype, count=math.prod(shape), offset=start).reshape(shape)

    def is_current(self, bundle: common_pb2.TensorBundle) -> bool:
        slot = bundle_slot(bundle)
        if slot is None:
            return True
        sequence = next(r.slot.sequence for r in bundle.tensors if r.WhichOneof("payload") == "slot")
        return self._header(slot)[0] == sequence

    def close(self) -> None:
        self._finalizer()


def make_writer(kind: str, slot_bytes: int = 0, num_slots: int = 0, name_prefix: str = "ddtree",
                device: torch.device | str | None = None) -> TensorWriter:
    """Producer for a stream; the kind is negotiated at stream set-up (see ModelInfo.transport).

    `device`: where a cuda_ipc ring lives, the producer's own GPU (default: the current CUDA
    device); ignored by the host-memory kinds.
    """
    if kind == "shm":
        return ShmWriter(slot_bytes, num_slots, name_prefix)
    if kind == "inline":
        return InlineWriter()
    if kind == "cuda_ipc":
        from services.common.cuda_ipc import CudaIpcWriter   # needs CUDA; imported only when chosen
        return CudaIpcWriter(slot_bytes, num_slots, device)
    raise ValueError(f"unknown transport kind {kind!r}; supported: {', '.join(SUPPORTED_KINDS)}")


def make_reader(kind: str, ring_name: str | None = None, slot_bytes: int = 0, num_slots: int = 0,
                prefix: str = "", copy: bool = False) -> TensorReader:
    """Consumer for a stream; for "shm" the ring parameters come from the producer's handshake.
    ``prefix``: the name an shm ring of that producer must start with (a handshake names the ring,
    and any other segment of this user would be read as one). ``copy``: an shm reader returns
    private copies and never maps the ring (a reader its peer must not be able to end; see the
    module doc); inline reads are copies anyway, cuda_ipc ones views."""
    if kind == "shm" and not (ring_name or "").startswith(prefix):
        raise ValueError(f"shm ring {ring_name!r} is not a {prefix}* ring")
    if kind == "shm":
        if not ring_name:
            raise ValueError("an shm reader needs the producer's ring_name")
        return ShmReader(ring_name, slot_bytes, num_slots, copy)
    if kind == "inline":
        return InlineReader()
    if kind == "cuda_ipc":
        if not ring_name:
            raise ValueError("a cuda_ipc reader needs the producer's ring handle")
        from services.common.cuda_ipc import CudaIpcReader
        return CudaIpcReader(ring_name, slot_bytes, num_slots)
    raise ValueError(f"unknown transport kind {kind!r}; supported: {', '.join(SUPPORTED_KINDS)}")
