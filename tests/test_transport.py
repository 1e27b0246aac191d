"""Transports must deliver bit-identical tensors and never leak slots."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddtree.v1 import common_pb2
from services.common import transport
from services.common.transport import (
    SUPPORTED_DTYPES,
    RingFull,
    SlotRing,
    _as_bytes,
    bundle_slot,
    make_reader,
    make_writer,
    tensor_bytes,
)

REPO = Path(__file__).resolve().parents[1]
SHM_DIR = Path("/dev/shm")


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype in (torch.int32, torch.int64):
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)
    t = (torch.randn(shape, generator=gen) * 100).to(dtype)
    if t.numel() >= 3:
        flat = t.view(-1)
        flat[0], flat[1], flat[2] = float("nan"), float("inf"), -0.0
    return t


def _bundle_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every dtype in odd, 0-d and empty shapes, plus a non-contiguous one."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, dtype in SUPPORTED_DTYPES.items():
        out[f"{name}_odd"] = _random_tensor(dtype, (3, 5, 7), gen)
        out[f"{name}_scalar"] = _random_tensor(dtype, (), gen)
        out[f"{name}_empty"] = _random_tensor(dtype, (0, 4), gen)
        out[f"{name}_one"] = _random_tensor(dtype, (1,), gen)
    out["float32_strided"] = torch.randn(6, 5, generator=gen).t()
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view so NaN payloads and -0.0 compare exactly."""
    t = t.contiguous()
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    return t


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(_bits(g), _bits(w)), name


