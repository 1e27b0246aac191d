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
    with pytest.raises(ValueError, match="cuda:-1"):   # torch would read -1 as the current device
        local_device_index("", -1, ["", ""])
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
    writer._name, writer.inline_fallbacks, writer._views = "host", 0, cuda_ipc._RingViews(buf)
    reader = CudaIpcReader.__new__(CudaIpcReader)
    reader._buf, reader._views = buf, cuda_ipc._RingViews(buf)
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


class _EchoGroup:
    """A verifier's engine group stand-in on cuda:0: a verify step answers its tree's tokens (read
    from the draft's ring) as the accepted tokens, and as the features' first column."""

    def __init__(self) -> None:
        from types import SimpleNamespace
        dev = torch.device("cuda", 0)
        config = SimpleNamespace(hidden_size=8, vocab_size=512, model_type="deepseek_v3", eos_token_id=[0])
        self.engine = SimpleNamespace(
            model=SimpleNamespace(config=config, dtype=torch.float32), max_context=256, active_requests=1,   # it holds "a"
            holds=lambda request_id: request_id == "a",
            cache=SimpleNamespace(pages_free=64, num_pages=64, capacity_tokens=1024, page_size=16), model_device=dev,
            check_feature_layers=lambda ids: None, take_commit_ms=lambda: None,
            cat_features=lambda parts: torch.cat(parts) if parts else torch.zeros(0, 8, device=dev))

    def call(self, name: str, *args):
        from types import SimpleNamespace
        if name == "verify":
            ids, tokens = args[0], args[1]
            item = SimpleNamespace(request_id=ids[0], error=None, tokens=tokens.tolist(), committed=1)
            return SimpleNamespace(items=[item], features=tokens.float()[:, None].repeat(1, 8))
        return 0 if name == "release_owner" else None


def _serve_echo_verifier(conn) -> None:
    import asyncio

    import grpc

    from ddtree.v1 import verifier_pb2_grpc
    from services.common.metrics import Metrics
    from services.common.settings import VerifierSettings
    from services.verifier.server import VerifierServicer

    async def main() -> None:
        servicer = VerifierServicer(_EchoGroup(), VerifierSettings(device="cuda", ring_slot_bytes=8192),
                                    Metrics("verifier"))
        server = grpc.aio.server()
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)   # the test's stop
        await server.stop(None)
    asyncio.run(main())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_drafts_ring_serves_its_next_stream_on_the_gpu() -> None:
    """The draft keeps its cuda_ipc ring across streams (freeing it under a verifier that may still
    read it is undefined): a verifier in another process maps the same ring again after the draft
    reconnects, and reads each step's trees from it."""
    import asyncio
    import multiprocessing as mp

    from services.draft.verifier_client import VerifierClient

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_echo_verifier, args=(child,))
    proc.start()

    async def scenario() -> list:
        assert parent.poll(120), "the verifier process did not start"
        client = VerifierClient(f"127.0.0.1:{parent.recv()}", "cuda_ipc", ring_slots=2, ring_slot_bytes=8192,
                                device="cuda:0")
        seen, rings = [], []
        try:
            for tokens in ([5, 6, 7], [8, 9, 10]):
                hs = await client.connect([1], 8, 512)
                rings.append((client._writer, client._writer.ring_name))
                trees = {k: torch.tensor(v, device="cuda") for k, v in
                         (("tokens", tokens), ("parents", [-1, 0, 1]), ("depths", [0, 1, 2]), ("sizes", [3]))}
                reply = await client.step([], ["a"], trees, [])
                seen.append((hs.transport, list(reply.response.verifies[0].token_ids),
                             reply.features[:, 0].cpu().tolist()))
                await client.close()   # the stream ends: the ring stays for the next
            kept = rings[0][0]
            await client.close(final=True)
            return [seen, rings[0][0] is rings[1][0] and rings[0][1] == rings[1][1], kept._buf is None]
        finally:
            await client.close(final=True)

    try:
        seen, same_ring, freed = asyncio.run(scenario())
    finally:
        parent.send("stop")
        proc.join(60)
    assert seen == [("cuda_ipc", [5, 6, 7], [5.0, 6.0, 7.0]), ("cuda_ipc", [8, 9, 10], [8.0, 9.0, 10.0])]
    assert same_ring and freed


