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

        def one_shot(self, x):   # the all-reduce itself; on rank 0 wrong by 1 when its check is to fail
            dist.all_reduce(x, group=self.group)
            return x + 1 if rank == 0 and failing == "check" else x

        symm_mem.empty, symm_mem.rendezvous = empty, lambda buf, name: None
        allreduce.SmallAllReduce._one_shot = one_shot
        small = allreduce.SmallAllReduce(max_bytes=1 << 14, dtype=torch.float32, device="cpu")
        x = torch.full((8,), float(rank + 1))
        small(x)
        out.put((rank, small.one_shot, bool(small.reason), x.tolist()))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, repr(exc)[:300]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("failing", ["setup", "check", "none"])
def test_every_rank_takes_the_path_all_of_them_can(failing: str) -> None:
    from services.common.launcher import free_port

    spawn = mp.get_context("spawn")
    out, port = spawn.Queue(), free_port()
    procs = [spawn.Process(target=_rank, args=(rank, port, failing, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    got = sorted(out.get(timeout=5) for _ in procs)
    one_shot = failing == "none"
    assert got == [(0, one_shot, not one_shot, [3.0] * 8), (1, one_shot, not one_shot, [3.0] * 8)]


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
