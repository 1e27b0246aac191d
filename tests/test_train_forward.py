"""The training forwards of train/modeling.py agree with the serving models on the same weights.

Why: the demo pair is trained with batched, dense-expert, multi-anchor forwards and saved under
HF names; if those forwards drifted from ``ReferenceModel`` / ``DFlashDrafter`` the shipped
checkpoints would be trained for a different model than the one served.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.common.checkpoint import load_tensors
from services.common.int4 import pack_int4, unpack_int4
from services.draft.dflash import DFlashDrafter
from services.draft.make_drafter import write_random_drafter
from services.verifier.model import load_checkpoint
from services.verifier.make_target import write_random_target
from services.verifier.reference import ReferenceModel
from train.modeling import KVCache, TrainDrafter, TrainTarget, fake_int4

VOCAB = 96


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("train_target")
    write_random_target(d, VOCAB, seed=3)
    return d


def test_fake_int4_matches_pack_unpack() -> None:
    w = torch.randn(3, 16, 64) * 0.05
    fq = fake_int4(w)
    for e in range(3):
        q = pack_int4(w[e], group_size=32, scale_dtype=torch.bfloat16)
        assert torch.equal(fq[e], unpack_int4(q.packed, q.scale, q.shape, 32, dtype=torch.float32))


def test_fake_int4_is_straight_through() -> None:
    w = torch.randn(8, 32, requires_grad=True)
    fake_int4(w).sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_target_forward_matches_reference(target_dir: Path) -> None:
    config, weights = load_checkpoint(target_dir)
    model = TrainTarget.from_hf(config, weights).double().eval()
    ref = ReferenceModel(config, weights)
    ids = torch.randint(0, VOCAB, (1, 23), generator=torch.Generator().manual_seed(0))
    layers = [0, 1, config.num_hidden_layers - 1]
    with torch.no_grad():
        logits, feats = model(ids, feature_layers=layers)
    ref_logits, hidden = ref.forward(ids[0])
    torch.testing.assert_close(logits[0], ref_logits, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(feats[0], torch.cat([hidden[i + 1] for i in layers], dim=-1), rtol=1e-9, atol=1e-9)


def test_hf_weights_round_trip(target_dir: Path) -> None:
    config, weights = load_checkpoint(target_dir)
    out = TrainTarget.from_hf(config, weights).hf_weights(int4=True)
    assert set(out) == set(weights)
    for name, t in weights.items():
        assert out[name].dtype == t.dtype, name
        assert torch.equal(out[name], t), name


def test_greedy_with_cache_matches_reference(target_dir: Path) -> None:
    config, weights = load_checkpoint(target_dir)
    model = TrainTarget.from_hf(config, weights).double().eval()
    prompt = [5, 17, 3, 60, 2, 2, 41]
    got = model.greedy(torch.tensor([prompt, prompt]), 12)
    want = ReferenceModel(config, weights).greedy(prompt, 12)
    assert got[0].tolist() == want and got[1].tolist() == want
    cache = KVCache(config.num_hidden_layers, capacity=len(prompt) + 1)
    model(torch.tensor([prompt]), cache)
    assert cache.length == len(prompt)
    model(torch.tensor([[7]]), cache)
    assert cache.length == len(prompt) + 1
    with pytest.raises(ValueError, match="cannot take"):  # written in place: no silent growth past its buffers
        model(torch.tensor([[7]]), cache)


def test_drafter_forward_matches_dflash(tmp_path: Path, target_dir: Path) -> None:
    tcfg = json.loads((target_dir / "config.json").read_text())
    dcfg = write_random_drafter(tmp_path / "drafter", tcfg, block_size=6, num_layers=2, seed=4,
                                target_layer_ids=[0, 2], mask_token_id=VOCAB - 1)
    drafter = DFlashDrafter.load(tmp_path / "drafter", target_dir)
    tw = load_tensors(target_dir, names=["model.embed_tokens.weight", "lm_head.weight"])
    train = TrainDrafter.from_hf(dcfg, load_tensors(tmp_path / "drafter"), tw["model.embed_tokens.weight"],
                                 tw["lm_head.weight"]).eval()
    g = torch.Generator().manual_seed(1)
    S = 30
    feats = torch.randn(1, S, 2 * tcfg["hidden_size"], generator=g)
    tokens = torch.randint(0, VOCAB - 1, (1, S), generator=g)
    anchors = torch.tensor([[1, 9, 17, 24]])
    with torch.no_grad():
        got = torch.log_softmax(train(feats, tokens, anchors), dim=-1)  # [1, K, 5, V]
    for k, L in enumerate(anchors[0].tolist()):
        ctx = drafter.new_context()
        drafter.extend_context(ctx, feats[0, :L])
        want = torch.log_softmax(drafter.propose([ctx], tokens[0, L:L + 1]), dim=-1)  # [1, 5, V]
        torch.testing.assert_close(got[0, k], want[0], rtol=1e-4, atol=1e-4)
