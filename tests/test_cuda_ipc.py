"""The cuda_ipc ring without a GPU: a handle of plain JSON a peer cannot smuggle code through, the
owner's GPU found by UUID when the two processes number their GPUs differently, and the slot logic
(layout, bounds, release, inline fallbacks) around a host tensor standing in for GPU memory."""

from __future__ import annotations

import base64
import json
import pickle
import threading

import pytest
import torch

from ddtree.v1 import common_pb2
from services.common import cuda_ipc
from services.common.cuda_ipc import (CudaIpcReader, CudaIpcWriter, RingHandle, decode_ring_handle,
                                      encode_ring_handle, local_device_index)
from services.common.transport import RingFull, SlotRing, bundle_slot


def _handle(**changes) -> RingHandle:
    base = dict(device_index=1, device_uuid="uuid-b", handle=b"\x00\x01ipc-handle\xff" * 4, size_bytes=4 << 20,
                offset_bytes=2 << 20, ref_counter_handle=b"/torch_123_456", ref_counter_offset=7,
                event_handle=b"\x10" * 64, event_sync_required=True)
    return RingHandle(**{**base, **changes})


def test_handle_round_trips_through_json() -> None:
    h = _handle()
    text = encode_ring_handle(h)
    assert json.loads(text)["cuda_ipc"] == 1
    assert decode_ring_handle(text) == h
    assert decode_ring_handle(encode_ring_handle(_handle(device_uuid="", event_sync_required=False))).device_uuid == ""


def test_old_pickled_handles_and_junk_are_refused() -> None:
    pickled = base64.b64encode(pickle.dumps((print, ("pwned",)))).decode()   # the previous wire format
    with pytest.raises(ValueError, match="not JSON"):
        decode_ring_handle(pickled)
    with pytest.raises(ValueError, match="version"):
        decode_ring_handle(json.dumps({"handle": "AA=="}))
    with pytest.raises(ValueError, match="version"):
        decode_ring_handle("[1, 2]")


@pytest.mark.parametrize("field,value", [
    ("size_bytes", -1), ("size_bytes", True), ("size_bytes", "4"), ("device_index", 1.5),
    ("handle", "not base64!"), ("handle", 5), ("event_sync_required", 1), ("device_uuid", 3),
])
def test_bad_fields_are_named(field, value) -> None:
    doc = json.loads(encode_ring_handle(_handle()))
    doc[field] = value
    with pytest.raises(ValueError, match=field):
        decode_ring_handle(json.dumps(doc))
    del doc[field]
    with pytest.raises(ValueError, match=f"lacks '{field}'"):
        decode_ring_handle(json.dumps(doc))


def test_owner_gpu_is_found_by_uuid_across_numberings() -> None:
    # The owner ran with CUDA_VISIBLE_DEVICES=1,0: its cuda:0 is our cuda:1.
    assert local_device_index("uuid-b", 0, ["uuid-a", "uuid-b"]) == 1
    assert local_device_index("uuid-a", 1, ["uuid-a", "uuid-b"]) == 0
    assert local_device_index("", 1, ["", ""]) == 1   # no UUIDs: trust the index
    with pytest.raises(ValueError, match="sees 1 GPUs"):
        local_device_index("", 1, [""])
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        local_device_index("uuid-c", 0, ["uuid-a", "uuid-b"])


def test_reader_checks_ring_size_before_touching_cuda() -> None:
    text = encode_ring_handle(_handle(size_bytes=4096))
    with pytest.raises(ValueError, match="handshake says 2 x 4096"):
        CudaIpcReader(text, slot_bytes=4096, num_slots=2)
    with pytest.raises(ValueError, match="not JSON"):
        CudaIpcReader("garbage", slot_bytes=64, num_slots=1)


