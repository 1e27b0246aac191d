"""A checkpoint laid out as Kimi-K2.5 ships one, served end to end by `ddtree up`'s launcher.

The demo pair rewritten in that layout: a `kimi_k25` config wrapping the target in `text_config`,
its tensors under `language_model.` beside a vision tensor, and a tiktoken tokenizer
(`tiktoken.model` + `tokenizer_config.json`, no `tokenizer.json`). Each part has its own unit test;
this one checks that the services find them together: the launcher points the scheduler at the
tiktoken tokenizer, the verifier and the draft load the wrapped target, and a text prompt is
encoded by the converted tokenizer and answered.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tiktoken

from services.common.launcher import Stack, StackSpec
from services.scheduler.client import Client
from services.common.tiktoken_model import KIMI_PATTERN
from tests.test_checkpoint import wrap_as_kimi_k25
from tests.test_tiktoken_model import demo_ranks, write_ranks

DEMO = Path("models/demo")


def test_a_kimi_k25_layout_with_a_tiktoken_tokenizer_serves_text(tmp_path) -> None:
    model = tmp_path / "k25"
    wrap_as_kimi_k25(DEMO, model)
    shutil.copytree(DEMO / "drafter", model / "drafter")
    ranks = demo_ranks()   # 4094 ranks; the demo's vocabulary of 4096 leaves two special ids
    write_ranks(model / "tiktoken.model", ranks)
    (model / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        str(len(ranks)): {"content": "[BOS]", "special": True}, str(len(ranks) + 1): {"content": "[EOS]", "special": True}}}))
    prompt = "def fibonacci(n):\n    [BOS]"
    want = tiktoken.Encoding("k", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"[BOS]": len(ranks), "[EOS]": len(ranks) + 1}).encode(
        prompt, allowed_special="all")
    stack = Stack(StackSpec(model_path=str(model), scheduler_port=0, startup_timeout_s=240))
    assert stack._plan()[-1].env["DDTREE_SCHEDULER_TOKENIZER_PATH"] == str(model)
    stack.start()
    try:
        with Client(stack.scheduler_address) as client:
            out = client.generate(prompt, max_tokens=8, budget=8, ignore_eos=True)
    finally:
        stack.stop()
    assert out.prompt_tokens == len(want) and want[-1] == len(ranks)   # "[BOS]" as its special id
    assert len(out.token_ids) == 8 and out.text
