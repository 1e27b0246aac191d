"""The bundled demo pair in models/demo: format, size, and real, lossless acceptance (CPU, seconds).

Why: `make up` serves this pair out of the box and the acceptance figures in BENCHMARKS.md come
from it; a retrained or re-exported checkpoint that broke TP divisibility, the INT4 layout, the
size budget, or the drafter's usefulness should fail here, not in a demo.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from services.common.checkpoint import tensor_index
from services.common.tokenizer_train import EOS_TOKEN, MASK_TOKEN
from services.draft.config import DraftConfig
from services.verifier.config import TargetConfig
from services.verifier.sampling import Sampling

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo"
MAX_BYTES = 30 * 10**6


@pytest.fixture(scope="module")
def target_config() -> TargetConfig:
    return TargetConfig.from_hf(json.loads((DEMO / "config.json").read_text()))


def test_target_config_is_tp8_ready_deepseek_v3_with_int4_experts(target_config: TargetConfig) -> None:
    c = target_config
    assert c.model_type == "deepseek_v3"
    assert c.num_attention_heads % 8 == 0 and (c.n_routed_experts or 0) % 8 == 0
    assert c.first_k_dense_replace >= 1 and c.num_hidden_layers - c.first_k_dense_replace >= 3
    assert c.n_shared_experts >= 1 and c.n_group > 1 and c.topk_group < c.n_group
    assert c.quantization is not None and c.quantization.group_size == 32
    index = tensor_index(DEMO)
    moe = c.first_k_dense_replace
    assert f"model.layers.{moe}.mlp.experts.0.gate_proj.weight_packed" in index
    assert f"model.layers.{moe}.mlp.experts.0.gate_proj.weight" not in index
    assert f"model.layers.{moe}.mlp.shared_experts.gate_proj.weight" in index


def test_drafter_and_tokenizer_match_the_target(target_config: TargetConfig) -> None:
    d = DraftConfig.from_hf(json.loads((DEMO / "drafter" / "config.json").read_text()))
    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    assert d.block_size == 16
    assert d.hidden_size == target_config.hidden_size and d.vocab_size == target_config.vocab_size
    assert max(d.target_layer_ids) < target_config.num_hidden_layers
    assert d.mask_token_id == tok.token_to_id(MASK_TOKEN)
    assert target_config.eos_token_id == (tok.token_to_id(EOS_TOKEN),)
    assert tok.get_vocab_size() == target_config.vocab_size
    text = "def fibonacci(n):\n    return n\n"
    assert tok.decode(tok.encode(text).ids) == text


def test_checkpoint_stays_small() -> None:
    total = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert total < MAX_BYTES, f"models/demo holds {total / 1e6:.1f} MB (budget {MAX_BYTES / 1e6:.0f} MB)"


def test_greedy_ddtree_equals_autoregressive_with_real_acceptance() -> None:
    from train.eval_acceptance import DemoDecoder

    torch.manual_seed(0)
    prompts = json.loads((DEMO / "heldout_prompts.json").read_text())["prompts"][:2]
    dec = DemoDecoder(DEMO)
    greedy = Sampling(temperature=0.0)
    accs: list[int] = []
    # The demo's ops are tiny: intra-op threads only add synchronisation (10x slower on a busy host).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for p in prompts:
            ar = dec.generate(p["ids"], 48, 0, greedy)
            dd = dec.generate(p["ids"], 48, 16, greedy)
            assert dd.tokens == ar.tokens, f"DDTree output differs from autoregressive on held-out prompt {p['path']}"
            accs.extend(dd.acceptance)
    finally:
        torch.set_num_threads(threads)
    mean = sum(accs) / len(accs)
    assert mean > 1.5, f"mean acceptance {mean:.2f} at budget 16: the drafter is not helping"


def test_acceptance_counts_the_tokens_the_output_keeps() -> None:
    """A verify step that accepts a path through an EOS gives the output the tokens up to it; the
    steps after it and the tokens past it were counted (1-9% more acceptance on the demo pair
    than the server's usage counts), and the last step's past max_new too."""
    from train.eval_acceptance import DemoDecoder

    prompt = json.loads((DEMO / "heldout_prompts.json").read_text())["prompts"][0]["ids"]
    dec = DemoDecoder(DEMO)
    greedy = Sampling(temperature=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full = dec.generate(prompt, 40, 16, greedy)
        assert sum(full.acceptance) == len(full.tokens) - 1 == 39   # the first token is the prefill's
        # An EOS the trees accept inside a path: not a step's last token, its first occurrence.
        ends = set(itertools.accumulate(full.acceptance))   # tokens[0] is the prefill's
        inside = next(i for i in range(1, len(full.tokens))
                      if i not in ends and full.tokens.index(full.tokens[i]) == i)
        dec.eos = {full.tokens[inside]}
        ar, dd = dec.generate(prompt, 40, 0, greedy), dec.generate(prompt, 40, 16, greedy)
    finally:
        torch.set_num_threads(threads)
    assert ar.tokens == dd.tokens == full.tokens[:inside + 1]
    assert sum(dd.acceptance) == len(dd.tokens) - 1   # the EOS step counts the tokens up to it, no step follows
