"""Kimi-K2 TP8 per-rank slice on one GPU: step times, HBM floors and a predicted 8-GPU tok/s (T-k2).

What runs: the real K2 dimensions cut to what ONE rank of TP8 holds (8 of 64 heads, 1/8 of the
lm_head rows, 1/8 of every MLP / shared / routed expert's intermediate dimension, all 384 routed
experts as random INT4 words, all 61 layers), built as an ordinary ``TargetModel`` with tp=1, so
the kernels, graphs and weight layout are exactly the serving ones. Why a slice instead of 8 GPUs:
each rank of TP8 does this slice's work and then all-reduces; the all-reduce time comes from
``bench/results/allreduce.json`` and is added, so the 8-GPU figure is a PREDICTION.

Per case (autoregressive: 1 node per request; verify: best-first trees of budget + 1 nodes over
random draft tables) and batch:

* step_ms: ``VerifyGraphs.run`` (CUDA graph, captured on first use) timed with perf_counter +
  synchronize around the whole call, so the per-step host work (padding, input copies) counts (not
  the engine's reads of the real rows after it; before 5e981de the call also copied every real row out);
  ``replay_ms``: the graph replay alone (CUDA events). Median of ``--reps``. Eager on CPU.
* floor_ms: bytes that must be read / measured copy bandwidth. Bytes: every non-expert weight at
  checkpoint dtypes (bf16; the router bias fp32), the routed experts the step touches (INT4 words
  + bf16 group scales; distinct experts counted per layer from the routing of one eager pass of
  the same inputs), the gathered embedding rows and the KV prefix ``batch x context x 576 x 2 x
  layers`` (read once per request for all its nodes and heads). Activations are not counted.
* compute_floor_ms (extra): FLOPs / measured bf16 matmul rate; at large batch x nodes the step is
  compute-bound and this floor, not the HBM one, is the one to compare with.
* allreduce_ms: 2 all-reduces per layer of ``hidden x tokens x 2`` bytes, the custom in-graph
  time from allreduce.json, linearly interpolated in bytes between measured sizes and
  extrapolated along the last segment beyond them. That file was measured on 2xH200; using it for
  8 GPUs is an assumption (the one-shot reads 7 peers instead of 1).
* predicted_tok_s: per request, ``acceptance / (step_ms + allreduce_ms) * 1000``; acceptance per
  budget from the demo model (acceptance-demo.json, T=0) unless ``--acceptance``; AR = 1. The
  drafter's time is not in the formula (assumed overlapped or negligible).

Routing modes (``--routing``): ``model``: the random router's own top-8 (close to uniform, so a
tree of 17 nodes touches ~100 experts per layer: the pessimistic end); ``tree-shared``: every
node of a tree uses its root's experts (the perfect-locality bound, verify rows only). Real K2
trees lie between the two; which end they sit near decides the verify targets.

Weights are generated lazily on the device (the full per-expert dict plus the stacked copies
would not fit), one layer's expert block at a time. Embedding: a [vocab/8, hidden] table with
token ids below vocab/8 (the repo's TP replicates the full table, but a step reads only its rows,
so the time is the same).

    PYTHONPATH=. python bench/k2_slice.py --out bench/results/k2-slice.json --commit SHA
    PYTHONPATH=. python bench/k2_slice.py --tiny --layers 2 --batches 1,4      # CPU, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from bench.common import git_commit, measure_copy_gbps, replay_ms  # noqa: E402
from services.draft.tree import build_trees  # noqa: E402
from services.verifier import model as model_mod  # noqa: E402
from services.verifier import moe as moe_mod  # noqa: E402
from services.verifier.config import TargetConfig  # noqa: E402
from services.verifier.graphs import VerifyGraphs  # noqa: E402
from services.verifier.kv_cache import PagedKVCache  # noqa: E402
from services.verifier.model import TargetModel, expected_tensors  # noqa: E402

TP = 8
GROUP = 32
DRAFT_DEPTH = 16   # DFlash block: depth limit of the random draft trees
NIBBLE_STD = math.sqrt((16**2 - 1) / 12)   # std of a uniform nibble - 8 in -8..7
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
ROUTINGS = ("model", "tree-shared")

# moonshotai/Kimi-K2-Instruct config.json (model_type kimi_k2). The INT4 routed experts follow
# Kimi-K2-Thinking's compressed-tensors pack-quantized, symmetric, group 32 (the verifier reads
# only the group; the ignore list is abbreviated). Later K2 checkpoints (0905, Thinking) use yarn
# factor 64 and 262144 positions: that changes no shape and no timing.
K2_CONFIG: dict[str, Any] = {
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp.gate$"],
    },
}

# Same structure, small enough for the CPU (the test runs it); sliced by the same TP8 rule.
TINY_CONFIG: dict[str, Any] = {
    **K2_CONFIG,
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 32,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 8192,
}

TINY_CONTEXT = 64


# ----------------------------------------------------------------------------------------- config


def per_rank_config(full: dict[str, Any], tp: int = TP, layers: int | None = None) -> dict[str, Any]:
    """The HF config of one TP rank's slice, buildable as a tp=1 TargetModel.

    Heads, lm_head rows (and the embedding table, see the module doc), the dense MLP's and every
    expert's intermediate dimension divide by ``tp``; the shared expert follows
    (``shared_intermediate_size = moe_intermediate_size * n_shared_experts``). Routers, norms and
    the q_a / kv_a projections are replicated, as in services/verifier/parallel.py.
    """
    d = json.loads(json.dumps(full))
    for field in ("num_attention_heads", "vocab_size", "intermediate_size", "moe_intermediate_size"):
        assert d[field] % tp == 0, f"{field}={d[field]} does not split over tp={tp}"
        d[field] //= tp
    group = d["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    assert d["moe_intermediate_size"] % group == 0, "a rank's expert slice must hold whole INT4 groups"
    if layers is not None:
        d["num_hidden_layers"] = layers
    return d


# ---------------------------------------------------------------------------------------- weights

_EXPERT_NAME = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight_packed|weight_scale|weight_shape)$")


def _expert_dense_shape(config: TargetConfig, proj: str) -> tuple[int, int]:
    hid, inter = config.hidden_size, config.moe_intermediate_size
    return (hid, inter) if proj == "down_proj" else (inter, hid)


class RandomWeights(Mapping[str, Tensor]):
    """Random weights for every tensor ``expected_tensors(config)`` names, made on first access.

    Why lazy: the K2 slice's packed experts alone are ~63 GB; a dict of 200k per-expert tensors
    next to the stacked copies TargetModel makes would not fit. Experts are generated one layer
    at a time as stacked blocks ``[E, out, in/8]`` and handed out as views, so validation and the
    constructor's ``torch.stack`` each see one block (~1.2 GB) at a time. Dense tensors are made
    per access (validation's copy is dropped at once). Scales keep activations O(1) over all
    layers: linear weights std 1/sqrt(fan_in), the same for dequantised experts, norms 1.
    """

    def __init__(self, config: TargetConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        assert config.quantization is not None, "the slice bench wants INT4 experts"
        self.config = config
        self.dtype = dtype
        self.device = device
        self.shapes = expected_tensors(config)
        self._gen = torch.Generator(device=device).manual_seed(seed)
        self._layer = -1
        self._block: dict[str, tuple[Tensor, Tensor]] = {}

    def __getitem__(self, name: str) -> Tensor:
        shape = self.shapes[name]   # KeyError for names the config does not imply
        m = _EXPERT_NAME.match(name)
        if m is None:
            return self._dense(name, shape)
        layer, expert, proj, kind = int(m[1]), int(m[2]), m[3], m[4]
        if kind == "weight_shape":
            return torch.tensor(_expert_dense_shape(self.config, proj), dtype=torch.int64)
        packed, scale = self._experts(layer)[proj]
        return (packed if kind == "weight_packed" else scale)[expert]

    def __contains__(self, name: object) -> bool:   # Mapping's default would generate the tensor
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def release(self) -> None:
        """Drop the cached expert block (call once the model is built)."""
        self._block = {}
        self._layer = -1

    def _dense(self, name: str, shape: tuple[int, ...]) -> Tensor:
        kw = dict(device=self.device, generator=self._gen)
        if name.endswith("norm.weight"):   # input/post/q_a/kv_a layernorms and model.norm
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        if name.endswith("e_score_correction_bias"):
            return torch.randn(shape, dtype=torch.float32, **kw).mul_(0.01)   # fp32 as in the checkpoint
        t = torch.randn(shape, dtype=self.dtype, **kw)
        if name == "model.embed_tokens.weight":
            return t
        return t.mul_(shape[-1] ** -0.5)

    def _experts(self, layer: int) -> dict[str, tuple[Tensor, Tensor]]:
        if layer != self._layer:
            self._block = {}   # free the previous layer's block before making the next
            E = self.config.n_routed_experts or 0
            for proj in EXPERT_PROJS:
                out_f, in_f = _expert_dense_shape(self.config, proj)
                packed = torch.randint(-(2**31), 2**31 - 1, (E, out_f, in_f // 8), dtype=torch.int32,
                                       device=self.device, generator=self._gen)
                scale = torch.empty(E, out_f, in_f // GROUP, dtype=torch.bfloat16, device=self.device)
                scale.uniform_(0.5, 1.5, generator=self._gen).mul_(in_f**-0.5 / NIBBLE_STD)
                self._block[proj] = (packed, scale)
            self._layer = layer
        return self._block


def build_model(config: TargetConfig, dtype: torch.dtype, device: torch.device, seed: int) -> TargetModel:
    """TargetModel over lazily generated random weights; peak ~ final size + one expert block."""
    weights = RandomWeights(config, dtype, device, seed)
    model = TargetModel(config, weights, dtype=dtype, device=device)   # type: ignore[arg-type]
    weights.release()
    del weights
    _free_memory(device)
    return model


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- cache, trees


def build_cache(config: TargetConfig, batch: int, context: int, page_size: int, dtype: torch.dtype,
                device: torch.device, seed: int) -> tuple[PagedKVCache, list[str]]:
    """One request per batch slot, each owning its own (shuffled) pages of random latents.

    Random rather than zero so the attention softmax does real work on realistic values.
    """
    pages = batch * -(-context // page_size)
    cache = PagedKVCache(config.num_hidden_layers, pages, page_size, config.kv_dim, dtype, device, shuffle_seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    cache.kv.normal_(generator=gen)
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        cache.reserve(rid, context)
    return cache, rids


@dataclass
class Trees:
    """Per-request trees (root first), flattened on demand for the first ``b`` requests."""

    tokens: list[Tensor]
    parents: list[Tensor]
    depths: list[Tensor]

    def flat(self, b: int) -> tuple[Tensor, Tensor, Tensor, list[int]]:
        sizes = [int(t.numel()) for t in self.tokens[:b]]
        return (torch.cat(self.tokens[:b]), torch.cat(self.parents[:b]), torch.cat(self.depths[:b]), sizes)


def random_trees(budget: int, batch: int, vocab: int, gen: torch.Generator) -> Trees:
    """Best-first trees (``build_trees``, the drafter's own builder) over random draft tables.

    Budget 0 is autoregressive: the root alone. Peaked random tables (logits 4 x N(0, 1)) give
    the chain-plus-branches shapes a real drafter produces.
    """
    roots = torch.randint(0, vocab, (batch,), generator=gen)
    if budget == 0:
        one = [torch.zeros(1, dtype=torch.int64)] * batch
        return Trees([roots[i:i + 1] for i in range(batch)], [o - 1 for o in one], one)
    logits = 4.0 * torch.randn(batch, DRAFT_DEPTH, vocab, generator=gen)
    tb = build_trees(torch.log_softmax(logits, dim=-1), budget, roots, backend="torch")
    sizes = tb.sizes.tolist()
    pick = lambda t: [t[i, :n].clone() for i, n in enumerate(sizes)]  # noqa: E731
    return Trees(pick(tb.tokens), pick(tb.parents), pick(tb.depths))


# ---------------------------------------------------------------------------------------- routing


@contextlib.contextmanager
def tree_shared_routing(nodes: int, active: bool) -> Iterator[None]:
    """Every node of a tree uses its root's experts (perfect-locality bound), while active.

    Patches ``services.verifier.moe.route`` (what ``moe_forward`` calls): a graph captured inside
    keeps the patched selection. Not ``select_experts``, which CUDA's routing kernels bypass (the
    tree-shared rows then measured the model's routing). Padded batches lay trees out as
    ``[B, nodes]`` rows.
    """
    if not active or nodes <= 1:
        yield
        return
    original = moe_mod.route

    def shared(*args: Any, **kwargs: Any) -> moe_mod.Routing:
        r = original(*args, **kwargs)
        n, k = r.ids.shape
        if n % nodes:
            return r
        root = lambda t: t.view(n // nodes, nodes, k)[:, :1].expand(n // nodes, nodes, k).reshape(n, k)  # noqa: E731
        return moe_mod.Routing(ids=root(r.ids), weights=root(r.weights))

    moe_mod.route = shared
    try:
        yield
    finally:
        moe_mod.route = original


@contextlib.contextmanager
def record_experts(counts: list[int]) -> Iterator[None]:
    """Append the distinct routed experts of each MoE layer (host sync: eager passes only).

    Wraps ``services.verifier.model.moe_forward``; when the model stops calling it by that name
    nothing is recorded and the caller falls back to the uniform expectation.
    """
    original = getattr(model_mod, "moe_forward", None)
    if original is None:
        yield
        return

    def wrapped(x: Tensor, moe: moe_mod.MoEWeights, config: TargetConfig, *args: Any, **kwargs: Any) -> Tensor:
        counts.append(int(torch.unique(moe_mod.route(x, moe, config).ids).numel()))
        return original(x, moe, config, *args, **kwargs)

    model_mod.moe_forward = wrapped
    try:
        yield
    finally:
        model_mod.moe_forward = original


def expected_distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts ``tokens`` uniformly routed top-k picks touch: E (1 - (1 - k/E)^tokens)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


# ------------------------------------------------------------------------------------ floors, etc.


def expert_bytes(config: TargetConfig) -> int:
    """One routed expert of the slice: gate, up, down as INT4 words + bf16 group scales."""
    total = 0
    for proj in EXPERT_PROJS:
        out_f, in_f = _expert_dense_shape(config, proj)
        total += out_f * in_f // 2 + out_f * (in_f // GROUP) * 2
    return total


def nonexpert_weight_bytes(config: TargetConfig) -> dict[str, int]:
    """Bytes of every weight but the routed experts and the embedding table, at checkpoint dtypes.

    bf16 throughout, the router bias fp32. (TargetModel keeps the router weight in fp32, which
    reads 2x its checkpoint bytes: counted here at bf16, the floor a kernel could reach.)
    """
    out = {"lm_head": 0, "layers": 0}
    for name, shape in expected_tensors(config).items():
        if ".experts." in name or name == "model.embed_tokens.weight":
            continue
        nbytes = math.prod(shape) * (4 if name.endswith("e_score_correction_bias") else 2)
        out["lm_head" if name == "lm_head.weight" else "layers"] += nbytes
    return out


def step_bytes(config: TargetConfig, nonexpert: dict[str, int], experts_per_layer: Sequence[float],
               batch: int, nodes: int, context: int) -> dict[str, int]:
    """Bytes one step must read: weights, touched experts, KV prefix, gathered embedding rows."""
    tokens = batch * nodes
    return {
        "weights_nonexpert": nonexpert["layers"],
        "lm_head": nonexpert["lm_head"],
        "experts": int(round(sum(experts_per_layer) * expert_bytes(config))),
        "kv_prefix": batch * context * config.kv_dim * 2 * config.num_hidden_layers,
        "embedding_rows": tokens * config.hidden_size * 2,
    }


def step_flops(config: TargetConfig, batch: int, nodes: int, context: int) -> float:
    """Matmul FLOPs of one step (absorbed MLA, routed top-k + shared experts, lm_head)."""
    c = config
    H, nope, rope, v, kvr = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    q = (c.q_lora_rank * c.hidden_size + H * (nope + rope) * c.q_lora_rank) if c.q_lora_rank else H * (nope + rope) * c.hidden_size
    attn_params = q + c.kv_dim * c.hidden_size + H * (nope + v) * kvr + c.hidden_size * H * v
    macs = 0.0   # multiply-adds per token
    for i in range(c.num_hidden_layers):
        macs += attn_params + H * (context + nodes) * (c.kv_dim + kvr)   # QK over 576, PV over 512
        if c.is_moe_layer(i):
            macs += (c.n_routed_experts or 0) * c.hidden_size
            macs += (c.num_experts_per_tok + c.n_shared_experts) * 3 * c.hidden_size * c.moe_intermediate_size
        else:
            macs += 3 * c.hidden_size * c.intermediate_size
    macs += c.vocab_size * c.hidden_size
    return 2.0 * macs * batch * nodes


def load_allreduce_points(path: Path) -> list[tuple[int, float]]:
    """(bytes, custom in-graph µs) sorted by size."""
    doc = json.loads(path.read_text())
    return sorted((int(r["bytes"]), float(r["custom_us"])) for r in doc["rows"])


def allreduce_us(nbytes: int, points: Sequence[tuple[int, float]]) -> float:
    """Linear in bytes between measured sizes; the smallest below; the last segment's slope above."""
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (nbytes - b1) / (b1 - b0)


def load_acceptance(spec: str | None, default_path: Path) -> tuple[dict[int, float], str]:
    """Mean acceptance per budget: ``"8=3.3,16=3.8"``, a JSON file in the acceptance-demo schema,
    or (None) the demo model's T=0 rows."""
    if spec and "=" in spec:
        table = {int(k): float(v) for k, v in (item.split("=") for item in spec.split(","))}
        return table, f"--acceptance {spec}"
    path = Path(spec) if spec else default_path
    doc = json.loads(path.read_text())
    table = {int(r["budget"]): float(r["mean_acceptance"]) for r in doc["rows"] if float(r["temperature"]) == 0.0}
    return table, f"{path.name} (benchmark {doc.get('benchmark')}, T=0, model {doc.get('params', {}).get('model')})"


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Copy bandwidth (bytes read + written per second): bench.common on CUDA, a small copy on CPU."""
    if device.type == "cuda":
        return measure_copy_gbps()
    src = torch.randn(8 << 20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def matmul_tflops(device: torch.device) -> float:
    """Dense matmul rate: bf16 8192^3 on CUDA, fp32 512^3 on CPU."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------- timing


def time_full_ms(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median wall time of the whole call (host work included), synchronised around each."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_replay_ms(graphs: VerifyGraphs, key: tuple[int, int], reps: int) -> float | None:
    """Median replay of the captured graph alone (CUDA events); None when there is none to replay."""
    bucket = getattr(graphs, "_buckets", {}).get(key)
    graph = getattr(bucket, "graph", None)
    if graph is None:
        return None
    return replay_ms(graph, reps)


# ------------------------------------------------------------------------------------------ cases


@dataclass(frozen=True)
class Case:
    routing: str
    mode: str   # "ar" or "verify"
    budget: int


def plan_cases(budgets: Sequence[int], routings: Sequence[str]) -> list[Case]:
    """Most informative first (T-k2 reads AR and verify at budget 16), so a deadline cuts the rest."""
    order = sorted(budgets, key=lambda b: (b != 16, b))
    cases = [Case("model", "ar", 0)] if "model" in routings else []
    for routing in routings:
        cases += [Case(routing, "verify", b) for b in order]
    return cases


@dataclass
class Bench:
    """Everything a case needs, built once."""

    model: TargetModel
    cache: PagedKVCache
    rids: list[str]
    trees: dict[int, Trees]
    context: int
    device: torch.device
    reps: int


def run_case(bench: Bench, case: Case, batches: Sequence[int], deadline: float, rows: list[dict[str, Any]]) -> None:
    """Time one (routing, mode, budget) over the batches, appending a raw row per batch as it
    finishes (a failure later keeps them); one new VerifyGraphs (and graph pool) per case, freed
    when this returns (the caller empties the allocator's cache)."""
    nodes = case.budget + 1
    dev = bench.device
    capture = dev.type == "cuda" and getattr(bench.model, "capturable", True)   # fused INT4 MoE: bf16 on CUDA
    kw = dict(max_context=bench.context, batch_buckets=tuple(sorted(batches)), node_buckets=(nodes,))
    graphs = VerifyGraphs(bench.model, bench.cache, capture=capture, **kw)
    eager = VerifyGraphs(bench.model, bench.cache, capture=False, **kw)   # routing count (host syncs)
    with tree_shared_routing(nodes, case.routing == "tree-shared"):
        for b in batches:
            if time.perf_counter() > deadline:
                print(f"  deadline: skipping {case} batch {b}", flush=True)
                break
            tokens, parents, depths, sizes = bench.trees[case.budget].flat(b)
            args = (tokens, parents, depths, sizes, [bench.context] * b, [bench.cache.page_ids(r) for r in bench.rids[:b]])
            t0 = time.perf_counter()
            out = graphs.run(*args).real()
            _sync(dev)
            first_s = time.perf_counter() - t0
            finite = bool(torch.isfinite(out.logits).all()) and bool(torch.isfinite(out.new_kv).all())
            logits_std = float(out.logits.float().std()) if out.logits.numel() > 1 else 0.0
            del out
            step = time_full_ms(lambda: graphs.run(*args), bench.reps, dev)
            replay = time_replay_ms(graphs, (b, nodes), bench.reps) if capture else None
            counts: list[int] = []
            with record_experts(counts):
                eager.run(*args)
            rows.append({"routing": case.routing, "mode": case.mode, "budget": case.budget, "batch": b,
                         "tree_nodes": nodes, "tokens": b * nodes, "step_ms": step, "replay_ms": replay,
                         "first_run_s": first_s, "logits_finite": finite, "logits_std": logits_std,
                         "expert_counts": counts})
            print(f"  {case.routing:11s} {case.mode:6s} budget {case.budget:3d} batch {b:3d}: step {step:8.3f} ms"
                  f" replay {replay if replay is not None else float('nan'):8.3f} ms  first run {first_s:6.2f} s"
                  f"  logits finite {finite} std {logits_std:.2f}", flush=True)


def profile_step(bench: Bench, budget: int, batch: int, reps: int = 3, top: int = 25) -> dict[str, Any]:
    """GPU time per kernel name over ``reps`` graph replays of one (budget, batch) step: where the
    step's time goes, against its floor. Names are grouped by their first 60 characters. Captured
    with PDL off (``kernels.pdl``): with it a kernel starts early and waits for its predecessor, so
    its span would hold part of the predecessor's time and the spans would overlap."""
    from torch.profiler import ProfilerActivity, profile

    from kernels import pdl

    nodes = budget + 1
    graphs = VerifyGraphs(bench.model, bench.cache, max_context=bench.context, batch_buckets=(batch,),
                          node_buckets=(nodes,), capture=bench.device.type == "cuda")
    tokens, parents, depths, sizes = bench.trees[budget].flat(batch)
    args = (tokens, parents, depths, sizes, [bench.context] * batch,
            [bench.cache.page_ids(r) for r in bench.rids[:batch]])
    saved, pdl.PDL = pdl.PDL, False
    try:
        graphs.run(*args)  # captures the graph, without PDL
        _sync(bench.device)
    finally:
        pdl.PDL = saved
    cuda = bench.device.type == "cuda"   # on the CPU (tests) the ops' own CPU time stands in
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            graphs.run(*args)
        _sync(bench.device)
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name != ("CUDA" if cuda else "CPU"):
            continue
        t = totals.setdefault(ev.name[:60], [0.0, 0])
        t[0] += ev.device_time_total if cuda else ev.self_cpu_time_total
        t[1] += 1
    rows = sorted(({"kernel": k, "us_per_step": round(v[0] / reps, 2), "launches_per_step": v[1] // reps}
                   for k, v in totals.items()), key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    launches = sum(r["launches_per_step"] for r in rows)
    print(f"profile budget {budget} batch {batch}: {total / 1e3:.2f} ms of kernels, {launches} launches a step")
    for r in rows[:top]:
        print(f"  {r['us_per_step']:9.1f} us {r['launches_per_step']:5d}x  {r['kernel']}")
    return {"budget": budget, "batch": batch, "kernel_ms_per_step": round(total / 1e3, 3),
            "launches_per_step": launches, "pdl": False, "top": rows[:top]}


def finish_row(raw: dict[str, Any], config: TargetConfig, nonexpert: dict[str, int], copy_gbps: float,
               tflops: float, ar_points: Sequence[tuple[int, float]], acceptance: dict[int, float],
               context: int) -> dict[str, Any]:
    """Floors, all-reduce and prediction for one measured row (the schema's row keys first)."""
    b, nodes, tokens = raw["batch"], raw["tree_nodes"], raw["tokens"]
    E, k = config.n_routed_experts or 0, config.num_experts_per_tok
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    uniform = expected_distinct_experts(E, k, tokens)
    counts = raw.pop("expert_counts")
    measured = len(counts) == moe_layers and moe_layers > 0
    per_layer = counts if measured else [uniform] * moe_layers
    split = step_bytes(config, nonexpert, per_layer, b, nodes, context)
    total = sum(split.values())
    floor = total / (copy_gbps * 1e9) * 1e3
    compute_floor = step_flops(config, b, nodes, context) / (tflops * 1e12) * 1e3
    ar_ms = 2 * config.num_hidden_layers * allreduce_us(config.hidden_size * tokens * 2, ar_points) / 1e3
    if raw["mode"] == "ar":
        acc = 1.0
    elif raw["budget"] in acceptance:
        acc = acceptance[raw["budget"]]
    else:
        raise SystemExit(f"no acceptance for budget {raw['budget']}: pass --acceptance {raw['budget']}=X,...")
    step = raw["step_ms"]
    pred = acc / (step + ar_ms) * 1e3
    replay = raw["replay_ms"]
    return {
        "mode": raw["mode"], "budget": raw["budget"], "batch": b, "step_ms": round(step, 4),
        "floor_ms": round(floor, 4), "predicted_tok_s": round(pred, 2),
        "routing": raw["routing"], "tree_nodes": nodes, "tokens": tokens,
        "replay_ms": None if replay is None else round(replay, 4),
        "step_over_floor": round(step / floor, 3),
        "compute_floor_ms": round(compute_floor, 4),
        "step_over_max_floor": round(step / max(floor, compute_floor), 3),
        "experts_touched_per_layer": round(statistics.mean(per_layer), 2) if per_layer else 0.0,
        "experts_touched_source": "measured (eager pass, same inputs)" if measured else "uniform expectation",
        "experts_touched_min_max": [min(per_layer), max(per_layer)] if measured else None,
        "experts_touched_uniform": round(uniform, 2),
        # tree-shared patches moe.select_experts: a layer touching more than k per tree means it did not take
        "routing_applied": raw["routing"] != "tree-shared" or not measured or max(per_layer) <= k * b,
        "bytes": total, "bytes_split": split,
        "allreduce_ms": round(ar_ms, 4), "acceptance": acc,
        "predicted_agg_tok_s": round(pred * b, 1),
        "predicted_tok_s_replay": None if replay is None else round(acc / (replay + ar_ms) * 1e3, 2),
        "first_run_s": round(raw["first_run_s"], 3), "logits_finite": raw["logits_finite"],
        "logits_std": round(raw["logits_std"], 4),
    }


def t_k2_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The three T-k2 checks, where the rows allow them."""
    def find(routing: str, mode: str, budget: int, batch: int) -> dict[str, Any] | None:
        return next((r for r in rows if (r["routing"], r["mode"], r["budget"], r["batch"]) == (routing, mode, budget, batch)), None)

    out: dict[str, Any] = {}
    ar = find("model", "ar", 0, 1)
    if ar:
        out["ar_c1_step_over_floor"] = ar["step_over_floor"]
        out["ar_c1_within_1.5x_floor"] = ar["step_over_floor"] <= 1.5
    for routing in ROUTINGS:
        v16 = find(routing, "verify", 16, 1)
        if ar and v16:
            ratio = round(v16["step_ms"] / ar["step_ms"], 3)
            out[f"verify16_c1_over_ar_c1[{routing}]"] = ratio
            out[f"verify16_within_1.5x_ar[{routing}]"] = ratio <= 1.5
        c1 = {r["budget"]: r["predicted_tok_s"] for r in rows if r["routing"] == routing and r["mode"] == "verify" and r["batch"] == 1}
        if c1:
            best = max(c1, key=c1.get)
            out[f"predicted_c1_ddtree_tok_s[{routing}]"] = c1
            out[f"predicted_c1_best[{routing}]"] = {"budget": best, "tok_s": c1[best], "meets_600": c1[best] >= 600}
    if ar:
        out["predicted_c1_ar_tok_s"] = ar["predicted_tok_s"]
    return out


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    print(f"{'routing':11s} {'mode':6s} {'bud':>3s} {'B':>4s} {'step':>9s} {'replay':>9s} {'floor':>8s} {'x':>5s}"
          f" {'cfloor':>8s} {'exp/L':>6s} {'ar_ms':>7s} {'acc':>5s} {'tok/s':>8s}")
    for r in rows:
        replay = r["replay_ms"] if r["replay_ms"] is not None else float("nan")
        print(f"{r['routing']:11s} {r['mode']:6s} {r['budget']:3d} {r['batch']:4d} {r['step_ms']:9.3f} {replay:9.3f}"
              f" {r['floor_ms']:8.3f} {r['step_over_floor']:5.2f} {r['compute_floor_ms']:8.3f}"
              f" {r['experts_touched_per_layer']:6.1f} {r['allreduce_ms']:7.3f} {r['acceptance']:5.2f}"
              f" {r['predicted_tok_s']:8.1f}")


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "k2-slice.json"))
    p.add_argument("--commit", default="")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU): same structure, same TP8 slicing")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (61 for K2)")
    p.add_argument("--context", type=int, default=None, help=f"prefix tokens per request (default 1024; tiny {TINY_CONTEXT})")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--budgets", default="8,16,32,64")
    p.add_argument("--routing", default="model,tree-shared", help=f"comma list of {ROUTINGS}")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--acceptance", default=None, help='"8=3.3,16=3.8,..." or an acceptance JSON (default: demo T=0)')
    p.add_argument("--allreduce-json", default=str(ROOT / "bench" / "results" / "allreduce.json"))
    p.add_argument("--deadline-s", type=float, default=330.0, help="start no new batch after this many seconds")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default="", help='"budget:batch,..." (0 = autoregressive): kernel time '
                   'breakdown of those steps into the JSON\'s "profile"; with --profile-only no timings')
    p.add_argument("--profile-only", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.deadline_s
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    batches = sorted(int(x) for x in args.batches.split(","))
    budgets = [int(x) for x in args.budgets.split(",")]
    routings = [r for r in args.routing.split(",") if r]
    assert all(r in ROUTINGS for r in routings), f"--routing takes {ROUTINGS}"
    context = args.context or (TINY_CONTEXT if args.tiny else 1024)
    full = TINY_CONFIG if args.tiny else K2_CONFIG
    rank_dict = per_rank_config(full, TP, args.layers)
    config = TargetConfig.from_hf(rank_dict, source="k2-slice config")
    acceptance, acc_source = load_acceptance(args.acceptance, ROOT / "bench" / "results" / "acceptance-demo.json")
    missing = [b for b in budgets if b not in acceptance]
    if missing:
        raise SystemExit(f"no acceptance for budgets {missing} in {acc_source}: pass --acceptance B=X,...")
    ar_points = load_allreduce_points(Path(args.allreduce_json))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    copy_gbps = copy_bandwidth_gbps(device)
    tflops = matmul_tflops(device)
    print(f"{gpu}: copy {copy_gbps:.0f} GB/s, matmul {tflops:.0f} TFLOP/s", flush=True)
    t0 = time.perf_counter()
    model = build_model(config, dtype, device, args.seed)
    _sync(device)
    build_s = time.perf_counter() - t0
    weights_gb = round(torch.cuda.memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None
    print(f"model built in {build_s:.1f} s" + (f", {weights_gb} GB on the GPU" if weights_gb else ""), flush=True)
    cache, rids = build_cache(config, max(batches), context, args.page_size, dtype, device, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    trees = {b: random_trees(b, max(batches), config.vocab_size, gen) for b in sorted({0, *budgets})}
    bench = Bench(model, cache, rids, trees, context, device, args.reps)
    nonexpert = nonexpert_weight_bytes(config)

    assumptions = [
        "one GPU runs one TP8 rank's slice (8 heads, vocab/8 lm_head rows, intermediate/8 of the dense MLP, "
        "shared and every routed expert); the other ranks do the same work in parallel",
        "embedding: a [vocab/8, hidden] table with token ids < vocab/8 (a step reads only its rows)",
        "weights random: experts random INT4 words + bf16 group-32 scales, other weights N(0, 1/fan_in) bf16",
        "KV prefix: random latents, every request owns its own shuffled pages",
        "routing 'model': the random router (far from uniform: tokens concentrate on few experts); 'tree-shared': all nodes of a tree use the root's "
        "experts (perfect-locality bound); real K2 trees lie between",
        "all-reduce: 2 per layer of hidden x tokens x 2 bytes, custom in-graph time from allreduce.json "
        "(measured on 2xH200) used for 8 GPUs; linear interpolation in bytes, extrapolated past 4 MB",
        "predicted tok/s = acceptance / (step + all-reduces); drafter time not included; acceptance from "
        "the demo model, not K2",
        "floor: bytes read / copy bandwidth (read + written per second), router counted at bf16 "
        "(the model keeps it in fp32)",
    ]
    doc: dict[str, Any] = {
        "benchmark": Path(args.out).stem, "commit": git_commit(args.commit), "gpu": gpu, "copy_gbps": round(copy_gbps, 1),
        "params": {
            "config_full": full, "config_rank": rank_dict, "tp": TP, "dtype": str(dtype).replace("torch.", ""),
            "device": device.type, "context": context, "page_size": args.page_size, "batches": batches,
            "budgets": budgets, "routing": routings, "reps": args.reps, "seed": args.seed,
            "draft_depth": DRAFT_DEPTH, "matmul_tflops": round(tflops, 1), "acceptance": acceptance,
            "acceptance_source": acc_source, "allreduce_source": Path(args.allreduce_json).name,
            "allreduce_points": ar_points, "expert_bytes": expert_bytes(config),
            "nonexpert_weight_bytes": nonexpert, "build_s": round(build_s, 1), "weights_gb": weights_gb,
            "kv_cache_gb": round(cache.kv.numel() * cache.kv.element_size() / 1e9, 2),
            "assumptions": assumptions, "skipped": [], "errors": [],
        },
        "rows": [],
    }
    out_path = Path(args.out)
    if args.profile:
        doc["profile"] = []
        for spec in args.profile.split(","):
            budget, batch = (int(v) for v in spec.split(":"))
            doc["profile"].append(profile_step(bench, budget, batch))
            _free_memory(device)
        _write(out_path, doc)
    for case in ([] if args.profile_only else plan_cases(budgets, routings)):
        if time.perf_counter() > deadline:
            doc["params"]["skipped"].append(f"{case.routing}/{case.mode}/{case.budget}")
            continue
        raws: list[dict[str, Any]] = []
        try:
            run_case(bench, case, batches, deadline, raws)
        except Exception as e:   # keep the finished cases and try the next (an OOM need not end the run)
            traceback.print_exc()
            doc["params"]["errors"].append(f"{case.routing}/{case.mode}/{case.budget}: {type(e).__name__}: {e}")
        _free_memory(device)
        done = {r["batch"] for r in raws}
        doc["params"]["skipped"] += [f"{case.routing}/{case.mode}/{case.budget}/batch{b}" for b in batches if b not in done]
        doc["rows"] += [finish_row(r, config, nonexpert, copy_gbps, tflops, ar_points, acceptance, context) for r in raws]
        doc["summary"] = t_k2_summary(doc["rows"])
        doc["params"]["total_s"] = round(time.perf_counter() - t_start, 1)
        if device.type == "cuda":
            doc["params"]["peak_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
        _write(out_path, doc)
    _write(out_path, doc)
    print_table(doc["rows"])
    print(json.dumps(doc.get("summary", {}), indent=1))
    print(f"wrote {out_path} in {time.perf_counter() - t_start:.0f} s", flush=True)
    return doc


def _write(path: Path, doc: dict[str, Any]) -> None:
    """Atomic rewrite, so a run cut short still leaves the cases finished so far."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    main()
