"""Shared set-up for end-to-end tests: a random checkpoint, greedy references, an oracle drafter file,
stacks started side by side."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer

from services.common.auth import internal_token, token_metadata
from services.common.launcher import Stack, StackSpec
from services.common.make_checkpoint import make_random_checkpoint
from services.verifier.reference import ReferenceModel
from tests.selection import selected_names

PROMPTS = [
    "def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
    "for i in range(10):\n    print(i)", "def parse(text: str) -> dict:", "with open(path) as fh:",
    "if __name__ == '__main__':", "try:\n    import json\nexcept ImportError:", "return [x * 2 for x in",
    "async def fetch(url):", "    @property\n    def name(self):", "raise ValueError(f\"bad {value!r}\")",
    "from collections import defaultdict", "while queue:\n    node = queue.pop()", "lambda x, y: x + y",
    "self.assertEqual(result, expected)", "# Copyright 2024\n\"\"\"Utilities.\"\"\"", "def __repr__(self):",
    "yield from self._items", "assert isinstance(obj, int), obj",
]

GREEDY_TOKENS = 24


def build_checkpoint(root: Path) -> Path:
    return make_random_checkpoint(root / "ckpt", vocab_size=512, seed=0)


def greedy_references(ckpt: Path, prompts: list[str], n: int) -> dict[str, tuple[list[int], list[int]]]:
    """prompt -> (prompt ids, greedy continuation) from the float64 dense reference model."""
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    ref = ReferenceModel.load(ckpt)
    out = {}
    for p in prompts:
        ids = tok.encode(p, add_special_tokens=False).ids
        out[p] = (ids, ref.greedy(ids, n))
    return out


def write_oracle(path: Path, ckpt: Path, refs: dict[str, tuple[list[int], list[int]]], seed: int = 0) -> str:
    """An oracle drafter spec planting the reference continuations; returns the drafter_path value."""
    target = json.loads((ckpt / "config.json").read_text())
    drafter = json.loads((ckpt / "drafter" / "config.json").read_text())
    spec = {
        "vocab_size": target["vocab_size"], "hidden_size": target["hidden_size"],
        "block_size": drafter.get("block_size") or drafter["dflash_config"]["block_size"],
        "target_layer_ids": drafter["dflash_config"]["target_layer_ids"], "seed": seed,
        "continuations": [{"prompt": ids, "continuation": cont} for ids, cont in refs.values()],
    }
    path.write_text(json.dumps(spec))
    return f"oracle:{path}"


class StackStarts:
    """Stacks of one module started side by side when the module starts, each handed to its test.

    Starting a stack is mostly one process importing torch at a time (services start in order), so
    on two cores several stacks start in about the time of the slowest. The constructor starts each
    selected test's stack in a thread; ``take`` waits for it (re-raising a failed start's error) and stops it when the test is
    done, as ``with Stack(spec) as stack`` does; ``close`` stops whatever no test took.
    """

    def __init__(self, request, specs: dict[str, Callable[[], StackSpec]]) -> None:
        selected = selected_names(request)
        self._pool = ThreadPoolExecutor(max(1, len(specs)))
        self._stacks: dict[str, Stack] = {}
        self._starts: dict[str, Future] = {}
        for name, make_spec in specs.items():
            if name in selected:
                stack = self._stacks[name] = Stack(make_spec())
                self._starts[name] = self._pool.submit(stack.start)

    def started(self, name: str) -> Stack:
        """The test's stack once started; a start that failed raises its error here."""
        return self._starts[name].result()

    @contextlib.contextmanager
    def take(self, name: str, spec: StackSpec | None = None) -> Iterator[Stack]:
        """``with starts.take(test name) as stack``: the test's stack, stopped at the end. Without a
        start of its own (a selection the module did not see) ``spec``'s stack starts here."""
        if name in self._starts:
            stack = self._stacks.pop(name)
            try:
                yield self.started(name)
            finally:
                stack.stop()
        else:
            with Stack(spec) as stack:
                yield stack

    def close(self) -> None:
        for name, start in self._starts.items():
            try:
                start.result()
            except BaseException:  # noqa: BLE001 - a failed start has stopped its own services
                pass
        for stack in self._stacks.values():
            stack.stop()
        self._pool.shutdown()


def internal_metadata(stack: Stack) -> tuple[tuple[str, str], ...]:
    """What a test's own call to the stack's draft or verifier presents: the launch's internal token."""
    return token_metadata(internal_token(stack.services[0].env))