def _host_ring(monkeypatch, slots: int, slot_bytes: int):
    """The writer and reader around a host tensor standing in for the GPU ring: the slot logic
    (layout, bounds, reuse, inline fallbacks) without a GPU."""
    class _Stream:
        def synchronize(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(cuda_ipc, "INLINE_HOST_BYTES", 0)   # host tensors stand in for GPU ones here
    buf = torch.zeros(slots, slot_bytes, dtype=torch.uint8)   # [slots, bytes]
    writer = CudaIpcWriter.__new__(CudaIpcWriter)
    writer._ring, writer._slot_bytes, writer._buf, writer._lock = SlotRing(slots), slot_bytes, buf, threading.Lock()
    writer._name, writer.inline_fallbacks = "host", 0
    reader = CudaIpcReader.__new__(CudaIpcReader)
    reader._buf = buf
    return writer, reader


def test_ring_slots_round_trip_and_release(monkeypatch) -> None:
    writer, reader = _host_ring(monkeypatch, slots=2, slot_bytes=256)
    a = {"tokens": torch.arange(5), "w": torch.randn(3, 4).to(torch.bfloat16), "none": torch.zeros(0, 7)}
    b = writer.write(a)
    assert bundle_slot(b) is not None and all(r.slot.offset % 64 == 0 for r in b.tensors)
    got = reader.read(b)
    assert all(torch.equal(got[k], v) for k, v in a.items())
    writer.write({"x": torch.ones(2)})
    with pytest.raises(RingFull):
        writer.write({"x": torch.ones(2)})
    writer.release_all()                  # the consumer died holding both
    assert writer.slots_in_use == 0
    empty = writer.write({"features": torch.zeros(0, 768)})   # a release-only step: no slot tied up
    assert bundle_slot(empty) is None and writer.slots_in_use == 0 and writer.inline_fallbacks == 0
    big = writer.write({"x": torch.zeros(100)})               # 400 bytes > one slot: inline
    assert bundle_slot(big) is None and writer.inline_fallbacks == 1
    assert torch.equal(reader.read(big)["x"], torch.zeros(100))
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write({"x": torch.ones(2)})


def test_small_host_payloads_ride_inline(monkeypatch) -> None:
    """A step's trees (a few hundred host ints) skip the ring: no slot, no device round trip."""
    writer, reader = _host_ring(monkeypatch, slots=2, slot_bytes=4096)
    monkeypatch.setattr(cuda_ipc, "INLINE_HOST_BYTES", 1024)
    trees = {"tokens": torch.arange(40), "parents": torch.arange(40) - 1}
    b = writer.write(trees)
    assert bundle_slot(b) is None and writer.slots_in_use == 0 and writer.inline_fallbacks == 0
    assert all(torch.equal(reader.read(b)[k], v) for k, v in trees.items())
    assert bundle_slot(writer.write({"x": torch.zeros(300)})) is not None   # 2400 bytes: a slot


def test_reader_refuses_refs_outside_the_ring(monkeypatch) -> None:
    _, reader = _host_ring(monkeypatch, slots=2, slot_bytes=128)
    for slot, offset, nbytes, needle in [(2, 64, 8, "names slot 2"), (1, 96, 64, "outside a 128-byte slot")]:
        bundle = common_pb2.TensorBundle()
        ref = bundle.tensors.add(name="x", dtype="int64", shape=[nbytes // 8])
        ref.slot.slot, ref.slot.offset, ref.slot.nbytes, ref.slot.sequence = slot, offset, nbytes, 1
        with pytest.raises(ValueError, match=needle):
            reader.read(bundle)


def test_a_write_that_fails_holds_no_slot(monkeypatch) -> None:
    """An unsupported dtype, or a copy that raised, kept the slot it took: two such writes and the
    ring was full for good (every later step inline, or RingFull on the draft)."""
    writer, reader = _host_ring(monkeypatch, slots=2, slot_bytes=4096)
    for _ in range(3):
        with pytest.raises(ValueError, match="dtype"):
            writer.write({"ok": torch.ones(4), "bad": torch.ones(100, dtype=torch.complex64)})
    assert writer.slots_in_use == 0

    class _Broken:
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Broken())
    for _ in range(3):
        with pytest.raises(RuntimeError, match="illegal memory access"):
            writer.write({"x": torch.ones(64)})
    assert writer.slots_in_use == 0


def _attach(ring: str, slot_bytes: int, num_slots: int, conn) -> None:
    """A peer process: maps the ring as declared and reports what it read or why it refused."""
    try:
        reader = CudaIpcReader(ring, slot_bytes=slot_bytes, num_slots=num_slots)
        conn.send(("ok", reader._buf[0, :8].cpu().tolist()))
    except ValueError as exc:
        conn.send(("refused", str(exc)))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        conn.send(("error", repr(exc)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_ring_declared_larger_than_its_allocation_is_refused_on_the_gpu() -> None:
    """torch maps a peer's handle at the size and offset the peer declares: a ring declared 1 GiB
    past its allocation, or 1 GiB into it, gave views whose first read was an illegal address, the
    end of the reader's CUDA context. The driver's own size of the mapping bounds both now; the true
    ring still maps."""
    import dataclasses
    import multiprocessing as mp

    slot_bytes, slots = 1 << 20, 4
    writer = CudaIpcWriter(slot_bytes, slots)
    writer._buf[0, :8] = torch.arange(8, dtype=torch.uint8, device=writer._buf.device) + 1
    torch.cuda.synchronize()
    true = decode_ring_handle(writer.ring_name)
    extra = 1024
    inflated = encode_ring_handle(dataclasses.replace(true, size_bytes=true.size_bytes + extra * slot_bytes))
    shifted = encode_ring_handle(dataclasses.replace(true, offset_bytes=true.offset_bytes + (1 << 30)))
    ctx = mp.get_context("spawn")
    results = []
    for ring, count in ((writer.ring_name, slots), (inflated, slots + extra), (shifted, slots)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_attach, args=(ring, slot_bytes, count, child))
        proc.start()
        results.append(parent.recv() if parent.poll(120) else ("timeout", ""))
        proc.join(60)
    writer.close()
    assert results[0] == ("ok", [1, 2, 3, 4, 5, 6, 7, 8]), results[0]
    assert results[1][0] == "refused" and "allocation holds" in results[1][1], results[1]
    assert results[2][0] == "refused" and "allocation holds" in results[2][1], results[2]   # an offset past it


@pytest.mark.parametrize("spare, refused", [(None, False), (0, False), (-1, True)])
def test_the_reader_bounds_the_ring_by_its_allocation(monkeypatch, spare, refused) -> None:
    """The attach's decision on the driver's answer (the GPU test above asks the driver itself):
    refused where the declared offset and ring pass the mapping's end, kept where they fit or where
    no driver can be asked (None); the mapping is asked for at its start, the ring's address less
    the declared offset."""
    slot_bytes, slots, offset = 256, 2, 64
    buf = torch.zeros(slots, slot_bytes, dtype=torch.uint8)
    asked: list[int] = []
    monkeypatch.setattr(cuda_ipc, "local_device_index", lambda uuid, index, uuids: 0)
    monkeypatch.setattr(cuda_ipc, "_local_uuids", lambda: ["uuid-b"])
    monkeypatch.setattr(cuda_ipc, "_open_ring", lambda h, index, num_slots, stride: buf)
    mapped = None if spare is None else offset + buf.numel() + spare
    monkeypatch.setattr(cuda_ipc, "_mapped_bytes", lambda base, index: asked.append(base) or mapped)
    text = encode_ring_handle(_handle(size_bytes=slots * slot_bytes, offset_bytes=offset))
    if refused:
        with pytest.raises(ValueError, match=r"allocation holds 575 bytes, the handle and handshake say 2 x 256 "
                                             r"from byte 64"):
            CudaIpcReader(text, slot_bytes=slot_bytes, num_slots=slots)
    else:
        assert CudaIpcReader(text, slot_bytes=slot_bytes, num_slots=slots)._buf is buf
    assert asked == [buf.data_ptr() - offset]