def _raw(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {
        n: (str(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for n, t in tensors.items()
    }


def _child_read(ring_name: str, slot_bytes: int, num_slots: int, message: bytes, conn) -> None:
    """Consumer process: attach by name, decode, send the raw bytes back."""
    bundle = common_pb2.TensorBundle.FromString(message)
    reader = make_reader("shm", ring_name, slot_bytes, num_slots)
    conn.send(_raw(reader.read(bundle)))
    conn.close()


def _child_read_and_hang(ring_name: str, slot_bytes: int, num_slots: int, messages: list[bytes], conn) -> None:
    """Consumer that reads, keeps its zero-copy views (holding the slots) and never releases."""
    reader = make_reader("shm", ring_name, slot_bytes, num_slots)
    views = [reader.read(common_pb2.TensorBundle.FromString(m)) for m in messages]
    conn.send(sum(t.numel() for v in views for t in v.values()))
    signal.pause()


def test_shm_and_inline_deliver_identical_tensors() -> None:
    tensors = _bundle_tensors()
    with make_writer("shm", slot_bytes=1 << 16, num_slots=2, name_prefix="ddt-test") as shm_w, make_writer(
        "inline"
    ) as inl_w:
        shm_r = make_reader("shm", shm_w.ring_name, shm_w.slot_bytes, shm_w.num_slots)
        inl_r = make_reader("inline")
        shm_b = shm_w.write(tensors)
        inl_b = inl_w.write(tensors)
        assert bundle_slot(shm_b) is not None and bundle_slot(inl_b) is None
        for ref in shm_b.tensors:
            assert ref.slot.offset % 64 == 0
        # Through the wire format too, as the services will send it.
        shm_b = common_pb2.TensorBundle.FromString(shm_b.SerializeToString())
        inl_b = common_pb2.TensorBundle.FromString(inl_b.SerializeToString())
        from_shm, from_inline = shm_r.read(shm_b), inl_r.read(inl_b)
        _assert_identical(from_shm, tensors)
        _assert_identical(from_inline, tensors)
        _assert_identical(from_shm, from_inline)
        assert shm_r.is_current(shm_b)
        del from_shm
        shm_r.close()
        assert shm_w.inline_fallbacks == 0


def test_round_trip_across_processes() -> None:
    tensors = _bundle_tensors(seed=1)
    ctx = mp.get_context("spawn")
    with make_writer("shm", slot_bytes=1 << 16, num_slots=2, name_prefix="ddt-test") as writer:
        message = writer.write(tensors).SerializeToString()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_read, args=(writer.ring_name, writer.slot_bytes, writer.num_slots, message, child))
        proc.start()
        assert parent.poll(20), "child did not answer"
        got = parent.recv()
        proc.join(10)
        assert proc.exitcode == 0
        assert got == _raw(tensors)
        # The child's exit must not have unlinked the owner's segment.
        assert (SHM_DIR / writer.ring_name).exists()


def test_independent_consumer_process_does_not_unlink_segment() -> None:
    """A consumer with its own resource_tracker must not reclaim the owner's ring when it exits."""
    with make_writer("shm", slot_bytes=4096, num_slots=2, name_prefix="ddt-test") as writer:
        bundle = writer.write({"x": torch.arange(10)})
        code = (
            "import sys; from ddtree.v1 import common_pb2; from services.common.transport import make_reader\n"
            f"r = make_reader('shm', {writer.ring_name!r}, {writer.slot_bytes}, {writer.num_slots})\n"
            "b = common_pb2.TensorBundle.FromString(sys.stdin.buffer.read())\n"
            "print(int(r.read(b)['x'].sum()))\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])}
        result = subprocess.run(
            [sys.executable, "-c", code], input=bundle.SerializeToString(), capture_output=True, env=env, timeout=30
        )
        assert result.returncode == 0, result.stderr.decode()
        assert result.stdout.decode().strip() == "45"
        assert b"leaked" not in result.stderr
        assert (SHM_DIR / writer.ring_name).exists()
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots)
        assert torch.equal(reader.read(bundle)["x"], torch.arange(10))


def test_ring_full_release_and_stale_sequence() -> None:
    with make_writer("shm", slot_bytes=256, num_slots=2, name_prefix="ddt-test") as writer:
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots)
        a = writer.write({"v": torch.full((4,), 1)})
        b = writer.write({"v": torch.full((4,), 2)})
        assert writer.slots_in_use == 2 and bundle_slot(a) != bundle_slot(b)
        with pytest.raises(RingFull):
            writer.write({"v": torch.full((4,), 3)})
        writer.release([bundle_slot(a)])
        assert writer.slots_in_use == 1
        c = writer.write({"v": torch.full((4,), 3)})  # reuses a's slot
        assert bundle_slot(c) == bundle_slot(a)
        assert c.tensors[0].slot.sequence > a.tensors[0].slot.sequence
        with pytest.raises(ValueError, match="stale message"):
            reader.read(a)
        assert not reader.is_current(a)
        assert torch.equal(reader.read(b)["v"], torch.full((4,), 2))
        assert torch.equal(reader.read(c)["v"], torch.full((4,), 3))
        writer.release([bundle_slot(b), bundle_slot(c)])
        writer.release([bundle_slot(b)])  # a late duplicate release is harmless
        assert writer.slots_in_use == 0
        with pytest.raises(ValueError, match="out of range"):
            writer.release([5])
        d = writer.write({"v": torch.full((4,), 4)})
        with pytest.raises(ValueError, match="slot 5 out of range"):   # a bad slot releases none of the list
            writer.release([bundle_slot(d), 5])
        assert writer.slots_in_use == 1 and torch.equal(reader.read(d)["v"], torch.full((4,), 4))
        misaligned = common_pb2.TensorBundle()
        misaligned.CopyFrom(d)
        misaligned.tensors[0].slot.offset += 1   # int64 elements at an odd byte
        with pytest.raises(ValueError, match="not a multiple of its 8-byte elements"):
            reader.read(misaligned)


def test_slot_ring_bookkeeping() -> None:
    ring = SlotRing(3)
    taken = [ring.acquire() for _ in range(3)]
    assert sorted(s for s, _ in taken) == [0, 1, 2]
    assert [q for _, q in taken] == [1, 2, 3]
    with pytest.raises(RingFull):
        ring.acquire()
    ring.release_all()
    assert ring.slots_in_use == 0
    assert ring.acquire()[1] == 4


def test_dead_consumer_leaks_no_slot_and_close_unlinks() -> None:
    ctx = mp.get_context("spawn")
    writer = make_writer("shm", slot_bytes=1024, num_slots=4, name_prefix="ddt-test")
    name = writer.ring_name
    try:
        messages = [writer.write({"t": torch.arange(i + 1), "m": torch.ones(2, 3)}).SerializeToString() for i in range(3)]
        assert writer.slots_in_use == 3
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_read_and_hang, args=(name, writer.slot_bytes, writer.num_slots, messages, child))
        proc.start()
        assert parent.poll(20), "child did not read"
        assert parent.recv() == (1 + 2 + 3) + 3 * 6
        os.kill(proc.pid, signal.SIGKILL)  # dies mid-step holding three slots
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        # The owner learns the peer is gone (stream ended) and reclaims everything.
        writer.release_all()
        assert writer.slots_in_use == 0
        assert (SHM_DIR / name).exists()
        for _ in range(writer.num_slots):  # the whole ring is usable again
            writer.write({"x": torch.zeros(8)})
        assert writer.slots_in_use == writer.num_slots
    finally:
        writer.close()
    assert not (SHM_DIR / name).exists()
    writer.close()  # idempotent


