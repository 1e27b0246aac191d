"""DFlash drafter: cache consistency, batching, an independent reference forward, load errors,
and the demo tokenizer trainer."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.common.checkpoint import CheckpointError, load_tensors
from services.common.tokenizer_train import default_corpus_files, train_tokenizer
from services.draft.config import check_pairing
from services.draft.dflash import DFlashDrafter, _Rope, check_drafter_checkpoint
from services.draft.make_drafter import write_random_drafter
from services.draft.propose_graphs import COMMIT_BUCKETS, context_buckets
from services.draft.proposer import DFlashProposer, load_proposer

HIDDEN, VOCAB, TARGET_LAYERS = 64, 300, 4
LAYER_IDS = [0, 2, 3]
BLOCK = 6


def write_fake_target(path: Path, hidden: int = HIDDEN, vocab: int = VOCAB, layers: int = TARGET_LAYERS) -> dict:
    """A target checkpoint holding only what the drafter reads: config + embedding + lm_head."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": layers, "max_position_embeddings": 512}
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(123)
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen),
            "lm_head.weight": torch.randn(vocab, hidden, generator=gen) / hidden**0.5,
        },
        str(path / "model.safetensors"),
    )
    return cfg


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dflash")
    tcfg = write_fake_target(root / "target")
    write_random_drafter(root / "drafter", tcfg, block_size=BLOCK, num_layers=2, seed=1, target_layer_ids=LAYER_IDS)
    return root / "drafter", root / "target"


@pytest.fixture(scope="module")
def drafter(pair: tuple[Path, Path]) -> DFlashDrafter:
    return DFlashDrafter.load(pair[0], pair[1])


def _features(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, len(LAYER_IDS) * HIDDEN, generator=gen)  # [n, 3*hidden]


def test_incremental_extend_matches_single_extend(drafter: DFlashDrafter) -> None:
    feats = _features(13, 0)
    whole = drafter.new_context()
    drafter.extend_context(whole, feats)
    chunked = drafter.new_context()
    for chunk in (feats[:5], feats[5:6], feats[6:]):
        drafter.extend_context(chunked, chunk)
    assert whole.length == chunked.length == 13
    for layer in range(drafter.config.num_hidden_layers):
        for a, b in zip(whole.layer_kv(layer), chunked.layer_kv(layer)):
            torch.testing.assert_close(a, b)
    bonus = torch.tensor([7])
    torch.testing.assert_close(drafter.propose([whole], bonus), drafter.propose([chunked], bonus))


def test_a_batched_eager_extend_equals_each_context_extended_alone(drafter: DFlashDrafter) -> None:
    """Several commits in one eager call (the CPU path; on a GPU, a context past its pool row or a
    batch no bucket holds): each context takes its own features' keys and values."""
    feats = [_features(3, 40), _features(5, 41), _features(2, 42)]
    batched = [drafter.new_context() for _ in feats]
    drafter.extend_contexts(batched, feats)
    for f, ctx in zip(feats, batched):
        alone = drafter.new_context()
        drafter.extend_context(alone, f)
        assert ctx.length == alone.length == len(f)
        for layer in range(drafter.config.num_hidden_layers):
            for a, b in zip(ctx.layer_kv(layer), alone.layer_kv(layer)):
                torch.testing.assert_close(a, b)


