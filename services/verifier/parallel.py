"""Tensor parallelism for the verifier: which slice of each weight a rank reads, and the collectives.

Split (Megatron-style, one all-reduce per attention and per MLP/MoE block):
* MLA heads across ranks: q_proj / q_b_proj and kv_b_proj rows by head, o_proj columns by head.
  The latent KV cache (kv_lora_rank + rope per token) is the same for every head, so every rank
  keeps the whole cache for its own heads; nothing about it is split.
* Dense MLP, shared experts and every routed expert: intermediate split (gate/up rows, down columns).
  INT4 experts are sliced in their packed form: a rank's slice of the intermediate dimension must be
  a whole number of INT4 groups (32) for down_proj's packed columns and scales.
* lm_head by vocabulary rows; greedy decoding needs only each rank's (max, index) per node.
Routers, norms, embeddings and the kv_a / q_a projections are replicated.
"""

from __future__ import annotations

import datetime
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import torch
import torch.distributed as dist

from services.common.checkpoint import (INDEX_FILE, CheckpointError, header_dtype, open_safetensors, tensor_index,
                                        weight_prefix)
from services.common.grpc_server import ServiceError
from services.verifier.config import TargetConfig

__all__ = ["TensorParallel", "load_rank_slice", "master_store", "split_rule"]

JOIN_TIMEOUT = datetime.timedelta(minutes=10)   # the longest a worker process may take to start and join
LOAD_TIMEOUT = datetime.timedelta(hours=6)      # the longest the ranks of a group may take to load, apart


@dataclass(frozen=True)
class _Rule:
    dim: int      # dimension split across ranks
    unit: int     # elements per indivisible unit (a head's rows, a packed word, a scale group)
    count: int    # units in the whole dimension