def test_a_handle_of_zeros_round_trips() -> None:
    """The commonest real handle (GPU 0, offsets 0 once the owner disowns its counter) must pass:
    refused, cuda_ipc would never be used and every stream would fall back to shm."""
    h = _handle(device_index=0, offset_bytes=0, ref_counter_handle=b"/ddtree-cuda-ipc-owner-counts",
                ref_counter_offset=0, event_sync_required=False)
    assert decode_ring_handle(encode_ring_handle(h)) == h


def test_a_ring_exactly_as_large_as_the_handshake_says_passes_the_size_check(monkeypatch) -> None:
    monkeypatch.setattr(cuda_ipc, "_local_uuids", lambda: ["uuid-a"])   # stops before CUDA
    with pytest.raises(ValueError, match="not visible"):
        CudaIpcReader(encode_ring_handle(_handle(size_bytes=2 * 4096)), slot_bytes=4096, num_slots=2)
    with pytest.raises(ValueError, match="handshake says 0 x 4096"):
        CudaIpcReader(encode_ring_handle(_handle(size_bytes=2 * 4096)), slot_bytes=4096, num_slots=0)


def test_a_bundle_that_fills_a_slot_exactly_uses_the_slot_and_reads_back(monkeypatch) -> None:
    writer, reader = _host_ring(monkeypatch, slots=2, slot_bytes=128)
    x = torch.arange(16)                                   # 128 bytes: the whole slot
    bundle = writer.write({"x": x})
    assert bundle_slot(bundle) == 0 and writer.inline_fallbacks == 0
    assert torch.equal(reader.read(bundle)["x"], x)
    tail = common_pb2.TensorBundle()   # the slot's last 8 bytes
    ref = tail.tensors.add(name="t", dtype="int64", shape=[1])
    ref.slot.slot, ref.slot.offset, ref.slot.nbytes, ref.slot.sequence = 1, 120, 8, 1
    assert reader.read(tail)["t"].shape == (1,)


@pytest.mark.parametrize("field,value,needle", [("cuda_ipc", 2, "version"), ("handle", "AAAA!", "handle")])
def test_a_handle_of_another_version_or_not_strict_base64_is_refused(field, value, needle) -> None:
    doc = json.loads(encode_ring_handle(_handle()))
    doc[field] = value
    with pytest.raises(ValueError, match=needle):
        decode_ring_handle(json.dumps(doc))


@pytest.mark.parametrize("dtype, shape", [(torch.bfloat16, (5, 24)), (torch.int64, (17,)), (torch.float32, (2, 3, 4)),
                                          (torch.bool, (7,)), (torch.int32, ()), (torch.float16, (0, 8))])
def test_ring_views_are_the_slot_bytes_a_tensor_was_placed_at(dtype, shape) -> None:
    """The one strided view (`_RingViews.at`) is exactly what indexing the slot, slicing its bytes and
    viewing them made: a tensor copied there lands in those bytes and no other (CPU tensors; the
    GPU's path is the same torch calls on the GPU's ring)."""
    gen = torch.Generator().manual_seed(7)
    slots, stride = 4, 4096
    buf = torch.randint(0, 256, (slots, stride), dtype=torch.uint8, generator=gen)   # poison: random bytes
    before = buf.clone()
    views = cuda_ipc._RingViews(buf)
    src = (torch.randn(shape, generator=gen) * 100).to(dtype)
    nbytes = src.numel() * src.element_size()
    for slot, offset in [(0, 0), (2, 64), (3, stride - 64 * ((nbytes + 63) // 64 or 1))]:
        want = buf[slot][offset:offset + nbytes].view(dtype).view(shape)   # the four-call way
        got = views.at(slot, offset, dtype, shape)
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
        assert got.data_ptr() == want.data_ptr()
        got.copy_(src)
        assert torch.equal(want, src)
        written = torch.zeros_like(buf, dtype=torch.bool)
        written[slot, offset:offset + nbytes] = True
        assert torch.equal(buf[~written], before[~written])   # nothing else touched
        buf.copy_(before)


def test_a_ring_view_at_a_misaligned_offset_is_refused() -> None:
    """A floor division would have placed a float32 at byte 3 on byte 0, silently (the reader refuses
    a peer's such offset first; this is the view's own guard for any other caller)."""
    views = cuda_ipc._RingViews(torch.zeros(2, 256, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not a multiple"):
        views.at(0, 3, torch.float32, (4,))
    assert views.at(1, 4, torch.float32, (4,)).data_ptr() == views.at(1, 0, torch.uint8, (1,)).data_ptr() + 4