def test_batched_propose_equals_each_alone(drafter: DFlashDrafter) -> None:
    lengths = [3, 11, 1]
    ctxs = []
    for i, n in enumerate(lengths):
        ctx = drafter.new_context()
        drafter.extend_context(ctx, _features(n, 10 + i))
        ctxs.append(ctx)
    bonus = torch.tensor([5, 17, 250])
    batched = drafter.propose(ctxs, bonus)
    assert batched.shape == (3, BLOCK - 1, VOCAB) and batched.dtype == torch.float32
    for r, ctx in enumerate(ctxs):
        alone = drafter.propose([ctx], bonus[r : r + 1])
        torch.testing.assert_close(batched[r : r + 1], alone, atol=1e-5, rtol=1e-5)
    # Logits (the tree builder normalises): the draft's LM head as it is, not a log-softmax.
    assert not torch.allclose(batched.exp().sum(-1), torch.ones(3, BLOCK - 1), atol=1e-2)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope_pairs(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate each pair (i, i + d/2) of x [T, heads, d] by angle pos * theta^(-2i/d)."""
    d = x.shape[-1]
    half = d // 2
    out = x.clone()
    for i in range(half):
        ang = pos.to(x.dtype) * theta ** (-2.0 * i / d)  # [T]
        c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]  # [T, 1]
        a, b = x[..., i], x[..., i + half]  # [T, heads]
        out[..., i] = a * c - b * s
        out[..., i + half] = b * c + a * s
    return out


def reference_propose(
    drafter_dir: Path, target_dir: Path, features: torch.Tensor, bonus: int
) -> torch.Tensor:
    """Straightforward float64 DFlash forward from the checkpoint files: no cache, no batching."""
    cfg = json.loads((drafter_dir / "config.json").read_text())
    w = {k: v.double() for k, v in load_tensors(drafter_dir).items()}
    t = {k: v.double() for k, v in load_tensors(target_dir).items()}
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta, B = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["block_size"]
    mask_id = cfg["dflash_config"]["mask_token_id"]
    L = features.shape[0]
    ctx = _rms(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [L, hidden]
    x = t["model.embed_tokens.weight"][torch.tensor([bonus] + [mask_id] * (B - 1))]  # [B, hidden]
    ctx_pos, blk_pos = torch.arange(L), torch.arange(L, L + B)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rms((h @ w[p + "self_attn.q_proj.weight"].T).view(B, H, hd), w[p + "self_attn.q_norm.weight"], eps)
        q = _rope_pairs(q, blk_pos, theta)
        k_in = torch.cat([ctx, h])  # [L+B, hidden]
        k = (k_in @ w[p + "self_attn.k_proj.weight"].T).view(L + B, KV, hd)
        k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        k = _rope_pairs(k, torch.cat([ctx_pos, blk_pos]), theta)
        v = (k_in @ w[p + "self_attn.v_proj.weight"].T).view(L + B, KV, hd)
        heads = []
        for head in range(H):
            kv_head = head // (H // KV)
            scores = q[:, head] @ k[:, kv_head].T / math.sqrt(hd)  # [B, L+B], non-causal
            heads.append(torch.softmax(scores, -1) @ v[:, kv_head])  # [B, hd]
        x = x + torch.cat(heads, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["norm.weight"], eps)
    return torch.log_softmax(x[1:] @ t["lm_head.weight"].T, -1)  # [B-1, V]


def test_propose_matches_independent_reference(drafter: DFlashDrafter, pair: tuple[Path, Path]) -> None:
    feats = [_features(n, 20 + n) for n in (9, 4)]
    ctxs = []
    for f in feats:
        ctx = drafter.new_context()
        drafter.extend_context(ctx, f[:2])
        drafter.extend_context(ctx, f[2:])
        ctxs.append(ctx)
    bonus = [3, 42]
    got = torch.log_softmax(drafter.propose(ctxs, torch.tensor(bonus)), dim=-1)   # propose gives logits
    for r in range(2):
        ref = reference_propose(pair[0], pair[1], feats[r], bonus[r])
        torch.testing.assert_close(got[r].double(), ref, atol=1e-5, rtol=1e-5)
    # Non-trivial distribution (not uniform), so the comparison means something.
    assert got.max() > -math.log(VOCAB) + 0.5


def _rewrite_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_load_errors_name_the_field(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    drafter_dir, target_dir = pair
    narrow = tmp_path / "narrow_target"
    write_fake_target(narrow, hidden=32)
    with pytest.raises(CheckpointError, match="hidden_size"):
        DFlashDrafter.load(drafter_dir, narrow)

    small_vocab = tmp_path / "small_vocab_target"
    write_fake_target(small_vocab, vocab=200)
    with pytest.raises(CheckpointError, match="vocab_size"):
        DFlashDrafter.load(drafter_dir, small_vocab)

    deep = dict(hidden_size=HIDDEN, vocab_size=VOCAB, num_hidden_layers=8)
    bad_ids = tmp_path / "bad_ids"
    write_random_drafter(bad_ids, deep, block_size=4, num_layers=1, target_layer_ids=[1, 6])
    with pytest.raises(CheckpointError, match="target_layer_ids"):
        DFlashDrafter.load(bad_ids, target_dir)

    bad_mask = tmp_path / "bad_mask"
    write_random_drafter(bad_mask, dict(deep, num_hidden_layers=TARGET_LAYERS), block_size=4, num_layers=1)
    _rewrite_config(bad_mask, dflash_config={"mask_token_id": VOCAB, "target_layer_ids": [0]})
    with pytest.raises(CheckpointError, match="mask_token_id"):
        DFlashDrafter.load(bad_mask, target_dir)

    no_block = tmp_path / "no_block"
    write_random_drafter(no_block, dict(deep, num_hidden_layers=TARGET_LAYERS), block_size=4, num_layers=1)
    _rewrite_config(no_block, block_size=None)
    with pytest.raises(CheckpointError, match="block_size"):
        DFlashDrafter.load(no_block, target_dir)
    _rewrite_config(no_block, block_size=4, architectures=1)   # a TypeError traceback, before
    with pytest.raises(CheckpointError, match="field 'architectures' is 1"):
        DFlashDrafter.load(no_block, target_dir)

    # A block as long as the target's context: no prompt fits beside one tree, and the stack
    # served, refusing every request ("-1 prompt tokens at most").
    short = tmp_path / "short_context"
    cfg = write_fake_target(short)
    (short / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=BLOCK + 1)))
    with pytest.raises(CheckpointError, match=f"'block_size' = {BLOCK} leaves no room for a prompt .* need {BLOCK + 2}"):
        check_pairing(drafter_dir, short)
    (short / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=BLOCK + 2)))
    check_pairing(drafter_dir, short)


def test_every_stored_drafter_tensor_is_read_and_a_float(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    """A layer past the config's, q/k/v biases, or FP8 projections (their scales dropped) loaded
    without a word and drafted garbage; the drafter's copies of the target's embedding and output
    projection stay allowed (the target's are used)."""
    from services.common.checkpoint import load_tensors, save_tensors
    drafter_dir, target_dir = pair
    base = load_tensors(drafter_dir)
    for name, change, needle in (
            ("layers", lambda w: w.update({"layers.9.input_layernorm.weight": torch.ones(HIDDEN)}),
             r"tensor 'layers\.9\.input_layernorm\.weight' is not one its config\.json implies"),
            ("bias", lambda w: w.update({"layers.0.self_attn.q_proj.bias": torch.zeros(4)}), r"q_proj\.bias"),
            ("fp8", lambda w: w.update({"fc.weight": w["fc.weight"].to(torch.float8_e4m3fn)}), "float8_e4m3fn"),
            ("shared", lambda w: w.update({"lm_head.weight": torch.zeros(VOCAB, HIDDEN)}), None),
            ("rotary", lambda w: w.update({"rotary_emb.inv_freq": torch.ones(4)}), None)):   # a saved buffer
        d = tmp_path / name
        shutil.copytree(drafter_dir, d)
        weights = dict(base)
        change(weights)
        save_tensors(d, weights)
        if needle is None:
            DFlashDrafter.load(d, target_dir)
            check_drafter_checkpoint(d, target_dir)
        else:
            with pytest.raises(CheckpointError, match=needle):
                DFlashDrafter.load(d, target_dir)
            with pytest.raises(CheckpointError, match=needle):   # from the headers alone, as a launcher checks
                check_drafter_checkpoint(d, target_dir)


def test_a_drafter_that_does_not_fit_is_refused_from_its_headers_before_any_service_starts(
        tmp_path: Path, pair: tuple[Path, Path]) -> None:
    """A drafter tensor missing, of another shape or in a shard that is missing was found only when
    the draft loaded it, which `ddtree up` starts after the verifier has loaded and warmed up
    (minutes on a large target). The files' headers say it before anything starts."""
    from services.common.checkpoint import save_tensors
    from services.common.launcher import _check_before_start
    from services.common.settings import DraftSettings, SettingsError, VerifierSettings
    drafter_dir, target_dir = pair
    base = load_tensors(drafter_dir)
    for name, change, needle in (
            ("shape", lambda w: w.update({"fc.weight": w["fc.weight"][:, :-1]}), r"tensor 'fc\.weight' has shape .*, expected"),
            ("missing", lambda w: w.pop("norm.weight"), r"missing tensor 'norm\.weight'"),
            ("prefixed", lambda w: w.update({f"model.{k}": w.pop(k) for k in list(w)}), None)):
        d = tmp_path / name
        shutil.copytree(drafter_dir, d)
        weights = dict(base)
        change(weights)
        save_tensors(d, weights)
        settings = DraftSettings(drafter_path=str(d), target_path=str(target_dir), metrics_port=0)
        if needle is None:
            assert check_drafter_checkpoint(d, target_dir).hidden_size == HIDDEN
            _check_before_start("draft", settings)
        else:
            with pytest.raises(SettingsError, match=rf"^draft\.drafter_path: {re.escape(str(d))}: drafter weights: {needle}"):
                _check_before_start("draft", settings)
    shards = tmp_path / "shards"
    save_tensors(shards, base, max_shard_bytes=4096)
    shutil.copy(drafter_dir / "config.json", shards / "config.json")
    check_drafter_checkpoint(shards, target_dir)
    next(shards.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(shards))}: shard file model-00002-of-\d+\.safetensors "
                                              r".* is missing"):   # the path once
        check_drafter_checkpoint(shards, target_dir)
    for setting, settings in (
            ("verifier.model_path", VerifierSettings(model_path=str(tmp_path / "none"), metrics_port=0)),
            ("draft.target_path", DraftSettings(drafter_path=str(drafter_dir), target_path=str(tmp_path / "none"),
                                                metrics_port=0)),
            ("draft.drafter_path", DraftSettings(drafter_path=str(tmp_path / "none"), target_path=str(target_dir),
                                                 metrics_port=0))):
        role = setting.split(".")[0]   # a checkpoint missing is named by its own setting
        with pytest.raises(SettingsError, match=rf"^{re.escape(setting)}: no checkpoint at "):
            _check_before_start(role, settings)


