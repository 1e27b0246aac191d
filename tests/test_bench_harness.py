"""The benchmark harness runs end to end on a tiny matrix against a real stack, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

from services.common.launcher import Stack, StackSpec, free_port
from tests.stack_fixtures import build_checkpoint


def test_bench_matrix_end_to_end(tmp_path):
    ckpt = build_checkpoint(tmp_path)
    metrics = free_port()
    spec = StackSpec(model_path=str(ckpt), scheduler_port=0, extra_env={"DDTREE_DRAFT_METRICS_PORT": str(metrics)})
    out = tmp_path / "matrix-tiny.json"
    with Stack(spec) as stack:
        subprocess.run([sys.executable, "-m", "services.cli", "bench", "--address", stack.scheduler_address,
                        "--contexts", "8", "20", "--concurrency", "1", "3", "--budgets", "4", "--max-tokens", "6",
                        "--draft-metrics", f"127.0.0.1:{metrics}", "--out", str(out)], check=True, timeout=300)
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "matrix-tiny" and doc["gpu"] == "cpu" and doc["commit"]
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 2   # contexts x concurrency x (AR + one budget)
    for r in rows:
        for key in ("context", "concurrency", "mode", "budget", "agg_tok_s", "per_req_tok_s", "p50_tpot_ms",
                    "p99_tpot_ms", "ttft_ms", "mean_acceptance", "power_w"):
            assert key in r
        assert r["agg_tok_s"] > 0 and r["mean_acceptance"] >= 1
        assert r["step_split_ms"]["draft_ms"] is not None and r["step_split_ms"]["verify_ms"] > 0
    assert {r["mode"] for r in rows} == {"autoregressive", "ddtree"}
    assert out.with_suffix(".png").stat().st_size > 1000
