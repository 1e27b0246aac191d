"""Two commits' `bench.split_overhead` on one machine, alternated: old, new, new, old, old, new, ...

Machine instances differ by more than most changes to the stack's host path (the three-process
step varies by a third between them), so a change is judged only against its parent measured in
the same call. The old commit is a tree extracted beside this one (`git archive <sha> services
protos kernels bench | tar -x -C DIR`); this checkout is the new one. Each run is the unchanged
`bench.split_overhead` in its own tree and process; the rows are merged into one result file
(BENCHMARKS.md's result-file schema) with `code` and `round` on each row. The commit that goes
first swaps every round, so a drift of the machine within a call does not fall on one side.

    python -m bench.split_overhead_ab --old-dir /tmp/old --old-code b26b345 --new-code e43f9e6 \
        --rounds 2 -- --prompts 6 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["main"]

HERE = Path(__file__).resolve().parent.parent


def _run(tree: Path, code: str, args: list[str], out: Path) -> dict:
    """One `bench.split_overhead` run in ``tree``, its result file read back."""
    if not (tree / "models").exists():
        (tree / "models").symlink_to(HERE / "models")   # the weights are the same for both
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), str(tree / "protos"),
                                                                      os.environ.get("PYTHONPATH", "")]))}
    subprocess.run([sys.executable, "-m", "bench.split_overhead", *args, "--out", str(out), "--commit", code],
                   cwd=tree, env=env, check=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old-dir", required=True, help="the old commit's tree (services, protos, kernels, bench)")
    p.add_argument("--old-code", required=True, help="the old commit's hash, as recorded")
    p.add_argument("--new-code", required=True, help="this checkout's commit hash, as recorded")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--what", default="", help="what the new commit changed (recorded in params.ab)")
    p.add_argument("--out", default="", help="default bench/results/split-overhead-ab-<new-code>.json")
    p.add_argument("rest", nargs="*", help="after --: bench.split_overhead's own arguments")
    args = p.parse_args(argv)
    out = Path(args.out or HERE / "bench" / "results" / f"split-overhead-ab-{args.new_code}.json")
    trees = {args.old_code: Path(args.old_dir).resolve(), args.new_code: HERE}
    pair = (args.old_code, args.new_code)
    order = [code for r in range(args.rounds) for code in (pair if r % 2 == 0 else pair[::-1])]
    rows, first = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for i, code in enumerate(order):
            doc = _run(trees[code], code, args.rest, Path(tmp) / f"run{i}.json")
            first = first or doc
            rows += [{"code": code, "round": i // 2 + 1, **row} for row in doc["rows"]]
            for row in doc["rows"]:
                print(f"round {i // 2 + 1} {code} {row['deployment']:>13} step {row['step_ms']:.2f} ms "
                      f"{row['tok_s']:.1f} tok/s ratio {row['ratio']:.3f}", flush=True)
    assert first is not None
    params = {**first["params"], "order": order,
              "ab": f"{args.old_code} and {args.new_code}{' (' + args.what + ')' if args.what else ''}, alternating "
                    f"on one machine in one call, the first swapped every round; each figure its run's median pass"}
    result = {"benchmark": out.stem, "commit": args.new_code, "gpu": first["gpu"], "copy_gbps": first["copy_gbps"],
              "params": params, "rows": rows}
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
