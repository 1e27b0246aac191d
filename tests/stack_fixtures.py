"""Shared set-up for end-to-end tests: a random checkpoint, greedy references, an oracle drafter file."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from services.common.make_checkpoint import make_random_checkpoint
from services.verifier.reference import ReferenceModel

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
