"""SmallAllReduce's path is agreed by every rank (gloo on the CPU stands in for NCCL).

The one-shot path needs GPUs with peer-mapped symmetric memory (checked on the H200 by
`bench/allreduce_bench.py`). What the CPU can check is the decision: a rank whose set-up or
start-up check fails must take every other rank to the fallback with it, or the ranks' later
collectives no longer pair up.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest


def _rank(rank: int, port: int, failing: str, out) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from services.verifier import allreduce

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        def empty(n, dtype, device):   # rank 1 "sets up" the private API; rank 0 only when the check is what fails
            if rank == 0 and failing == "setup":
                raise RuntimeError("no symmetric memory here")
            return torch.empty(n, dtype=dtype, device=device)

        # torch's two one-shot ops, as gloo does them; on rank 0 wrong by 1 where its check is to fail
        def one_launch(buf, local, op, group, out):
            if failing == "one_launch_refused":   # as torch's checks refuse a call: alike on every rank
                raise RuntimeError("one_shot_all_reduce: local input and symm buffer must have the same alignment.")
            buf.copy_(local)
            dist.all_reduce(buf)
            return out.copy_(buf + (rank == 0 and failing in ("check", "one_launch")))

        def one_shot(buf, op, group):
            summed = buf.clone()
            dist.all_reduce(summed)
            return summed + (rank == 0 and failing == "check")

        symm_mem.empty, symm_mem.rendezvous = empty, lambda buf, name: None
        # rank 0's torch without the one-launch op
        torch.ops.symm_mem.one_shot_all_reduce_copy_out = None if rank == 0 and failing == "no_op" else one_launch
        torch.ops.symm_mem.one_shot_all_reduce = one_shot
        small = allreduce.SmallAllReduce(max_bytes=1 << 14, dtype=torch.float32, device="cpu")
        x = torch.full((8,), float(rank + 1))
        small(x)
        out.put((rank, small.one_shot, bool(small.reason), small.one_shot and small.fused, bool(small.fused_reason),
                 x.tolist()))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, repr(exc)[:300]))
    finally:
        dist.destroy_process_group()


def _run_ranks(target, *args, timeout_s: float = 60) -> list:
    """Each rank's report, in rank order; ranks still running after a failure are killed (a hung
    pair would otherwise hold pytest at its exit, and the GPUs)."""
    from services.common.launcher import free_port

    spawn = mp.get_context("spawn")
    out, port = spawn.Queue(), free_port()
    procs = [spawn.Process(target=target, args=(rank, port, *args, out), daemon=True) for rank in (0, 1)]
    try:
        for p in procs:
            p.start()
        return sorted(out.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("failing", ["setup", "check", "one_launch", "one_launch_refused", "no_op", "none"])
def test_every_rank_takes_the_path_all_of_them_can(failing: str) -> None:
    """Rank 0 alone fails: all of the one-shot set-up, the check of both one-shot paths, or the
    check of the one-launch path only, or has no one-launch op (the copying path stays in use on
    both); every rank's torch refuses the one-launch call."""
    got = _run_ranks(_rank, failing)
    one_shot, fused = failing not in ("setup", "check"), failing == "none"
    assert got == [(rank, one_shot, not one_shot, fused, one_shot and not fused, [3.0] * 8) for rank in (0, 1)]


def test_the_one_shot_path_takes_the_buffers_dtype_up_to_max_bytes_and_nothing_else(monkeypatch) -> None:
    """A tensor of another dtype through the bf16 buffer would be summed at bf16's precision,
    without an error; one past max_bytes would not fit the buffer."""
    import torch
    import torch.distributed as dist

    from services.verifier.allreduce import SmallAllReduce

    small = object.__new__(SmallAllReduce)
    small.dtype, small.max_bytes, small.group = torch.bfloat16, 64, None
    small._buf = torch.empty(32, dtype=torch.bfloat16)
    paths: list[str] = []
    monkeypatch.setattr(SmallAllReduce, "_one_shot", lambda self, x: paths.append("one_shot") or x)
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: paths.append("nccl"))
    for x in (torch.ones(32, dtype=torch.bfloat16), torch.ones(33, dtype=torch.bfloat16),
              torch.ones(16, dtype=torch.float32), torch.ones(8, dtype=torch.float16)):
        small(x)
    assert paths == ["one_shot", "nccl", "nccl", "nccl"]