def test_oversize_bundle_falls_back_inline() -> None:
    with make_writer("shm", slot_bytes=128, num_slots=1, name_prefix="ddt-test") as writer:
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots)
        big = {"a": torch.randn(100), "b": torch.arange(3)}
        bundle = writer.write(big)
        assert bundle_slot(bundle) is None
        assert all(ref.WhichOneof("payload") == "inline_data" for ref in bundle.tensors)
        assert writer.inline_fallbacks == 1 and writer.slots_in_use == 0
        _assert_identical(reader.read(bundle), big)
        # Two tensors that each fit but not together (alignment padding counts) also go inline.
        pair = {"a": torch.ones(20), "b": torch.ones(20)}  # 80 + pad to 128 + 80 > 128
        assert bundle_slot(writer.write(pair)) is None and writer.inline_fallbacks == 2
        small = {"a": torch.ones(32)}  # exactly 128 bytes fits
        assert bundle_slot(writer.write(small)) == 0 and writer.inline_fallbacks == 2


def test_bad_inputs_are_refused() -> None:
    with make_writer("inline") as writer:
        with pytest.raises(ValueError, match="dtype"):
            writer.write({"c": torch.zeros(2, dtype=torch.complex64)})
    bundle = common_pb2.TensorBundle()
    bundle.tensors.add(name="x", dtype="float32", shape=[3], inline_data=b"\0" * 8)
    with pytest.raises(ValueError, match="needs 12"):
        make_reader("inline").read(bundle)
    slot_bundle = common_pb2.TensorBundle()
    ref = slot_bundle.tensors.add(name="x", dtype="int64", shape=[1])
    ref.slot.slot, ref.slot.offset, ref.slot.nbytes, ref.slot.sequence = 0, 64, 8, 1
    with pytest.raises(ValueError, match="inline-only"):
        make_reader("inline").read(slot_bundle)
    with pytest.raises(ValueError, match="unknown transport kind"):
        make_writer("carrier-pigeon")
    with make_writer("shm", slot_bytes=256, num_slots=2, name_prefix="ddt-test") as writer:
        with pytest.raises(ValueError, match="disagree"):
            make_reader("shm", writer.ring_name, 4096, 2)


def test_concurrent_writes_get_distinct_slots() -> None:
    """Writers on several threads (e.g. gRPC handler threads) must never share a slot."""
    from concurrent.futures import ThreadPoolExecutor

    n = 16
    with make_writer("shm", slot_bytes=4096, num_slots=n, name_prefix="ddt-test") as writer:
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots)
        with ThreadPoolExecutor(8) as pool:
            bundles = list(pool.map(lambda i: writer.write({"v": torch.full((256,), i)}), range(n)))
        assert sorted(bundle_slot(b) for b in bundles) == list(range(n))
        for i, b in enumerate(bundles):
            assert torch.equal(reader.read(b)["v"], torch.full((256,), i))
        writer.release(bundle_slot(b) for b in bundles)
        assert writer.slots_in_use == 0


def test_tensor_bytes_are_the_tensors_bytes_in_c_order() -> None:
    """The numpy shortcut and the uint8 view agree for every wire dtype, strided tensors included."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 10, generator=g)
    for t in (torch.randint(-9, 9, (7, 5), generator=g).t(),            # int64, not contiguous
              torch.randint(-9, 9, (11,), generator=g, dtype=torch.int32),
              base[:, ::3], base.half(), base.bfloat16()[1:4], base > 0):
        assert tensor_bytes(t) == _as_bytes(t).numpy().tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes()


_VIEWS_OUTLIVE_CLOSE = """
import gc, sys, torch
from services.common.transport import make_reader, make_writer
w = make_writer("shm", 1 << 16, 2, "ddt-test")
r = make_reader("shm", w.ring_name, w.slot_bytes, w.num_slots)
x = torch.arange(4096, dtype=torch.int64)
view = r.read(w.write({"x": x}))["x"]
r.close(); w.close(); del r, w; gc.collect()
print(int(view.sum()) == int(x.sum()), torch.equal(view, x))
view2 = view[::2].clone(); del view; gc.collect()
print(torch.equal(view2, x[::2]))
"""


def test_views_outlive_the_reader_and_writer_that_made_them() -> None:
    """Closing (or collecting) a reader unmapped its ring under the views it had returned: the
    next read of one was a SIGSEGV with no traceback. Run apart: that would end pytest itself."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])}
    result = subprocess.run([sys.executable, "-c", _VIEWS_OUTLIVE_CLOSE], capture_output=True, env=env, timeout=60)
    assert result.returncode == 0, (result.returncode, result.stderr.decode()[-2000:])
    assert result.stdout.decode().split() == ["True", "True", "True"]
    assert b"leaked" not in result.stderr


