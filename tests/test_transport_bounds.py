"""The shm ring's bounds, as a misbehaving peer or a short system call would test them: a bundle
past its slot, a reference reaching the next slot's header, a ring shorter than the handshake says,
a slot being rewritten, short reads and writes, a ring of another's prefix, impossible shapes."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ddtree.v1 import common_pb2
from services.common import transport
from services.common.transport import bundle_slot, make_reader, make_writer


def test_a_bundle_one_byte_or_one_header_past_the_slot_goes_inline() -> None:
    """Written into the slot, it would overwrite the next slot's header (its sequence and length)."""
    with make_writer("shm", slot_bytes=128, num_slots=2, name_prefix="ddt-test") as writer:
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots)
        for n in (129, 192):
            assert bundle_slot(writer.write({"b": torch.ones(n, dtype=torch.bool)})) is None, n
        assert writer.inline_fallbacks == 2 and writer.slots_in_use == 0
        fits = writer.write({"b": torch.ones(128, dtype=torch.bool)})
        assert bundle_slot(fits) == 0 and bool(reader.read(fits)["b"].all())


@pytest.mark.parametrize("copy", [False, True], ids=["mapped", "copying"])
def test_a_slot_reference_cannot_reach_the_next_slots_header(copy) -> None:
    with make_writer("shm", slot_bytes=128, num_slots=2, name_prefix="ddt-test") as writer:
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots, copy=copy)
        first = writer.write({"v": torch.arange(4)})
        writer.write({"v": torch.arange(4)})                        # slot 1
        writer._put_word(0, transport._HDR_USED_BYTES, 1 << 20)     # slot 0 claims far more than it holds
        probe = common_pb2.TensorBundle()
        probe.CopyFrom(first)
        ref = probe.tensors[0]
        ref.slot.offset, ref.slot.nbytes = transport.SLOT_HEADER_BYTES + 128, 8   # slot 1's sequence word
        ref.shape[:] = [1]
        with pytest.raises(ValueError, match="fall outside the payload"):
            reader.read(probe)


def test_a_reader_refuses_a_ring_one_slot_or_one_byte_short() -> None:
    with make_writer("shm", slot_bytes=256, num_slots=2, name_prefix="ddt-test") as writer:
        with pytest.raises(ValueError, match="disagree on the ring layout"):
            make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots + 1)
        os.ftruncate(writer._shm._fd, writer._stride * writer.num_slots - 1)
        with pytest.raises(ValueError, match="disagree on the ring layout"):
            make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots)


def test_short_writes_and_reads_through_the_descriptor_resume_where_they_stopped(monkeypatch) -> None:
    pwrite, preadv = os.pwrite, os.preadv
    monkeypatch.setattr(transport.os, "pwrite", lambda fd, data, offset: pwrite(fd, bytes(data[:7]), offset))
    monkeypatch.setattr(transport.os, "preadv", lambda fd, bufs, offset: preadv(fd, [bufs[0][:5]], offset))
    x = torch.randint(-(1 << 40), 1 << 40, (37,), dtype=torch.int64)
    with make_writer("shm", slot_bytes=4096, num_slots=2, name_prefix="ddt-test") as writer:
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots, copy=True)
        got = reader.read(writer.write({"x": x, "y": torch.arange(3, dtype=torch.int32)}))
        assert torch.equal(got["x"], x) and torch.equal(got["y"], torch.arange(3, dtype=torch.int32))
        reader.close()


def test_a_write_the_segment_takes_nothing_of_is_an_error_not_a_spin(monkeypatch) -> None:
    calls = []

    def nothing(fd, data, offset):
        calls.append(offset)
        if len(calls) > 100:
            raise RuntimeError("pwrite called again after it took nothing")
        return 0
    with make_writer("shm", slot_bytes=4096, num_slots=2, name_prefix="ddt-test") as writer:
        monkeypatch.setattr(transport.os, "pwrite", nothing)
        with pytest.raises(OSError, match="takes no more bytes"):
            writer.write({"x": torch.arange(8)})
        assert writer.slots_in_use == 0 and len(calls) == 1


def test_a_slot_reads_as_mid_write_until_its_contents_are_complete(monkeypatch) -> None:
    """While a reused slot is rewritten its header shows no sequence: a reader holding the old or
    the new one would otherwise read torn bytes."""
    with make_writer("shm", slot_bytes=256, num_slots=1, name_prefix="ddt-test") as writer:
        writer.release([bundle_slot(writer.write({"v": torch.arange(4)}))])
        seen, pwrite_all = [], transport._pwrite_all

        def spy(fd, data, offset):
            if offset >= transport.SLOT_HEADER_BYTES:               # a payload write of slot 0
                seen.append(int.from_bytes(os.pread(fd, 8, 0), sys.byteorder))
            pwrite_all(fd, data, offset)
        monkeypatch.setattr(transport, "_pwrite_all", spy)
        new = writer.write({"v": torch.arange(4) + 10})
        assert seen == [0]
        monkeypatch.undo()
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots)
        assert torch.equal(reader.read(new)["v"], torch.arange(4) + 10)


def test_a_reader_attaches_only_to_a_ring_of_the_expected_prefix() -> None:
    """A draft's handshake naming the verifier's own ring would have it read that as the draft's."""
    with make_writer("shm", slot_bytes=256, num_slots=1, name_prefix="ddtree-verifier") as writer:
        with pytest.raises(ValueError, match=r"is not a ddtree-draft-\* ring"):
            make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots, prefix="ddtree-draft-", copy=True)


def test_negative_dimensions_are_a_bad_message_not_a_torch_error() -> None:
    inline = common_pb2.TensorBundle()
    inline.tensors.add(name="x", dtype="int64", shape=[-1, -1], inline_data=b"\0" * 8)
    with pytest.raises(ValueError, match="implausible shape"):
        make_reader("inline").read(inline)
    with make_writer("shm", slot_bytes=256, num_slots=1, name_prefix="ddt-test") as writer:
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots, copy=True)
        bundle = writer.write({"x": torch.arange(1)})
        bundle.tensors[0].shape[:] = [-1, -1]
        with pytest.raises(ValueError, match="implausible shape"):
            reader.read(bundle)


@pytest.mark.parametrize("copy", [False, True], ids=["mapped", "copying"])
def test_a_slot_reference_longer_than_its_shape_is_a_bad_message(copy) -> None:
    with make_writer("shm", slot_bytes=256, num_slots=1, name_prefix="ddt-test") as writer:
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots, copy=copy)
        long = common_pb2.TensorBundle()
        long.CopyFrom(writer.write({"v": torch.arange(4), "w": torch.arange(4)}))
        long.tensors[0].slot.nbytes += 8
        with pytest.raises(ValueError, match="slot ref has 40 bytes"):
            reader.read(long)