def test_a_tensor_aligned_as_the_buffer_goes_in_one_launch_and_any_other_through_copies(monkeypatch) -> None:
    """torch's copy-in all-reduce refuses a local input aligned otherwise than the buffer slice
    (16 bytes): a view starting mid-row must take the copying path, in place all the same."""
    import torch

    from services.verifier import allreduce

    small = object.__new__(allreduce.SmallAllReduce)
    small._buf, small._group_name, small.fused = torch.zeros(64, dtype=torch.bfloat16), "g", True
    calls: list[str] = []

    def fused(buf, local, op, group, out):   # the sum of one rank: the input itself
        calls.append("fused")
        assert buf.numel() == local.numel() == out.numel() and out.data_ptr() == local.data_ptr()
        buf.copy_(local)
        return out.copy_(buf * 2)

    def one_shot(buf, op, group):
        calls.append("copying")
        return buf * 2

    monkeypatch.setattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", fused, raising=False)
    monkeypatch.setattr(torch.ops.symm_mem, "one_shot_all_reduce", one_shot, raising=False)
    base = torch.randn(4, 16).to(torch.bfloat16)
    for view, path in ((base.clone(), "fused"), (base.clone()[:, 1:9], "copying"), (base.clone().view(-1)[1:33], "copying"),
                       (base.clone().view(-1)[8:40], "fused"), (base.clone().t(), "copying")):
        assert allreduce.fusable(view) == (path == "fused")
        want = view.float() * 2
        got = small._one_shot(view)
        assert calls.pop() == path and got is view
        assert torch.equal(view.float(), want)


def _gpu_rank(rank: int, port: int, out) -> None:
    """One rank a GPU (symmetric memory refuses two ranks on one device); NCCL, as the verifier's
    ranks use, for the reference and the agreement."""
    import os

    import torch
    import torch.distributed as dist

    from services.verifier.allreduce import SmallAllReduce, fusable

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    try:
        small = SmallAllReduce(max_bytes=64 << 10, dtype=torch.bfloat16, device=f"cuda:{rank}")
        gen = torch.Generator(device="cuda").manual_seed(rank)
        rows = []
        for shape, view in (((6, 1024), lambda t: t), ((6, 1024), lambda t: t[:, 3:1000]), ((1, 7168), lambda t: t)):
            def like_x():   # a clone of a strided view is contiguous: each input is a view of its own
                return view(torch.empty(shape, device="cuda", dtype=torch.bfloat16)).copy_(x)

            x = view(torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16))
            want = x.float()
            dist.all_reduce(want)
            want = want.cpu()
            eager = small(like_x()).float().cpu()
            g, y = torch.cuda.CUDAGraph(), like_x()
            small(like_x())   # warm-up outside the capture
            torch.cuda.synchronize()
            dist.barrier()
            with torch.cuda.graph(g):
                small(y)
            y.copy_(x)   # fresh input for the replay: what the graph reads must be what it sums
            g.replay()
            torch.cuda.synchronize()
            rows.append((fusable(y), (eager - want).abs().max().item(), (y.float().cpu() - want).abs().max().item()))
        out.put((rank, small.one_shot and small.fused, small.reason or small.fused_reason, rows))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, repr(exc)[:500]))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(__import__("torch").cuda.device_count() < 2, reason="needs 2 GPUs")
def test_on_two_gpus_both_one_shot_paths_sum_like_nccl_eagerly_and_in_a_graph() -> None:
    got = _run_ranks(_gpu_rank, timeout_s=240)
    for rank, *rest in got:
        assert len(rest) == 3, rest
        one_shot, reason, rows = rest
        assert one_shot and not reason
        assert [fused for fused, _, _ in rows] == [True, False, True]
        for _, eager_err, graph_err in rows:
            assert eager_err <= 0.07 and graph_err <= 0.07, rows   # bf16 rounding of sums of magnitude ~4