def split_rule(name: str, config: TargetConfig, shape: tuple[int, ...]) -> _Rule | None:
    """How `name` is split across ranks, or None when every rank holds all of it."""
    c = config
    H = c.num_attention_heads
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        return _Rule(0, c.qk_head_dim, H)
    if name.endswith("self_attn.kv_b_proj.weight"):
        return _Rule(0, c.qk_nope_head_dim + c.v_head_dim, H)
    if name.endswith("self_attn.o_proj.weight"):
        return _Rule(1, c.v_head_dim, H)
    if name == "lm_head.weight":
        return _Rule(0, 1, shape[0])
    m = re.search(r"mlp\.(?:experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj)\.(weight\w*)$", name)
    if m is None:
        return None
    proj, kind = m.groups()
    if kind == "weight_shape":
        return None   # rewritten by the loader to the slice's dense shape
    if proj in ("gate_proj", "up_proj"):
        return _Rule(0, 1, shape[0])
    if kind == "weight":
        return _Rule(1, 1, shape[1])
    group = c.quantization.group_size if c.quantization is not None else 32
    if kind == "weight_packed":   # [hidden, I/8] words; a rank's slice must hold whole groups
        return _Rule(1, group // 8, shape[1] * 8 // group)
    return _Rule(1, 1, shape[1])  # weight_scale [hidden, I/group]


def load_rank_slice(path: Path, config: TargetConfig, expected: dict[str, tuple[int, ...]], rank: int,
                    size: int) -> dict[str, torch.Tensor]:
    """Reads only this rank's slice of each expected tensor (safetensors slices are mmap reads).
    Every tensor's presence, shard, shape, dtype and split is checked from the headers first: a
    K2 checkpoint's last shard missing, or its last tensor a column short, was found only after
    the ranks had read everything before it."""
    from services.verifier.model import check_tensor_names, dtype_error, int4_dense_shape

    path = Path(path)
    index = tensor_index(path)
    stored = weight_prefix(path)   # the names in the files (a multimodal wrapper's language model)
    check_tensor_names(config, expected, index, str(path))
    out: dict[str, torch.Tensor] = {}
    handles: dict[str, Any] = {}
    held: dict[str, set[str]] = {}   # each file's tensor names
    plan: list[tuple[str, Any, _Rule | None]] = []
    try:
        for name, want in expected.items():
            file_name = index.get(name)
            if file_name is None:
                raise CheckpointError(f"{path}: missing tensor {name}")
            if file_name not in handles:
                if not (path / file_name).is_file():
                    raise CheckpointError(f"{path}: shard file {file_name} is missing")
                handles[file_name] = open_safetensors(path / file_name)
                held[file_name] = set(handles[file_name].keys())
            if stored + name not in held[file_name]:   # safetensors' own error, a traceback, before
                raise CheckpointError(f"{path / file_name}: missing tensor {stored + name} (listed in {INDEX_FILE})")
            sl = handles[file_name].get_slice(stored + name)
            shape = tuple(sl.get_shape())
            if shape != tuple(want):
                raise CheckpointError(f"{path / file_name}: tensor {name} has shape {shape}, config implies {tuple(want)}")
            if (bad := dtype_error(name, header_dtype(sl.get_dtype()), str(path / file_name))) is not None:
                raise bad
            rule = split_rule(name, config, shape)
            if rule is not None and size > 1 and rule.count % size:
                raise CheckpointError(
                    f"{path / file_name}: tensor {name} splits into {rule.count} units along dim {rule.dim}, "
                    f"not divisible by tp={size} (heads, vocabulary and expert intermediate size must divide by tp; "
                    f"INT4 experts need intermediate/tp to be a multiple of the group size)")
            plan.append((name, sl, rule))
        for name, sl, rule in plan:   # every header checked: now the reads
            if rule is None or size == 1:
                out[name] = sl[:]
                continue
            per = rule.count // size * rule.unit
            lo, hi = rank * per, (rank + 1) * per
            out[name] = sl[lo:hi] if rule.dim == 0 else sl[:, lo:hi]
    finally:
        plan.clear()
        handles.clear()
    for name in list(out):
        if name.endswith(".weight_shape"):
            dense = int4_dense_shape(name, config)   # as one verifier refuses it (`validate_weights`)
            if [int(v) for v in out[name].tolist()] != list(dense):
                raise CheckpointError(f"{path / index[name]}: tensor {name} holds {out[name].tolist()}, "
                                      f"config implies {list(dense)}")
            packed = out[name.replace(".weight_shape", ".weight_packed")]
            out[name] = torch.tensor([packed.shape[0], packed.shape[1] * 8], dtype=out[name].dtype)
    return out


def master_store(size: int) -> dist.TCPStore:
    """Rank 0's store, on a port the system picks, made before the workers start (they are given
    its port): a port found free and bound later could be taken in between, and the workers would
    then join whatever listens there.

    On a socket bound here to loopback: torch's server binds every interface whatever host it is
    given, and the store takes no token, so anyone who reached the host could fake a rank's
    check-in or fill rank 0's memory with keys, beside a verifier whose own ports are loopback's."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    return dist.TCPStore("127.0.0.1", port, size, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False,
                         master_listen_fd=listener.detach())


class TensorParallel:
    """This rank's place in the group and the few collectives the verifier needs."""

    def __init__(self, rank: int, size: int, init_method: str = "", backend: str = "gloo",
                 timeout_s: float = 60.0, device: str | None = None,
                 peers_gone: Callable[[], str | None] | None = None, store: dist.TCPStore | None = None) -> None:
        """``init_method``: ``tcp://host:port`` of rank 0's store, or ``store`` itself (rank 0:
        ``master_store``). ``timeout_s`` bounds each collective once the group has formed; the
        ranks join and load under their own, longer limits. ``device``: this rank's GPU
        (``rank_device``), which an NCCL communicator is bound to; ``cuda:<rank>`` when not given.
        ``peers_gone`` (rank 0): why a worker is gone, or None; polled while rank 0 waits for the
        others to join and to load, so a worker that died then ends the start at once."""
        self.rank = rank
        self.size = size
        self._small = None   # SmallAllReduce, made at the first GPU all-reduce (a collective on every rank)
        self._peers_gone = peers_gone
        self._store: dist.TCPStore | None = None
        if size > 1:
            kwargs = {}
            if backend == "nccl":   # NCCL binds a communicator to the current device: this rank's GPU
                gpu = torch.device(device) if device else torch.device("cuda", rank)
                torch.cuda.set_device(gpu)   # before joining: a GPU that fails here fails before the others wait
                kwargs["device_id"] = gpu
            if store is None:
                where = urlsplit(init_method)
                store = dist.TCPStore(where.hostname, where.port, size, is_master=rank == 0, timeout=JOIN_TIMEOUT,
                                      wait_for_workers=False)
            self._store = store
            # Worker processes start minutes apart on a busy host (importing torch, initialising a
            # GPU); `init_process_group` would give them `timeout_s` and end the group.
            self._meet("joined", JOIN_TIMEOUT)
            dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=timeout_s), **kwargs)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def align(self) -> None:
        """Waits until every rank got here (after loading, before the first collective with a
        timeout: a worker done first would otherwise time out waiting for rank 0's first call)."""
        if self._store is not None:
            self._meet("loaded", LOAD_TIMEOUT)

    def _meet(self, step: str, limit: datetime.timedelta) -> None:
        """Every rank checks in under ``step``; rank 0 waits for all of them, then lets them go.

        Rank 0 polls rather than blocking in a barrier, so that a worker that died before it got
        here (a bad GPU, memory run out while loading) fails the start now, not at ``limit``. A
        worker whose rank 0 died has its wait cut short by the store's closed connection."""
        store = self._store
        store.add(step, 1)
        if self.rank:
            store.wait([f"{step}/go"], limit)
            return
        deadline = time.monotonic() + limit.total_seconds()
        while (arrived := store.add(step, 0)) < self.size:
            if gone := self.peer_gone():
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"{gone} before the verifier group was {step}")
            if time.monotonic() > deadline:
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"verifier group: {arrived} of {self.size} ranks {step} within {limit}")
            time.sleep(0.05)
        store.set(f"{step}/go", "1")

    def peer_gone(self, wait_s: float = 0.0) -> str | None:
        """Which worker rank has exited (rank 0, given ``peers_gone``), polled for up to ``wait_s``:
        a collective broken by a rank that died fails on rank 0 while that process is still being
        torn down, before its exit can be seen."""
        if self._peers_gone is None:
            return None
        deadline = time.monotonic() + wait_s
        while not (gone := self._peers_gone()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return gone

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums the ranks' partial results in place (the one collective per block)."""
        if self.size > 1:
            if x.is_cuda:
                if self._small is None:
                    from services.verifier.allreduce import SmallAllReduce
                    self._small = SmallAllReduce(dtype=x.dtype, device=x.device)
                return self._small(x)
            dist.all_reduce(x)
        return x

    def argmax(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens from vocabulary-sharded logits [N, V/size]: only (max, index) cross ranks.

        Ties go to the lowest global index, as torch.argmax over the full row would. A row whose
        maximum is not finite (a NaN, +inf, or nothing but -inf on some rank's slice) gets -1, as
        a sampled row does (`sampling.draw_tokens`): its request fails alone, where an argmax
        emitted the NaN's index as a token.
        """
        vals, idx = local_logits.max(dim=-1)                                   # [N], [N] (NaN propagates)
        if self.size == 1:
            return torch.where(torch.isfinite(vals), idx, -1)
        idx = idx + self.rank * local_logits.shape[-1]
        both = torch.stack([vals.double(), idx.double()], dim=0)               # [2, N]
        gathered = [torch.empty_like(both) for _ in range(self.size)]
        dist.all_gather(gathered, both)
        g = torch.stack(gathered)                                              # [size, 2, N]
        best = g[:, 0].argmax(dim=0)                                           # first max = lowest rank
        tokens = g[best, 1, torch.arange(g.shape[-1])].long()
        return torch.where(torch.isfinite(g[:, 0]).all(dim=0), tokens, -1)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Full logits [N, V] on every rank, for sampling (identical draws on every rank)."""
        if self.size == 1:
            return local_logits
        parts = [torch.empty_like(local_logits) for _ in range(self.size)]
        dist.all_gather(parts, local_logits.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's step description to every rank (pickled; small: ids, trees, params)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
