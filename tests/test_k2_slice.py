"""The K2 slice benchmark (bench/k2_slice.py) runs end to end in --tiny mode on the CPU, and its
K2 per-rank config and accounting say what the H200 run will build and count."""

from __future__ import annotations

import json
import math

import pytest

from bench import k2_slice
from services.verifier.config import TargetConfig


def test_k2_per_rank_config_is_the_tp8_slice():
    d = k2_slice.per_rank_config(k2_slice.K2_CONFIG)
    c = TargetConfig.from_hf(d)
    assert (c.num_attention_heads, c.vocab_size, c.intermediate_size) == (8, 20480, 2304)
    assert (c.moe_intermediate_size, c.shared_intermediate_size) == (256, 256)
    assert (c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok) == (7168, 61, 384, 8)
    assert c.quantization is not None and c.quantization.group_size == 32
    assert sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers)) == 60
    # one expert of the slice: 3 x (256 x 7168 nibbles + 256 x 224 bf16 scales)
    assert k2_slice.expert_bytes(c) == 3 * (256 * 7168 // 2 + 256 * 224 * 2)
    assert TargetConfig.from_hf(k2_slice.per_rank_config(k2_slice.K2_CONFIG, layers=3)).num_hidden_layers == 3


def test_lazy_weights_membership_does_not_generate():
    c = TargetConfig.from_hf(k2_slice.per_rank_config(k2_slice.K2_CONFIG))
    w = k2_slice.RandomWeights(c, dtype=k2_slice.torch.bfloat16, device=k2_slice.torch.device("cpu"))
    name = "model.layers.5.mlp.experts.383.down_proj.weight_packed"
    assert name in w and "model.layers.0.mlp.experts.0.up_proj.weight_packed" not in w
    assert len(w) == len(w.shapes) and w._block == {}   # nothing made by `in` / len
    assert w["model.layers.5.mlp.experts.3.down_proj.weight_shape"].tolist() == [7168, 256]


def test_accounting_helpers():
    assert k2_slice.expected_distinct_experts(384, 8, 1) == pytest.approx(8)
    assert k2_slice.expected_distinct_experts(384, 8, 10_000) == pytest.approx(384)
    pts = [(1024, 8.0), (4096, 9.0), (8192, 13.0)]
    assert k2_slice.allreduce_us(10, pts) == 8.0
    assert k2_slice.allreduce_us(2560, pts) == pytest.approx(8.5)
    assert k2_slice.allreduce_us(12288, pts) == pytest.approx(17.0)   # last segment's slope


def test_k2_slice_tiny_end_to_end(tmp_path):
    out = tmp_path / "k2-slice.json"
    k2_slice.main(["--tiny", "--layers", "2", "--batches", "1,4", "--reps", "2", "--out", str(out), "--commit", "abc"])
    doc = json.loads(out.read_text())
    here = k2_slice.torch.cuda.get_device_name() if k2_slice.torch.cuda.is_available() else "cpu"   # it runs on the GPU there
    assert doc["benchmark"] == "k2-slice" and doc["commit"] == "abc" and doc["gpu"] == here
    assert doc["copy_gbps"] > 0 and doc["params"]["config_rank"]["num_hidden_layers"] == 2
    assert not doc["params"]["skipped"] and not doc["params"]["errors"]
    rows = doc["rows"]
    want = {("model", "ar", 0)} | {(r, "verify", b) for r in ("model", "tree-shared") for b in (8, 16, 32, 64)}
    assert {(r["routing"], r["mode"], r["budget"]) for r in rows} == want
    assert len(rows) == len(want) * 2   # batches 1 and 4
    for r in rows:
        for key in ("mode", "budget", "batch", "step_ms", "floor_ms", "predicted_tok_s", "tree_nodes",
                    "experts_touched_per_layer", "bytes", "allreduce_ms", "step_over_floor", "replay_ms"):
            assert key in r, key
        assert math.isfinite(r["step_ms"]) and r["step_ms"] > 0
        assert r["floor_ms"] > 0 and r["predicted_tok_s"] > 0 and r["allreduce_ms"] > 0
        assert r["logits_finite"] and r["tree_nodes"] == r["budget"] + 1
        assert r["experts_touched_source"].startswith("measured")
        k = 4   # tiny: top-4 of 32 experts
        assert k <= r["experts_touched_per_layer"] <= min(32, k * r["batch"] * r["tree_nodes"])
        if r["routing"] == "tree-shared":   # every node uses its root's experts
            assert r["experts_touched_per_layer"] <= k * r["batch"]
    summary = doc["summary"]
    assert "ar_c1_step_over_floor" in summary and "predicted_c1_best[model]" in summary


def test_profile_only_lists_the_kernels_of_a_step(tmp_path):
    out = tmp_path / "k2-profile.json"
    doc = k2_slice.main(["--tiny", "--layers", "2", "--batches", "1", "--budgets", "8", "--routing", "model",
                         "--profile", "0:1,8:1", "--profile-only", "--out", str(out)])
    assert doc["rows"] == [] and [p["budget"] for p in doc["profile"]] == [0, 8]
    for p in doc["profile"]:
        assert p["launches_per_step"] > 0 and p["top"] and all(r["us_per_step"] >= 0 for r in p["top"])
    assert json.loads(out.read_text())["profile"][1]["batch"] == 1
