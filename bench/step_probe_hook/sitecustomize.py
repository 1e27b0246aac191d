"""Loaded by Python's `site` at start-up in every process whose PYTHONPATH starts with this folder
(`python -m bench.step_probe` puts it there for the stack it runs): with DDTREE_STEP_PROBE_DIR set,
the functions of a step's path (`STEP_PATH`) note a monotonic clock at entry and exit, and the
process writes its stamps to `<dir>/<role>-<pid>.json` at exit. Nothing in the services changes;
without the variable this module does nothing.

CLOCK_MONOTONIC (`time.perf_counter` on Linux) is one clock for every process of a host, so the
stamps of the three services merge into one timeline.
"""

from __future__ import annotations

import os

# module -> [(class or None for a module function, function, label)]
STEP_PATH: dict[str, list[tuple[str | None, str, str]]] = {
    "services.scheduler.draft_link": [("DraftLink", "step", "s.step")],
    "services.draft.engine": [("DraftEngine", "step", "d.step"), ("DraftEngine", "_step", "d.inner"),
                              ("DraftEngine", "run_ahead", "d.ahead"), ("DraftEngine", "_trees_for", "d.trees"),
                              ("DraftEngine", "_draft", "d.draft"), (None, "_pack_trees", "d.pack")],
    "services.draft.proposer": [("DFlashProposer", "commit_many", "d.commit"),
                                ("DFlashProposer", "propose", "d.propose")],
    "services.draft.verifier_client": [("VerifierClient", "step", "d.verify")],
    "services.verifier.server": [("VerifierServicer", "_step", "v.step"), ("VerifierServicer", "_verify", "v.trees")],
    "services.verifier.engine": [("VerifierEngine", "verify", "v.engine"), ("VerifierEngine", "_check_trees", "v.check"),
                                 ("VerifierEngine", "_posterior", "v.posterior")],
    "services.verifier.graphs": [("VerifyGraphs", "run", "v.replay")],
    # the engine's work after the posterior (0.38 ms on an H100 host): the walk, then the KV commit
    "services.verifier.acceptance": [(None, "accept", "v.accept")],
    "services.verifier.kv_cache": [("PagedKVCache", "write_slots", "v.kv_write")],
    "services.common.grpc_server": [("IdleStreams", "next", "wait")],
    # every reader's `read` is TensorReader's (shm's calls it): one stamp pair a read, whatever the kind
    "services.common.transport": [("ShmWriter", "write", "ring.write"), ("InlineWriter", "write", "ring.write"),
                                  ("TensorReader", "read", "ring.read")],
    "services.common.cuda_ipc": [("CudaIpcWriter", "write", "ring.write")],
    "services.common.step_socket": [("StepSocketCall", "write", "sock.write"), ("StepSocketCall", "read", "sock.read")],
    # a host wait for the GPU inside the stamps above (a ring write's): what of a span is the GPU's
    "torch.cuda.streams": [("Stream", "synchronize", "cuda.sync")],
}

if os.environ.get("DDTREE_STEP_PROBE_DIR"):
    import atexit
    import functools
    import importlib.abc
    import inspect
    import json
    import sys
    import time

    _stamps: list[tuple[str, float]] = []
    _clock = time.perf_counter

    def _role() -> str:
        args = " ".join(sys.argv)
        return next((r for r in ("scheduler", "draft", "verifier") if r in args), "main")

    def _dump() -> None:
        path = os.path.join(os.environ["DDTREE_STEP_PROBE_DIR"], f"{_role()}-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({"argv": sys.argv, "stamps": _stamps}, f)

    atexit.register(_dump)

    def _stamped(f, label: str):
        if inspect.iscoroutinefunction(f):
            @functools.wraps(f)
            async def wrapper(*args, **kwargs):
                _stamps.append((label + ">", _clock()))
                try:
                    return await f(*args, **kwargs)
                finally:
                    _stamps.append((label + "<", _clock()))
        else:
            @functools.wraps(f)
            def wrapper(*args, **kwargs):
                _stamps.append((label + ">", _clock()))
                try:
                    return f(*args, **kwargs)
                finally:
                    _stamps.append((label + "<", _clock()))
        return wrapper

    def _patch(module, points) -> None:
        for cls_name, name, label in points:
            owner = module if cls_name is None else getattr(module, cls_name, None)
            f = getattr(owner, name, None) if cls_name is None else vars(owner or object).get(name)
            if f is None:   # renamed since the table was written: said, not fatal
                print(f"step probe: {module.__name__}.{cls_name or ''}.{name} not found", file=sys.stderr)
                continue
            setattr(owner, name, _stamped(f, label))

    class _Finder(importlib.abc.MetaPathFinder):
        """Patches a module of STEP_PATH as its import finishes."""

        def find_spec(self, fullname, path, target=None):
            if fullname not in STEP_PATH:
                return None
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
            else:
                return None
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module, STEP_PATH[fullname])

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