def test_block_size_inside_dflash_config(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    d = tmp_path / "nested"
    tcfg = dict(hidden_size=HIDDEN, vocab_size=VOCAB, num_hidden_layers=TARGET_LAYERS)
    write_random_drafter(d, tcfg, block_size=4, num_layers=1)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    (d / "config.json").write_text(json.dumps(cfg))
    loaded = DFlashDrafter.load(d, pair[1])
    assert loaded.block_size == 4
    ctx = loaded.new_context()
    loaded.extend_context(ctx, torch.randn(2, loaded.config.num_features))
    assert loaded.propose([ctx], torch.tensor([1])).shape == (1, 3, VOCAB)


def test_tokenizer_roundtrip(tmp_path: Path) -> None:
    files = default_corpus_files(limit=6)
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    tok = train_tokenizer(tmp_path, files, 400)
    assert (tmp_path / "tokenizer.json").is_file()
    assert tok.get_vocab_size() <= 400
    for special in ("<|eos|>", "<|mask|>"):
        tid = tok.token_to_id(special)
        assert tid is not None and tid < tok.get_vocab_size()
    snippet = "def add(a, b):\n    \"\"\"Sum é.\"\"\"\n\treturn a  +  b  # ok\n\n"
    ids = tok.encode(snippet).ids
    assert len(ids) < len(snippet.encode())  # merges were learned and used
    assert tok.decode(ids) == snippet


def test_proposer_warm_up_runs_its_shapes_and_keeps_no_context(drafter: DFlashDrafter) -> None:
    calls: list[tuple[int, int]] = []
    proposer = DFlashProposer(drafter)
    real = drafter.propose

    def spy(ctxs, bonus):
        calls.append((len(ctxs), ctxs[0].length))
        return real(ctxs, bonus)

    drafter.propose = spy
    try:
        proposer.warm_up([1, 3], [5, 40])
    finally:
        del drafter.propose
    assert calls == [(1, 5), (3, 5), (1, 40), (3, 40)]
    assert proposer._ctx == {}


def _graph_drafter(pair: tuple[Path, Path], rows: int, context: int) -> DFlashDrafter:
    d = DFlashDrafter.load(pair[0], pair[1])
    d.enable_graphs(rows, context, capture=False)   # the pooled, padded forward the GPU captures
    return d


def test_pooled_propose_equals_eager(pair: tuple[Path, Path]) -> None:
    eager = DFlashDrafter.load(pair[0], pair[1])
    pooled = _graph_drafter(pair, rows=4, context=128)
    lengths = [3, 70, 1]   # two context buckets; the batch of 3 pads to the bucket of 4
    e_ctx, p_ctx, tails = [], [], []
    for i, n in enumerate(lengths):
        feats = _features(n, 30 + i)
        for d, out in ((eager, e_ctx), (pooled, p_ctx)):
            ctx = d.new_context()
            d.extend_context(ctx, feats[: n // 2])   # appends land in the pool row
            out.append(ctx)
        eager.extend_context(e_ctx[-1], feats[n // 2 :])
        tails.append(feats[n // 2 :])
    pooled.extend_contexts(p_ctx, tails)   # one batched commit (36 tokens: padded to the 64 bucket)
    assert [c.row for c in p_ctx] == [0, 1, 2] and all(c.row is None for c in e_ctx)
    for e, p in zip(e_ctx, p_ctx):   # the commit scattered each token's keys into its row
        assert p.length == e.length
        torch.testing.assert_close(p.keys[:, : p.length], e.keys[:, : e.length], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(p.values[:, : p.length], e.values[:, : e.length], atol=1e-6, rtol=1e-6)
    assert pooled.graphs.free_rows == 1
    bonus = torch.tensor([5, 17, 250])
    want = eager.propose(e_ctx, bonus)
    got = pooled.propose(p_ctx, bonus).clone()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Every row matches its request alone: padding rows and padding keys change nothing.
    for r in range(3):
        torch.testing.assert_close(pooled.propose([p_ctx[r]], bonus[r : r + 1]), want[r : r + 1],
                                   atol=1e-5, rtol=1e-5)


def test_a_pool_of_rows_shorter_than_one_context_bucket_proposes_as_eager(pair: tuple[Path, Path]) -> None:
    """Rows of 48 tokens: the context buckets stop at the row (a bucket of 64 keys over 48-token rows
    failed the forward with a shape error)."""
    assert context_buckets(48) == (48,) and context_buckets(64) == (64,)
    eager, pooled = DFlashDrafter.load(pair[0], pair[1]), _graph_drafter(pair, rows=2, context=48)
    e_ctx, p_ctx = [], []
    for i, n in enumerate((5, 40)):
        for d, out in ((eager, e_ctx), (pooled, p_ctx)):
            out.append(d.new_context())
            d.extend_context(out[-1], _features(n, 60 + i))
    assert [c.row for c in p_ctx] == [0, 1]
    bonus = torch.tensor([3, 11])
    torch.testing.assert_close(pooled.propose(p_ctx, bonus).clone(), eager.propose(e_ctx, bonus), atol=1e-5, rtol=1e-5)


def test_a_pool_row_given_to_a_new_request_takes_no_commit_of_the_old_one(pair: tuple[Path, Path]) -> None:
    """A commit's padding slots go to the scratch row: left as the last commit of that bucket had
    them, they wrote the released request's keys into the new owner's positions of the same row."""
    eager = DFlashDrafter.load(pair[0], pair[1])
    pooled = _graph_drafter(pair, rows=2, context=64)
    old = pooled.new_context()
    pooled.extend_contexts([old], [_features(10, 50)])
    pooled.release_context(old)
    new, alone = pooled.new_context(), eager.new_context()
    assert new.row == 0
    for feats in (_features(3, 51), _features(2, 52)):   # commits of the same bucket, shorter than the old one's
        pooled.extend_contexts([new], [feats])
        eager.extend_context(alone, feats)
    assert new.length == alone.length == 5
    torch.testing.assert_close(new.keys[:, :5], alone.keys[:, :5], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new.values[:, :5], alone.values[:, :5], atol=1e-6, rtol=1e-6)


def test_pool_rows_released_and_outgrown_contexts_move_out(pair: tuple[Path, Path]) -> None:
    pooled = _graph_drafter(pair, rows=2, context=64)
    proposer = DFlashProposer(pooled)
    proposer.start("a", [1])
    proposer.start("b", [1])
    proposer.start("c", [1])   # no free row: keeps its own storage
    rows = {rid: ctx.row for rid, ctx in proposer._ctx.items()}
    assert rows == {"a": 0, "b": 1, "c": None}
    proposer.drop("a")
    assert pooled.graphs.free_rows == 1
    proposer.drop("a")   # a second release of the same request frees nothing twice, and holds nothing
    assert pooled.graphs.free_rows == 1 and "a" not in proposer._ctx
    free_row = pooled.graphs._free[-1]
    with pytest.raises(AssertionError, match="released twice"):   # the pool itself refuses it: two owners
        pooled.graphs.release(free_row)                            # would share the row later
    assert pooled.graphs.free_rows == 1
    proposer.start("d", [1])
    assert proposer._ctx["d"].row == 0   # the freed row is handed out again
    # "b" grows past its row's 64 tokens: it moves to its own storage, keeps its keys, frees the row.
    b = proposer._ctx["b"]
    feats = _features(70, 7)
    proposer.commit("b", list(range(40)), feats[:40])
    before = b.keys[:, :40].clone()
    proposer.commit("b", list(range(30)), feats[40:])
    assert b.row is None and b.length == 70 and pooled.graphs.free_rows == 1
    torch.testing.assert_close(b.keys[:, :40], before)
    # A mixed batch (pooled and own storage) proposes eagerly and equals the unpooled drafter.
    plain = DFlashDrafter.load(pair[0], pair[1])
    ref = plain.new_context()
    plain.extend_context(ref, feats)
    bonus = torch.tensor([9, 9])
    out = proposer.propose(["b", "d"], bonus)
    torch.testing.assert_close(out[:1], plain.propose([ref], bonus[:1]), atol=1e-5, rtol=1e-5)


def test_a_pooled_drafter_commits_a_prompt_longer_than_the_largest_commit_bucket(pair: tuple[Path, Path]) -> None:
    """A long prompt's first commit (past the largest commit bucket) takes the eager path rather than raising."""
    pooled = _graph_drafter(pair, rows=1, context=64)
    ctx = pooled.new_context()
    n = COMMIT_BUCKETS[-1] + 1
    pooled.extend_contexts([ctx], [_features(n, 5)])
    assert ctx.length == n and ctx.row is None   # outgrew its pool row: moved to its own storage
    assert pooled.graphs.free_rows == 1


def test_pool_warm_up_gives_back_its_rows(pair: tuple[Path, Path]) -> None:
    pooled = _graph_drafter(pair, rows=3, context=200)
    DFlashProposer(pooled).warm_up([1, 3], [5, 40])
    assert pooled.graphs.free_rows == 3
    assert pooled.graphs.batch_buckets == (1, 2, 3)
    assert context_buckets(200) == (64, 128, 192, 200)
    assert context_buckets(2048) == (64, 128, 192, 256, 384, 576, 832, 1216, 1792, 2048)
    assert pooled.graphs.bucket_for(3, 201) is None and pooled.graphs.bucket_for(4, 10) is None


def test_a_reused_pool_row_carries_nothing_over(pair: tuple[Path, Path]) -> None:
    pooled = _graph_drafter(pair, rows=1, context=64)
    a = pooled.new_context()
    feats = _features(20, 3)
    feats[7] = float("nan")   # a request whose features went bad
    pooled.extend_context(a, feats)
    pooled.release_context(a)
    b = pooled.new_context()   # the same row
    assert b.row == 0   # the row the bad request had
    pooled.extend_context(b, _features(5, 4))
    out = pooled.propose([b], torch.tensor([9]))
    assert torch.isfinite(out).all()
    plain = DFlashDrafter.load(pair[0], pair[1])
    ref = plain.new_context()
    plain.extend_context(ref, _features(5, 4))
    torch.testing.assert_close(out, plain.propose([ref], torch.tensor([9])), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,per_row", [(8, 2, False), (4, 4, False), (6, 1, False), (8, 2, True),
                                                   (6, 3, True)])
def test_grouped_attention_is_attention_over_repeated_kv_heads(heads: int, kv_heads: int, per_row: bool) -> None:
    """Stacking the query heads of a KV head as its rows is the attention of each query head over
    its KV head repeated (what the drafter computed before), masked keys out, in float64; with one
    mask for all of a request's rows (serving) or a mask a row (training's blocks)."""
    from services.draft.dflash import grouped_attention

    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    R, B, L, hd = 3, 5, 11, 8
    q = torch.randn(R, B, heads, hd, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(R, L, kv_heads, hd, generator=gen, dtype=torch.float64) for _ in range(2))
    if per_row:   # random, every row attending at least one key
        mask = (torch.rand(R, 1, B, L, generator=gen) < 0.5) | (torch.arange(L) == torch.arange(B)[:, None])
    else:
        mask = (torch.arange(L)[None, :] < torch.tensor([4, 11, 7])[:, None])[:, None, None, :]
    groups = heads // kv_heads
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(groups, dim=2).transpose(1, 2),
        v.repeat_interleave(groups, dim=2).transpose(1, 2), attn_mask=mask).transpose(1, 2).reshape(R, B, heads * hd)
    got = grouped_attention(q, k, v, mask)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-12, rtol=0)


def test_default_target_layer_ids_spread_from_the_first_layer_to_the_last() -> None:
    from services.draft.make_drafter import default_target_layer_ids

    assert default_target_layer_ids(3, 2) == [0, 2]
    assert default_target_layer_ids(61, 5) == [0, 15, 30, 45, 60]
    assert default_target_layer_ids(8, 1) == [4]


def test_the_tokenizer_trains_at_the_smallest_vocabulary_into_a_new_directory_past_a_bad_file(tmp_path: Path) -> None:
    """258 (the byte alphabet and the two special tokens) is the documented minimum, the output
    directory is made, a file that is not UTF-8 is skipped, and the special tokens take ids 0 and 1."""
    from services.common.tokenizer_train import EOS_TOKEN, MASK_TOKEN

    bad = tmp_path / "latin1.py"
    bad.write_bytes("# caf\xe9\n".encode("latin-1"))
    tok = train_tokenizer(tmp_path / "new" / "dir", [bad, *default_corpus_files(limit=2)], 258)
    assert (tmp_path / "new" / "dir" / "tokenizer.json").is_file() and tok.get_vocab_size() == 258
    assert tok.token_to_id(EOS_TOKEN) == 0 and tok.token_to_id(MASK_TOKEN) == 1
    assert train_tokenizer(tmp_path / "300", default_corpus_files(limit=4), 300).get_vocab_size() == 300
    with pytest.raises(ValueError, match="vocab_size must be >= 258"):
        train_tokenizer(tmp_path, [], 257)


def test_the_default_corpus_is_the_standard_library_without_tests_or_installed_packages() -> None:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = default_corpus_files()
    assert files == sorted(files)
    dirs = [f.relative_to(root).parts[:-1] for f in files]
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}   # not the module's own set
    assert not any(skip.intersection(d) for d in dirs)
    assert any(d for d in dirs)   # packages' modules too (json/, asyncio/ ...), not the top level alone
    assert default_corpus_files(limit=5) == files[:5]


def test_a_dflash_proposer_reports_its_drafters_shape_order_and_dtype(pair) -> None:
    """What the engine tells the verifier and the scheduler (block size, the target layers in the
    order their features are concatenated) and the dtype its proposals come in are the drafter's
    own: the other CPU tests load float32 only, so a proposer that said float32 for a bf16 drafter,
    a block one short or the layers reversed would pass them."""
    proposer = load_proposer(str(pair[0]), str(pair[1]), torch.bfloat16, "cpu")
    assert (proposer.block_size, proposer.target_layer_ids, proposer.hidden_size, proposer.vocab_size) == (
        BLOCK, tuple(LAYER_IDS), HIDDEN, VOCAB)
    assert proposer.dtype == torch.bfloat16
    proposer.start("a", [1, 2])
    proposer.commit("a", [1, 2], torch.randn(2, len(LAYER_IDS) * HIDDEN, dtype=torch.bfloat16))
    out = proposer.propose(["a"], torch.tensor([3]))
    assert out.shape == (1, proposer.block_size - 1, proposer.vocab_size) and out.dtype == proposer.dtype


def test_commit_many_gives_each_request_its_own_features(drafter) -> None:
    """A step's commits go to the drafter in one call: each request's context takes its own
    features (swapped, each request would draft from another's context while outputs stayed exact,
    so no end-to-end test would see it)."""
    batched, alone = DFlashProposer(drafter), DFlashProposer(drafter)
    feats = {"a": _features(3, 50), "b": _features(5, 51)}
    for p in (batched, alone):
        for rid in feats:
            p.start(rid, [1])
    batched.commit_many([(rid, list(range(len(f))), f) for rid, f in feats.items()])
    for rid, f in feats.items():
        alone.commit(rid, list(range(len(f))), f)
    assert {rid: ctx.length for rid, ctx in batched._ctx.items()} == {"a": 3, "b": 5}
    bonus = torch.tensor([7, 9])
    torch.testing.assert_close(batched.propose(["a", "b"], bonus), alone.propose(["a", "b"], bonus))
    for p in (batched, alone):
        for rid in feats:
            p.drop(rid)


def test_with_graphs_propose_returns_the_leading_rows_of_propose_output(pair) -> None:
    """`propose_output` is the buffer a pooled propose writes (what TreeGraphs replays its tree
    build on), and `enable_graphs` returns the pool's bytes (logged at start-up). None there would
    send every tree build on the eager path."""
    drafter = DFlashDrafter.load(pair[0], pair[1])
    proposer = DFlashProposer(drafter)
    assert proposer.propose_output is None
    pool = proposer.enable_graphs(2, 64)
    assert pool == drafter.graphs.pool_bytes > 0
    buffer = proposer.propose_output
    assert buffer is drafter.graphs.out
    proposer.start("a", [1])
    proposer.commit("a", [1, 2, 3], _features(3, 60))
    out = proposer.propose(["a"], torch.tensor([4]))
    assert out.data_ptr() == buffer.data_ptr() and out.shape == (1, *buffer.shape[1:])
    proposer.drop("a")


def test_an_oracle_spec_missing_a_field_is_a_checkpoint_error_naming_it(tmp_path) -> None:
    """A spec without a required field is refused as the drafter's checkpoint (start-up's clean
    error naming the file and field), not a bare KeyError traceback."""
    spec = tmp_path / "oracle.json"
    spec.write_text(json.dumps({"hidden_size": 8, "block_size": 4, "target_layer_ids": [0], "continuations": []}))
    with pytest.raises(CheckpointError, match=r"oracle drafter spec .*oracle\.json: 'vocab_size'"):
        load_proposer(f"oracle:{spec}", "unused", torch.float32, "cpu")


def test_rope_tables_take_positions_in_float32_whatever_the_model_dtype() -> None:
    """_Rope.cos_sin computes angles from float32 positions and only then casts cos/sin to the
    model dtype (as HF does). Casting the positions to bf16 first would round every position past
    256 to a multiple of 2 (past 512, of 4): neighbouring context tokens share a rotation and the
    drafter's keys at long contexts are rotated to the wrong place."""
    hd = 16
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    rope = _Rope(inv_freq=inv)
    pos = torch.arange(250, 300)
    cos32, sin32 = rope.cos_sin(pos, torch.float32)
    cos16, sin16 = rope.cos_sin(pos, torch.bfloat16)
    assert cos16.dtype == torch.bfloat16
    assert torch.equal(cos16, cos32.to(torch.bfloat16)) and torch.equal(sin16, sin32.to(torch.bfloat16))


def test_drafter_dtype_defaults_to_its_checkpoint_dtype(pair: tuple[Path, Path]) -> None:
    """DFlashDrafter(dtype=None) runs in the dtype of its stored weights (fc.weight), with the
    target's embedding and lm_head cast to it too, and proposes logits in that dtype. Defaulting
    to float32 would double a bf16 drafter's memory and change its numerics; an embedding left in
    float32 would mix dtypes in the block forward."""
    drafter_dir, target_dir = pair
    config = check_pairing(drafter_dir, target_dir)
    weights = {k: v.to(torch.bfloat16) for k, v in load_tensors(drafter_dir).items()}
    tgt = load_tensors(target_dir)
    d = DFlashDrafter(config, weights, tgt["model.embed_tokens.weight"], tgt["lm_head.weight"])
    assert d.dtype == torch.bfloat16
    assert d.embed_weight.dtype == d.lm_head_weight.dtype == d.fc.dtype == torch.bfloat16
    ctx = d.new_context()
    d.extend_context(ctx, torch.randn(5, config.num_features, generator=torch.Generator().manual_seed(1)))
    assert ctx.keys.dtype == torch.bfloat16
    out = d.propose([ctx], torch.tensor([3]))
    assert out.shape == (1, config.block_size - 1, VOCAB) and out.dtype == torch.bfloat16


def test_target_embedding_and_lm_head_shapes_are_checked(pair: tuple[Path, Path]) -> None:
    """The target's embedding and lm_head must be exactly [vocab_size, hidden] of the drafter's
    config. Without the check a target whose tensors disagree with its config.json would load: an
    lm_head of V+1 rows would silently give V+1 logits a position (a token id the verifier has no
    row for), a larger embedding would be indexed without complaint."""
    drafter_dir, target_dir = pair
    config = check_pairing(drafter_dir, target_dir)
    weights = load_tensors(drafter_dir)
    tgt = load_tensors(target_dir)
    emb, head = tgt["model.embed_tokens.weight"], tgt["lm_head.weight"]
    bigger = torch.cat([head, head[:1]])  # [V+1, hidden]
    with pytest.raises(CheckpointError, match="lm_head"):
        DFlashDrafter(config, weights, emb, bigger)
    with pytest.raises(CheckpointError, match="embed_tokens"):
        DFlashDrafter(config, weights, torch.cat([emb, emb[:1]]), head)


def test_extend_contexts_refuses_a_count_mismatch(pair: tuple[Path, Path]) -> None:
    """extend_contexts takes one feature tensor per context. Without the length check zip() would
    silently drop the extra features (or leave the extra contexts unextended), and a request's
    drafter context would fall behind its committed tokens with no error."""
    d = DFlashDrafter.load(*pair)
    gen = torch.Generator().manual_seed(4)
    ctx = d.new_context()
    f = torch.randn(2, d.config.num_features, generator=gen)
    with pytest.raises(ValueError, match="contexts"):
        d.extend_contexts([ctx], [f, f])
    with pytest.raises(ValueError, match="contexts"):
        d.extend_contexts([ctx, d.new_context()], [f])
    assert ctx.length == 0


def test_propose_mixes_pooled_and_unpooled_contexts_eagerly(pair: tuple[Path, Path]) -> None:
    """With graphs on, a batch holding any context outside the pool (the pool was full when it was
    made) must run the eager forward: each row equal to the drafter without graphs. Replaying the
    pool whenever *some* context has a row would pass a None row to the pool and either fail or
    draft that request from another request's (or an empty) context."""
    plain = DFlashDrafter.load(*pair)
    pooled = _graph_drafter(pair, rows=2, context=64)
    gen = torch.Generator().manual_seed(6)
    feats = [torch.randn(n, plain.config.num_features, generator=gen) for n in (5, 2, 3)]
    ctxs = [pooled.new_context() for _ in feats]
    assert ctxs[0].row is not None and ctxs[1].row is not None and ctxs[2].row is None   # pool full
    refs = [plain.new_context() for _ in feats]
    for c, r, f in zip(ctxs, refs, feats):
        pooled.extend_context(c, f)
        plain.extend_context(r, f)
    ctxs, refs = [ctxs[0], ctxs[2]], [refs[0], refs[2]]   # a batch of 2: a pool bucket holds it
    bonus = torch.tensor([7, 11])
    got = pooled.propose(ctxs, bonus)
    want = plain.propose(refs, bonus)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_propose_refuses_bonus_tokens_of_the_wrong_shape(pair: tuple[Path, Path]) -> None:
    """propose takes exactly one bonus token per context ([R]). Without the check a single bonus
    token would broadcast into every row of the block (each request drafting after another's
    token), and an [R, 1] tensor would fail deep inside the forward or broadcast wrongly."""
    d = DFlashDrafter.load(*pair)
    gen = torch.Generator().manual_seed(8)
    ctxs = [d.new_context() for _ in range(3)]
    for c in ctxs:
        d.extend_context(c, torch.randn(4, d.config.num_features, generator=gen))
    for bad in (torch.tensor([5]), torch.tensor([[1], [2], [3]]), torch.tensor([1, 2, 3, 4])):
        with pytest.raises(ValueError, match="bonus_tokens"):
            d.propose(ctxs, bad)
