"""Every committed ``bench/results/*.json`` follows the result-file schema (BENCHMARKS.md, "Result files").

Why: the numbers quoted in BENCHMARKS.md and the issue notes are read back from these files by
name; a file whose ``benchmark`` is not its own name, or whose rows lack the keys that section lists
for it, is a figure nobody can find or check.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
TOP_KEYS = {"benchmark", "commit", "gpu", "copy_gbps", "params", "rows"}
# BENCHMARKS.md, "Result files": the row keys each named file carries at least
ROW_KEYS = {
    "acceptance-demo": {"budget", "temperature", "prompts", "mean_acceptance", "identical_to_autoregressive"},
    "tree_mla": {"batch", "context", "tree_nodes", "heads", "time_us", "gbps", "frac_of_copy", "speedup_vs_reference"},
    "tree_build": {"batch", "budget", "block", "time_us", "matches_reference"},
    "graphs": {"budget", "graph_equals_eager"},
    "int4_moe": {"shape", "tokens", "experts_touched", "time_us", "gbps", "frac_of_copy", "speedup_vs_reference",
                 "speedup_vs_bf16"},
    "allreduce": {"bytes", "custom_us", "nccl_us", "nccl_graph_us", "speedup", "speedup_graph"},
    "transport": {"transport", "batch", "bytes", "time_us"},
    "matrix-demo": {"context", "concurrency", "mode", "budget", "agg_tok_s", "per_req_tok_s", "p50_tpot_ms", "p99_tpot_ms",
                    "ttft_ms", "mean_acceptance", "power_w"},
    "k2-slice": {"mode", "budget", "batch", "step_ms", "floor_ms", "predicted_tok_s"},
    "split-overhead": {"deployment", "concurrency", "step_ms", "tok_s"},
}
FILES = sorted(RESULTS.glob("*.json"))


def test_there_are_result_files() -> None:
    assert len(FILES) > 100 and all((RESULTS / f"{name}.json").is_file() for name in ROW_KEYS)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_result_file_schema(path: Path) -> None:
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict) and TOP_KEYS <= set(doc), f"missing {TOP_KEYS - set(doc)}"
    assert doc["benchmark"] == path.stem, f"benchmark {doc['benchmark']!r} is not the file's name {path.stem!r}"
    # A hash alone (a note on what ran beside it goes in params): free text found no commit.
    assert isinstance(doc["commit"], str) and re.fullmatch(r"[0-9a-f]{7,40}", doc["commit"]), doc["commit"]
    assert isinstance(doc["gpu"], str) and doc["gpu"], "no gpu"
    assert doc["copy_gbps"] is None or doc["copy_gbps"] > 0, doc["copy_gbps"]
    assert isinstance(doc["params"], dict) and isinstance(doc["rows"], list)
    # Every serving-matrix run (matrix-*.json: A/B runs, other contexts) has matrix-demo's row keys.
    need = ROW_KEYS.get(path.stem, ROW_KEYS["matrix-demo"] if path.stem.startswith("matrix") else None)
    if need is not None:
        assert doc["rows"], "no rows"
        for row in doc["rows"]:
            assert need <= set(row), f"row lacks {need - set(row)}: {row}"


def test_benchmarks_md_lists_the_row_keys_checked_here() -> None:
    """The schema a reader finds in BENCHMARKS.md is the one these tests hold the files to."""
    text = (RESULTS.parents[1] / "BENCHMARKS.md").read_text()
    section = text.split("## Result files", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 2 and cells[0] not in ("benchmark", "---"):
            table[cells[0]] = {k.strip() for k in cells[1].split(",")}
    assert table == ROW_KEYS
    assert all(f'"{key}"' in section for key in TOP_KEYS)