def test_a_ring_loses_its_name_once_its_reader_has_attached() -> None:
    """Named, a ring leaked in /dev/shm (the host's, with ipc: host) whenever its owner died with
    its resource tracker (a container's kill, a process group's). Once attached, both sides map
    it by then: the name goes, the ring goes on working, and closing it is quiet."""
    writer = make_writer("shm", slot_bytes=4096, num_slots=2, name_prefix="ddt-test")
    name = writer.ring_name
    reader = make_reader("shm", name, writer.slot_bytes, writer.num_slots)
    assert (SHM_DIR / name).exists()
    writer.attached()
    assert not (SHM_DIR / name).exists()
    writer.attached()   # idempotent
    for i in range(5):   # slots reused, both mappings intact
        bundle = writer.write({"x": torch.arange(10) * i})
        assert torch.equal(reader.read(bundle)["x"], torch.arange(10) * i)
        writer.release([bundle_slot(bundle)])
    with pytest.raises(FileNotFoundError):
        make_reader("shm", name, writer.slot_bytes, writer.num_slots)   # nothing else can find it now
    reader.close()
    writer.close()
    make_writer("inline").attached()   # other kinds have no name to drop


@pytest.mark.parametrize("shape", [[0, 2**62, 2**62], [1] * 9, [3**30] * 40_000])
def test_an_implausible_shape_is_a_bad_message_not_a_torch_error(shape) -> None:
    """An empty shape with huge other dimensions passed the byte count and raised torch's
    RuntimeError (stride overflow), which the services' checks (ValueError) did not take for a bad
    message: the verifier ended the draft's whole stream, and the draft's reply path escaped its
    clean-up."""
    bundle = common_pb2.TensorBundle()
    bundle.tensors.add(name="x", dtype="int64", shape=shape, inline_data=b"" if 0 in shape else b"\0" * 8)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="implausible shape") as info:
        make_reader("inline").read(bundle)
    assert len(str(info.value)) < 200 and time.perf_counter() - t0 < 0.1   # 40k dimensions: not spelt out, not multiplied


def test_a_slot_header_cannot_stretch_a_read_into_the_next_slot() -> None:
    """The `used` word is the writer's: a message for slot 0 whose header claimed more than the
    slot holds returned slot 1's bytes."""
    with make_writer("shm", slot_bytes=256, num_slots=2, name_prefix="ddt-test") as writer:
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots)
        first = writer.write({"v": torch.arange(4)})
        writer.write({"v": torch.arange(4) + 100})   # slot 1
        assert bundle_slot(first) == 0
        torch.frombuffer(reader._shm.buf, dtype=torch.int64, count=2)[1] = 1 << 20   # slot 0's `used`
        stretched = common_pb2.TensorBundle()
        stretched.CopyFrom(first)
        ref = stretched.tensors[0]
        ref.slot.nbytes = 8 * 64
        ref.shape[:] = [64]
        with pytest.raises(ValueError, match="fall outside the payload"):
            reader.read(stretched)
        assert torch.equal(reader.read(first)["v"], torch.arange(4))   # within the slot it still reads


_SHRUNK_RING = r"""
import os, sys, torch
from services.common.transport import bundle_slot, make_reader, make_writer
copy = sys.argv[1] == "copy"
w = make_writer("shm", slot_bytes=1 << 16, num_slots=2, name_prefix="ddt-test")
r = make_reader("shm", w.ring_name, w.slot_bytes, w.num_slots, copy=copy)
w.attached()
x = torch.randint(0, 1 << 30, (4096,), dtype=torch.int64)
bundle = w.write({"x": x})
os.ftruncate(w._shm._fd, 64)   # what any holder of the segment can do: slot 0 is gone
try:
    r.read(bundle)["x"].sum()
    print("read")
except ValueError as exc:
    print("refused", "shrank" in str(exc))
w.release([bundle_slot(bundle)])
again = w.write({"x": x + 1})   # the owner's next write grows the ring back
print(torch.equal(r.read(again)["x"], x + 1))
"""


