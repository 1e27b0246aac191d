"""The `cuda_ipc` transport: a ring of slots in GPU memory shared through a CUDA IPC handle.

The owner allocates the ring once and publishes its handle (torch's own CUDA IPC reduction,
serialised into the handshake's ring name); the peer maps it once. Each message then names slot,
offset, shape and dtype, exactly like `shm`. The producer synchronises its stream before the message
leaves, so the consumer never sees a partial write; a slot is reused only after the consumer released
it (or `release_all` when the consumer's stream ended). Reads are zero-copy views on the GPU.
"""

from __future__ import annotations

import base64
import pickle
import threading
from collections.abc import Mapping

import torch
from torch.multiprocessing.reductions import reduce_tensor

from ddtree.v1 import common_pb2
from services.common.transport import (ALIGNMENT, RingFull, RingWriter, SlotRing, TensorReader, _dtype_name,
                                       _round_up)

__all__ = ["CudaIpcWriter", "CudaIpcReader", "RingFull"]


class CudaIpcWriter(RingWriter):
    kind = "cuda_ipc"

    def __init__(self, slot_bytes: int, num_slots: int, device: torch.device | str = "cuda") -> None:
        self._ring = SlotRing(num_slots)
        self._slot_bytes = _round_up(slot_bytes, ALIGNMENT)
        self._buf = torch.empty(num_slots, self._slot_bytes, dtype=torch.uint8, device=device)  # [slots, bytes]
        fn, args = reduce_tensor(self._buf)
        self._name = base64.b64encode(pickle.dumps((fn, args))).decode()
        self._lock = threading.Lock()
        self.inline_fallbacks = 0

    def write(self, tensors: Mapping[str, torch.Tensor]) -> common_pb2.TensorBundle:
        layout, cursor = [], 0
        for name, t in tensors.items():
            cursor = _round_up(cursor, ALIGNMENT)
            layout.append((name, t, cursor))
            cursor += t.numel() * t.element_size()
        bundle = common_pb2.TensorBundle()
        if cursor > self._slot_bytes:
            self.inline_fallbacks += 1
            for name, t in tensors.items():
                data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                bundle.tensors.add(name=name, dtype=_dtype_name(t.dtype), shape=tuple(t.shape), inline_data=data)
            return bundle
        with self._lock:
            slot, sequence = self._ring.acquire()
            row = self._buf[slot]                                                  # [slot_bytes]
            for name, t, offset in layout:
                nbytes = t.numel() * t.element_size()
                dst = row[offset:offset + nbytes].view(t.dtype).view(t.shape)
                dst.copy_(t, non_blocking=True)
                ref = bundle.tensors.add(name=name, dtype=_dtype_name(t.dtype), shape=tuple(t.shape))
                ref.slot.slot, ref.slot.offset, ref.slot.nbytes, ref.slot.sequence = slot, offset, nbytes, sequence
            torch.cuda.current_stream(self._buf.device).synchronize()   # visible before the message leaves
        return bundle

    def close(self) -> None:
        self._buf = None  # type: ignore[assignment]


class CudaIpcReader(TensorReader):
    kind = "cuda_ipc"

    def __init__(self, ring_name: str, slot_bytes: int, num_slots: int) -> None:
        fn, args = pickle.loads(base64.b64decode(ring_name))
        self._buf = fn(*args)                                                      # [slots, bytes] on the owner's GPU
        if tuple(self._buf.shape) != (num_slots, _round_up(slot_bytes, ALIGNMENT)):
            raise ValueError(f"cuda_ipc ring is {tuple(self._buf.shape)}, handshake says {num_slots} x {slot_bytes}")

    def _slot_view(self, ref: common_pb2.TensorRef, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero-copy view on the owner's GPU."""
        if ref.slot.nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=self._buf.device)
        row = self._buf[ref.slot.slot]                                             # [slot_bytes]
        return row[ref.slot.offset:ref.slot.offset + ref.slot.nbytes].view(dtype).view(shape)

    def close(self) -> None:
        self._buf = None  # type: ignore[assignment]
