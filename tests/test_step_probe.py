"""The step probe (`bench.step_probe`): its hook stamps the step path's functions in a process
started with it, every function it names still exists, and the merge reads the stamps right."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.step_probe import HOOK, durations, gaps, load_stamps

sys.path.insert(0, str(HOOK))
try:
    from sitecustomize import STEP_PATH   # the hook's table (inactive here: no probe folder set)
finally:
    sys.path.remove(str(HOOK))
    sys.modules.pop("sitecustomize", None)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", sorted(STEP_PATH))
def test_every_stamped_function_exists(module: str) -> None:
    """A renamed function would drop out of the probe's timeline unnoticed (the hook only warns)."""
    mod = importlib.import_module(module)
    for cls, name, _ in STEP_PATH[module]:
        owner = mod if cls is None else getattr(mod, cls)
        assert callable(owner.__dict__.get(name) if cls is not None else getattr(owner, name, None)), (module, cls, name)


def test_hook_stamps_a_process_started_with_it(tmp_path: Path) -> None:
    code = ("import numpy as np\n"
            "from services.draft import engine\n"
            "t = engine._Tree(np.array([5, 6]), np.array([-1, 0]), np.array([0, 1]))\n"
            "for _ in range(3):\n"
            "    engine._pack_trees([t])\n")
    env = {**os.environ, "DDTREE_STEP_PROBE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(HOOK), str(REPO), str(REPO / "protos")])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tmp_path, timeout=120)
    files = list(tmp_path.glob("main-*.json"))
    assert len(files) == 1
    labels = [label for label, _ in json.loads(files[0].read_text())["stamps"]]
    assert labels == ["d.pack>", "d.pack<"] * 3


def test_hook_is_inert_without_its_folder(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DDTREE_STEP_PROBE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK), str(REPO), str(REPO / "protos")])
    code = "from services.draft import engine; print(hasattr(engine._pack_trees, '__wrapped__'))"

    def wrapped(extra: dict[str, str]) -> str:
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, check=True, cwd=tmp_path,
                              timeout=120, capture_output=True, text=True).stdout.strip()

    assert wrapped({}) == "False"   # nothing patched, nothing written
    assert not list(tmp_path.glob("*.json"))
    assert wrapped({"DDTREE_STEP_PROBE_DIR": str(tmp_path)}) == "True"   # the same process with the folder: patched


def _write(folder: Path, name: str, stamps: list[tuple[str, float]]) -> None:
    (folder / name).write_text(json.dumps({"argv": [], "stamps": stamps}))


def test_stamps_merge_into_durations_and_gaps(tmp_path: Path) -> None:
    # two steps: the draft sends (10 us), the verifier works (100 us), the draft reads (5 us)
    d, v = [], []
    for k in range(2):
        t = k * 1.0
        d += [("d.verify>", t), ("sock.write>", t + 10e-6), ("sock.write<", t + 20e-6), ("d.verify<", t + 200e-6)]
        v += [("v.step>", t + 50e-6), ("v.step<", t + 150e-6)]
    _write(tmp_path, "draft-1.json", d)
    _write(tmp_path, "verifier-2.json", v)
    _write(tmp_path, "main-3.json", [("d.pack>", 0.5), ("d.pack<", 0.6)])
    _write(tmp_path, "other-4.json", [("x>", 0.1)])   # not a role of the stack: left out
    stamps = load_stamps(tmp_path)
    assert [s[1] for s in stamps[:6]] == ["draft", "draft", "draft", "verifier", "verifier", "draft"]
    spans = {(r["role"], r["label"]): r for r in durations(stamps)}
    assert spans[("verifier", "v.step")]["median_us"] == pytest.approx(100.0)
    assert spans[("draft", "d.verify")] == {"role": "draft", "label": "d.verify", "count": 2, "median_us": 200.0}
    assert spans[("main", "d.pack")]["count"] == 1
    chain = {(r["from"], r["to"]): r for r in gaps(stamps, least=2)}
    assert chain[("d:sock.write<", "v:v.step>")]["median_us"] == pytest.approx(30.0)
    assert chain[("v:v.step<", "d:d.verify<")]["median_us"] == pytest.approx(50.0)
    assert not any("main" in k[0] or "main" in k[1] for k in chain)   # the in-process side is apart
    assert all(r["count"] >= 2 for r in chain.values())