def test_a_ring_its_owner_shrank_is_a_bad_message_for_a_copying_reader() -> None:
    """The verifier reads its drafts' rings: a draft that shrank its segment under the verifier's
    mapping ended the verifier with SIGBUS (every draft's stream with it). A copying reader reads
    through the descriptor and refuses the message; a writer writes through its descriptor and
    grows the ring back. Run apart, each: a fault would end pytest."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])}

    def run(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _SHRUNK_RING, mode], capture_output=True, env=env, timeout=60)
    copying = run("copy")
    assert copying.returncode == 0, copying.stderr.decode()[-2000:]
    assert copying.stdout.decode().split() == ["refused", "True", "True"]
    mapped = run("view")   # the hazard is real: a zero-copy reader (the draft's, trusting its verifier) faults
    assert mapped.returncode == -signal.SIGBUS, (mapped.returncode, mapped.stdout, mapped.stderr.decode()[-2000:])


def test_a_copying_reader_returns_tensors_the_ring_no_longer_holds() -> None:
    """Its reads are the message's bytes, kept after the slot is rewritten (and the ring closed)."""
    writer = make_writer("shm", slot_bytes=4096, num_slots=1, name_prefix="ddt-test")
    reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots, copy=True)
    want = _bundle_tensors(seed=3)
    bundle = writer.write({k: v for k, v in want.items() if "empty" not in k and v.numel() < 64})
    got = reader.read(bundle)
    assert reader.is_current(bundle)
    writer.release([bundle_slot(bundle)])
    rewritten = writer.write({"other": torch.full((64,), -1, dtype=torch.int64)})
    assert bundle_slot(rewritten) == bundle_slot(bundle) and not reader.is_current(bundle)
    with pytest.raises(ValueError, match="stale message"):
        reader.read(bundle)
    reader.close()
    writer.close()
    _assert_identical(got, {k: want[k] for k in got})


def test_a_slot_that_cannot_be_written_is_an_error_and_not_held(monkeypatch) -> None:
    with make_writer("shm", slot_bytes=4096, num_slots=2, name_prefix="ddt-test") as writer:
        def full(fd, data, offset):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(transport.os, "pwrite", full)
        with pytest.raises(OSError, match=f"shm ring {writer.ring_name}: cannot write slot 0: No space left"):
            writer.write({"x": torch.arange(8)})
        assert writer.slots_in_use == 0
        monkeypatch.undo()
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots)
        assert torch.equal(reader.read(writer.write({"x": torch.arange(8)}))["x"], torch.arange(8))
        reader.close()


def test_a_copying_reader_reads_the_header_and_each_tensors_own_bytes_only(monkeypatch) -> None:
    """A draft may declare its slots 64 MiB long, claim them full in the header and name one
    8-byte tensor at the end: the reader read from the header to that tensor, the whole slot,
    for every such step (34 ms each on the verifier's event loop)."""
    slot_bytes = 1 << 20
    with make_writer("shm", slot_bytes=slot_bytes, num_slots=1, name_prefix="ddt-test") as writer:
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots, copy=True)
        bundle = writer.write({"x": torch.arange(4)})
        writer._put_word(0, transport._HDR_USED_BYTES, slot_bytes)   # "the whole slot is written"
        far = common_pb2.TensorBundle()
        far.CopyFrom(bundle)
        far.tensors[0].slot.offset = transport.SLOT_HEADER_BYTES + slot_bytes - 8
        far.tensors[0].slot.nbytes = 8
        far.tensors[0].shape[:] = [1]
        sizes = []
        preadv = os.preadv
        monkeypatch.setattr(transport.os, "preadv", lambda fd, bufs, offset: (sizes.append(len(bufs[0])),
                                                                              preadv(fd, bufs, offset))[1])
        assert reader.read(far)["x"].tolist() == [0]   # what the slot holds there: never written
        assert torch.equal(reader.read(bundle)["x"], torch.arange(4))
        reader.close()
    assert sizes == [16, 8, 16, 32]   # header, the tensor; header, the tensor
