"""Checkpoint reading/writing and the errors a bad target checkpoint produces."""

import collections
import copy
import json
import re
from pathlib import Path

import pytest
import torch

from services.common.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    load_tensors,
    read_config,
    save_tensors,
)
from services.common.config_files import read_json_object, refuse_lfs_pointer, with_rope_parameters
from services.draft.config import DraftConfig, check_pairing
from services.draft.dflash import DFlashDrafter
from services.verifier.config import TargetConfig, read_target_config
from services.verifier.make_target import TINY_TARGET_CONFIG, write_random_target
from services.verifier.model import TargetModel, expected_tensors
from services.verifier.parallel import load_rank_slice
from services.verifier.reference import ReferenceModel

VOCAB = 128


@pytest.fixture()
def target_dir(tmp_path: Path) -> Path:
    d = tmp_path / "target"
    write_random_target(d, VOCAB, int4=True, seed=3)
    return d


def _rewrite_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _rewrite_tensors(d: Path, edit) -> None:
    tensors = load_tensors(d)
    edit(tensors)
    (d / SINGLE_FILE).unlink()
    save_tensors(d, tensors)


def test_save_load_single_and_sharded(tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.full((10, 10), float(i)) for i in range(5)} | {"ints": torch.arange(7, dtype=torch.int32)}
    save_tensors(tmp_path / "one", tensors)
    assert (tmp_path / "one" / SINGLE_FILE).is_file()
    save_tensors(tmp_path / "many", tensors, max_shard_bytes=900)
    index = json.loads((tmp_path / "many" / INDEX_FILE).read_text())
    # 400 bytes a t-tensor, 28 the ints: two a shard, each shard filled before the next begins
    # (one a shard after the first split would make a large checkpoint thousands of files).
    assert sorted(collections.Counter(index["weight_map"].values()).values()) == [2, 2, 2]
    assert index["metadata"]["total_size"] == 5 * 400 + 7 * 4
    for d in ("one", "many"):
        got = load_tensors(tmp_path / d)
        assert got.keys() == tensors.keys()
        assert all(torch.equal(got[k], v) for k, v in tensors.items())
        assert load_tensors(tmp_path / d, names=["t3"]).keys() == {"t3"}
        assert load_tensors(tmp_path / d, prefix="t").keys() == {f"t{i}" for i in range(5)}
    with pytest.raises(CheckpointError, match="missing tensor.*nope"):
        load_tensors(tmp_path / "many", names=["t1", "nope"])
    # A save over the other layout replaces it: the stale index (read first) or shards kept the old weights.
    newer = {name: t + 1 for name, t in tensors.items()}
    save_tensors(tmp_path / "many", newer)
    save_tensors(tmp_path / "one", newer, max_shard_bytes=900)
    for d in ("one", "many"):
        assert all(torch.equal(load_tensors(tmp_path / d)[n], t) for n, t in newer.items())
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == [SINGLE_FILE]


def test_an_index_naming_the_wrong_shard_is_a_checkpoint_error_for_the_ranks_loader_too(tmp_path: Path,
                                                                                        target_dir: Path) -> None:
    """The tensor-parallel loader let safetensors' own error out (a traceback at start-up)."""
    shard_dir = tmp_path / "sharded"
    save_tensors(shard_dir, load_tensors(target_dir), max_shard_bytes=64 * 1024)
    (shard_dir / "config.json").write_text((target_dir / "config.json").read_text())
    index = json.loads((shard_dir / INDEX_FILE).read_text())
    name = "model.layers.2.self_attn.o_proj.weight"
    index["weight_map"][name] = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    (shard_dir / INDEX_FILE).write_text(json.dumps(index))
    config = read_target_config(shard_dir)
    with pytest.raises(CheckpointError, match=rf"missing tensor {re.escape(name)} \(listed in"):
        load_rank_slice(shard_dir, config, expected_tensors(config), rank=0, size=1)


def test_sharded_target_loads_same_as_single(tmp_path: Path, target_dir: Path) -> None:
    shard_dir = tmp_path / "sharded"
    save_tensors(shard_dir, load_tensors(target_dir), max_shard_bytes=64 * 1024)
    (shard_dir / "config.json").write_text((target_dir / "config.json").read_text())
    a, b = TargetModel.load(target_dir), TargetModel.load(shard_dir)
    assert torch.equal(a.layers[2].moe.w_down, b.layers[2].moe.w_down)
    assert a.layers[2].moe.int4 is not None and a.layers[2].moe.int4["gate_proj"].packed.dtype == torch.int32


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*missing config.json"):
        read_config(tmp_path)


def test_invalid_json(target_dir: Path) -> None:
    (target_dir / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: invalid JSON"):
        TargetModel.load(target_dir)


@pytest.mark.parametrize("text", ["[1, 2]", "null", '"config"'])
def test_a_config_that_is_no_json_object_names_the_file(target_dir: Path, text: str) -> None:
    (target_dir / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json: expected a JSON object at top level"):
        TargetModel.load(target_dir)


def test_a_config_or_index_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    """A UTF-16 or Latin-1 file raised a bare UnicodeDecodeError, a traceback at start-up."""
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{\x00}\x00")
    with pytest.raises(CheckpointError, match=r"config\.json: not UTF-8 text"):
        read_config(tmp_path)
    (tmp_path / INDEX_FILE).write_bytes(b'{"weight_map": {"a": "caf\xe9"}}')
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE}: not UTF-8 text"):
        load_tensors(tmp_path)


def test_no_weights_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"{tmp_path}: neither {INDEX_FILE} nor {SINGLE_FILE}"):
        load_tensors(tmp_path)


def test_a_weights_file_the_service_cannot_read_is_a_checkpoint_error(tmp_path: Path, monkeypatch) -> None:
    """One line naming the file (a checkpoint written 0600 by another user), not PermissionError's
    traceback from the attempt to tell an LFS pointer apart. Patched: as root the file would read."""
    from services.common import checkpoint

    save_tensors(tmp_path, {"t": torch.ones(2)})

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(checkpoint, "safe_open", denied)
    monkeypatch.setattr(checkpoint, "open", denied, raising=False)
    with pytest.raises(CheckpointError, match=f"{SINGLE_FILE}: not a readable safetensors file"):
        load_tensors(tmp_path)


def test_missing_shard_file(tmp_path: Path) -> None:
    save_tensors(tmp_path, {"a": torch.zeros(300), "b": torch.zeros(300)}, max_shard_bytes=1000)
    victim = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]["b"]
    (tmp_path / victim).unlink()
    with pytest.raises(CheckpointError, match=f"shard file {victim}"):
        load_tensors(tmp_path)


def test_missing_tensor(target_dir: Path) -> None:
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    _rewrite_tensors(target_dir, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"{target_dir}: missing tensor {name}"):
        TargetModel.load(target_dir)


def _rank_slice(target_dir: Path, size: int = 1) -> dict[str, torch.Tensor]:
    """Rank 0's tensors as the tensor-parallel loader reads them."""
    config = read_target_config(target_dir)
    return load_rank_slice(target_dir, config, expected_tensors(config), rank=0, size=size)


def test_wrong_shape_names_file_and_tensor(target_dir: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    _rewrite_tensors(target_dir, lambda t: t.__setitem__(name, torch.randn(64, 100).bfloat16()))
    for load in (TargetModel.load, _rank_slice):
        with pytest.raises(CheckpointError, match=rf"{SINGLE_FILE}: tensor {name} has shape \(64, 100\), config implies \(64, 128\)"):
            load(target_dir)
    with pytest.raises(CheckpointError, match=name):
        ReferenceModel.load(target_dir)


def test_one_verifier_checks_every_header_before_it_reads_a_tensor(tmp_path: Path, target_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With tp = 1 the loader read every tensor, then checked them: a tensor of another shape in the
    last shard was found after all the others had been read. It reads as one rank of one now, as
    the ranks of a group do. A dtype torch has no name for is named as the file holds it."""
    from services.common import checkpoint
    from services.verifier import parallel

    shard_dir = tmp_path / "sharded"
    tensors = load_tensors(target_dir)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
    save_tensors(shard_dir, tensors, max_shard_bytes=64 * 1024)
    (shard_dir / "config.json").write_text((target_dir / "config.json").read_text())
    reads: list[str] = []

    class Slice:
        def __init__(self, part, name: str) -> None:
            self.part, self.name = part, name

        def get_shape(self):
            return self.part.get_shape()

        def get_dtype(self):
            return self.part.get_dtype()

        def __getitem__(self, index):
            reads.append(self.name)
            return self.part[index]

    class File:
        def __init__(self, path: Path) -> None:
            self.f = opened(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name: str) -> Slice:
            return Slice(self.f.get_slice(name), name)

        def get_tensor(self, name: str) -> torch.Tensor:
            reads.append(name)
            return self.f.get_tensor(name)

    opened = checkpoint.open_safetensors
    for module in (checkpoint, parallel):
        monkeypatch.setattr(module, "open_safetensors", File)
    with pytest.raises(CheckpointError, match=r"tensor model\.norm\.weight has shape \(63,\), config implies \(64,\)"):
        TargetModel.load(shard_dir)
    assert reads == []
    _rewrite_tensors(target_dir, lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"].view(torch.uint16)))
    for size in (1, 2):
        with pytest.raises(CheckpointError, match=r"tensor lm_head\.weight is U16; expected float32 or bfloat16"):
            _rank_slice(target_dir, size=size)


def test_packed_weight_must_be_int32(target_dir: Path) -> None:
    name = "model.layers.1.mlp.experts.3.up_proj.weight_packed"
    _rewrite_tensors(target_dir, lambda t: t.__setitem__(name, t[name].to(torch.int64)))
    for load in (TargetModel.load, _rank_slice):
        with pytest.raises(CheckpointError, match=f"{name} is int64; expected int32"):
            load(target_dir)


def test_the_tensor_parallel_loader_refuses_a_split_tp_does_not_divide(target_dir: Path, tmp_path: Path) -> None:
    """Heads, vocabulary and expert widths split evenly over the ranks, or the start fails before
    any read, naming the tensor and its count (a rank would otherwise take a ragged slice)."""
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj\.weight_packed splits into 1 units along dim 1, "
                                              r"not divisible by tp=2 .*a multiple of the group size"):
        _rank_slice(target_dir, size=2)   # one INT4 group of expert width: it cannot split
    write_random_target(tmp_path / "bf16", VOCAB, int4=False, seed=3)
    assert _rank_slice(tmp_path / "bf16", size=2)   # this target's splits divide by 2
    with pytest.raises(CheckpointError, match=r"tensor \S+ splits into \d+ units along dim [01], not divisible by tp=3"):
        _rank_slice(tmp_path / "bf16", size=3)


@pytest.mark.parametrize("name, dtype, expected", [
    ("model.embed_tokens.weight", torch.int32, "float32 or bfloat16 or float16"),
    ("model.layers.0.self_attn.o_proj.weight", torch.float8_e4m3fn, "float32 or bfloat16 or float16"),
    ("model.layers.1.mlp.experts.0.down_proj.weight_scale", torch.int32, "float32 or bfloat16 or float16"),
])
def test_a_tensor_of_another_dtype_is_refused_not_converted(target_dir: Path, name, dtype, expected) -> None:
    """An integer embedding, FP8 projections without their scales, integer scales: converted
    without a word, they served wrong numbers."""
    _rewrite_tensors(target_dir, lambda t: t.__setitem__(name, t[name].to(dtype)))
    with pytest.raises(CheckpointError, match=rf"{name} is {str(dtype).removeprefix('torch.')}; expected {expected}"):
        TargetModel.load(target_dir)


@pytest.mark.parametrize("suffix", ["weight_g_idx", "weight_zero_point"])
def test_tensors_of_a_quantisation_not_implemented_are_refused(target_dir: Path, suffix) -> None:
    """Activation-ordered groups (g_idx) or zero points were skipped as extra tensors, and the
    experts dequantised with the wrong groups; an MTP layer's past the served ones still is."""
    name = f"model.layers.1.mlp.experts.0.up_proj.{suffix}"
    _rewrite_tensors(target_dir, lambda t: t.__setitem__(name, torch.zeros(4, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match=rf"{name}: {suffix} is not supported"):
        TargetModel.load(target_dir)


def test_weight_shape_mismatch(target_dir: Path) -> None:
    """Refused by the tensor-parallel loader too (it rewrites each weight_shape to its slice's, and
    took any stored value)."""
    name = "model.layers.2.mlp.experts.0.down_proj.weight_shape"
    _rewrite_tensors(target_dir, lambda t: t.__setitem__(name, torch.tensor([32, 64])))
    with pytest.raises(CheckpointError, match=rf"{name} holds \[32, 64\], config implies \[64, 32\]"):
        TargetModel.load(target_dir)
    with pytest.raises(CheckpointError, match=rf"{name} holds \[32, 64\], config implies \[64, 32\]"):
        _rank_slice(target_dir)


def test_unsupported_model_type(target_dir: Path) -> None:
    _rewrite_config(target_dir, model_type="llama")
    with pytest.raises(CheckpointError, match="config.json: field 'model_type' unsupported 'llama'"):
        TargetModel.load(target_dir)


def test_missing_and_bad_fields(target_dir: Path) -> None:
    cfg = json.loads((target_dir / "config.json").read_text())
    del cfg["kv_lora_rank"]
    with pytest.raises(CheckpointError, match="field 'kv_lora_rank' is missing"):
        TargetConfig.from_hf(cfg)
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg["n_group"] = 3
    with pytest.raises(CheckpointError, match="field 'n_group'"):
        TargetConfig.from_hf(cfg)
    cfg["n_group"] = 4
    cfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    with pytest.raises(CheckpointError, match="rope_scaling.type"):
        TargetConfig.from_hf(cfg)


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("format",), "float-quantized", "quantization_config.format"),
        (("quant_method",), "gptq", "quantization_config.quant_method"),
        (("config_groups", "group_0", "weights", "num_bits"), 8, "weights.num_bits"),
        (("config_groups", "group_0", "weights", "symmetric"), False, "weights.symmetric"),
        (("config_groups", "group_0", "weights", "group_size"), 12, "weights.group_size"),
        # read as weight-only INT4 in order, they served other numbers than the checkpoint's own
        (("config_groups", "group_0", "weights", "actorder"), "group", "weights.actorder"),
        (("config_groups", "group_0", "input_activations"), {"num_bits": 8, "type": "int"}, "group_0.input_activations"),
    ],
)
def test_bad_quantization_format(target_dir: Path, path: tuple, value, field: str) -> None:
    cfg = json.loads((target_dir / "config.json").read_text())
    node = cfg["quantization_config"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (target_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"config.json: field '[^']*{field}'"):
        TargetModel.load(target_dir)


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("tie_word_embeddings", True, "must be false"),
    ("hidden_act", "gelu", "unsupported 'gelu'"),
    ("attention_bias", True, "must be false"),
    ("rope_theta", 0.0, "must be > 0"),
    ("rms_norm_eps", 0.0, "must be > 0"),
    ("routed_scaling_factor", -1.0, "must be > 0"),
    ("first_k_dense_replace", 99, "must be in 0..num_hidden_layers"),
    ("first_k_dense_replace", -1, "must be in 0..num_hidden_layers"),
    ("eos_token_id", [3, 163586], "163586 is past the vocabulary"),   # another model's: never emitted
    ("num_nextn_predict_layers", -1, "must be >= 0"),
])
def test_a_config_field_this_model_would_ignore_or_break_on_is_refused(target_dir: Path, field, value, needle) -> None:
    """Each was accepted: tying ignored (the verifier read lm_head, the drafter the embedding),
    another activation ignored, rope_theta 0 gave infinite frequencies, a dense-layer count past
    the layers was reported as a missing tensor."""
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(CheckpointError, match=rf"field '{field}' {needle}"):
        TargetConfig.from_hf(cfg)


def test_the_older_compression_config_name_is_named(target_dir: Path) -> None:
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg["compression_config"] = cfg.pop("quantization_config")
    with pytest.raises(CheckpointError, match="field 'compression_config' is the older name"):
        TargetConfig.from_hf(cfg)


def test_int4_config_ignores_everything_but_routed_experts(target_dir: Path) -> None:
    cfg = read_config(target_dir)
    ignore = cfg["quantization_config"]["ignore"]
    assert "lm_head" in ignore and "model.layers.0.self_attn.q_a_proj" in ignore
    assert "model.layers.1.mlp.shared_experts.down_proj" in ignore and "model.layers.0.mlp.gate_proj" in ignore
    assert not any(".experts." in name for name in ignore)
    names = load_tensors(target_dir).keys()
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_packed" in names
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" not in names


def test_eos_ids_come_from_config_and_generation_config(target_dir: Path) -> None:
    """Chat checkpoints often list their end-of-turn ids only in generation_config.json; the
    verifier stops at every id either file names, config.json's first."""
    _rewrite_config(target_dir, eos_token_id=[5, 7])
    assert read_target_config(target_dir).eos_token_id == (5, 7)
    (target_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9], "do_sample": True}))
    assert read_target_config(target_dir).eos_token_id == (5, 7, 9)
    assert TargetModel.load(target_dir).config.eos_token_id == (5, 7, 9)
    (target_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 163586]}))
    with pytest.raises(CheckpointError, match="generation_config.json: field 'eos_token_id' 163586 is past the vocabulary"):
        read_target_config(target_dir)
    _rewrite_config(target_dir, model_type=["deepseek_v3"])   # a TypeError traceback, before
    with pytest.raises(CheckpointError, match="field 'model_type' must be a string"):
        read_target_config(target_dir)
    _rewrite_config(target_dir, model_type="deepseek_v3")
    (target_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": "9"}))
    with pytest.raises(CheckpointError, match="generation_config.json: field 'eos_token_id' must be a token id"):
        read_target_config(target_dir)
    (target_dir / "generation_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="generation_config.json: invalid JSON"):
        read_target_config(target_dir)
    (target_dir / "generation_config.json").unlink()
    _rewrite_config(target_dir, eos_token_id=True)
    with pytest.raises(CheckpointError, match="config.json: field 'eos_token_id' must be a token id"):
        read_target_config(target_dir)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/x.safetensors", None, "", ".."])
def test_an_index_naming_a_file_outside_the_directory_is_refused(tmp_path: Path, shard) -> None:
    """`"../outside.safetensors"` (or an absolute path) loaded a file from outside the model
    directory; null was "shard file None is missing"."""
    from services.common.checkpoint import tensor_index

    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
    with pytest.raises(CheckpointError, match=r"weight_map\['model.norm.weight'\] = .* is not a file name of this"):
        tensor_index(tmp_path)


def test_a_written_checkpoint_is_as_readable_as_the_files_beside_it(tmp_path: Path) -> None:
    """safetensors writes 0600: a checkpoint made by one user was unreadable to a service running
    as another, while its config beside it was not."""
    save_tensors(tmp_path / "one", {"x": torch.ones(3)})
    save_tensors(tmp_path / "two", {"x": torch.ones(300), "y": torch.ones(300)}, max_shard_bytes=1500)
    (tmp_path / "config.json").write_text("{}")
    want = (tmp_path / "config.json").stat().st_mode & 0o777
    files = list((tmp_path / "one").glob("*.safetensors")) + list((tmp_path / "two").glob("*.safetensors"))
    assert len(files) == 3 and {f.stat().st_mode & 0o777 for f in files} == {want}


def test_transformers_5s_rope_parameters_read_as_rope_scaling(target_dir: Path) -> None:
    """transformers 5 writes `rope_parameters` (theta and scaling in one object) in place of
    `rope_theta` / `rope_scaling`; such a config read as unscaled rope at theta 10000, half the
    softmax scale gone, and served."""
    cfg = json.loads((target_dir / "config.json").read_text())
    before = TargetConfig.from_hf(cfg)
    new = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    scaling = {k: v for k, v in cfg["rope_scaling"].items() if k != "type"}
    new["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 50000.0, **scaling}
    after = TargetConfig.from_hf(new)
    assert after.rope_scaling == before.rope_scaling is not None and after.rope_theta == 50000.0
    new["rope_parameters"] = {"rope_type": "default", "rope_theta": 20000.0}
    plain = TargetConfig.from_hf(new)
    assert plain.rope_scaling is None and plain.rope_theta == 20000.0
    both = dict(new, rope_theta=50000.0, rope_scaling=cfg["rope_scaling"],   # both forms, spelled apart, agreeing
                rope_parameters={"rope_type": "yarn", "type": "yarn", "rope_theta": 50000.0, **scaling})
    assert TargetConfig.from_hf(both).rope_scaling == before.rope_scaling
    both["rope_scaling"] = {**cfg["rope_scaling"], "factor": 99.0}
    with pytest.raises(CheckpointError, match="field 'rope_scaling' .* disagrees with 'rope_parameters'"):
        TargetConfig.from_hf(both)
    with pytest.raises(CheckpointError, match="rope_type 'default': no scaling"):
        TargetConfig.from_hf(dict(both, rope_scaling=cfg["rope_scaling"],
                                  rope_parameters={"rope_type": "default", "rope_theta": 50000.0}))
    spelt_type = dict(new, rope_parameters={"type": "yarn", "rope_theta": 50000.0, **scaling})   # the older key's name
    assert TargetConfig.from_hf(spelt_type).rope_scaling == before.rope_scaling
    new["rope_theta"] = 10000.0   # both forms, disagreeing
    with pytest.raises(CheckpointError, match="field 'rope_theta' 10000.0 disagrees with 'rope_parameters'"):
        TargetConfig.from_hf(new)


def test_rope_fields_this_model_does_not_implement_are_refused_and_no_scaling_is_read_as_such(target_dir: Path) -> None:
    """transformers 5's unscaled rope beside its alias (`rope_scaling: {rope_type: default}`) was
    refused as an unsupported scaling; yarn keys this model does not implement (attention_factor,
    truncate false) and a non-interleaved rope layout were accepted and ignored."""
    cfg = json.loads((target_dir / "config.json").read_text())
    plain = dict(cfg, rope_scaling={"rope_type": "default"},
                 rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]})
    assert TargetConfig.from_hf(plain).rope_scaling is None
    assert TargetConfig.from_hf(dict(cfg, rope_scaling={"type": "default"})).rope_scaling is None
    yarn = cfg["rope_scaling"]
    assert TargetConfig.from_hf(dict(cfg, rope_scaling={**yarn, "attention_factor": None, "truncate": True})).rope_scaling \
        == TargetConfig.from_hf(cfg).rope_scaling   # transformers' defaults, written out
    for key, value in (("attention_factor", 2.0), ("truncate", False), ("foo", 1)):
        with pytest.raises(CheckpointError, match=rf"field 'rope_scaling.{key}' is not supported"):
            TargetConfig.from_hf(dict(cfg, rope_scaling={**yarn, key: value}))
    assert TargetConfig.from_hf(dict(cfg, rope_interleave=True)).rope_scaling is not None
    with pytest.raises(CheckpointError, match="field 'rope_interleave' must be true"):
        TargetConfig.from_hf(dict(cfg, rope_interleave=False))


def test_rope_parameters_without_a_theta_still_give_their_scaling() -> None:
    """Each field is read on its own: a reader that stopped at the first one absent (the theta,
    kept in the old top-level field) would drop the yarn scaling and serve Kimi-K2 with unscaled
    rope, without an error."""
    rp = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}
    out = with_rope_parameters({"rope_theta": 50000.0, "rope_parameters": rp}, "config.json")
    assert out["rope_theta"] == 50000.0 and out["rope_scaling"] == rp


def test_a_drafters_rope_parameters_give_its_theta() -> None:
    cfg = json.loads(Path("models/demo/drafter/config.json").read_text())
    cfg.pop("rope_theta", None)
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 123456.0}
    assert DraftConfig.from_hf(cfg).rope_theta == 123456.0
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1.0, "factor": 4.0}
    with pytest.raises(CheckpointError, match="rope_scaling"):
        DraftConfig.from_hf(cfg)


@pytest.mark.parametrize(("change", "needle"), [
    ({"attention_bias": True}, "field 'attention_bias' must be false"),
    ({"mlp_bias": True}, "field 'mlp_bias' must be false"),
    ({"use_sliding_window": True, "sliding_window": 8}, "field 'use_sliding_window' must be false"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "field 'layer_types'"),
    ({"final_logit_softcapping": 30.0}, "field 'final_logit_softcapping' must be null"),
    ({"attn_logit_softcapping": 50.0}, "field 'attn_logit_softcapping' must be null"),
    ({"hidden_act": "gelu"}, "field 'hidden_act' 'gelu' is not supported"),
    ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 3, 4], "block_size": 8}},
     "field 'block_size' is 16 and 'dflash_config.block_size' 8"),
])
def test_a_drafter_config_this_drafter_would_compute_otherwise_is_refused(change: dict, needle: str) -> None:
    """Each loaded, and the drafter served other logits than its training's: biases dropped,
    windows widened to the whole context, soft caps skipped, the top-level block size taken over
    the dflash_config's. Their defaults, written out, still load."""
    cfg = json.loads(Path("models/demo/drafter/config.json").read_text())
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        DraftConfig.from_hf({**cfg, **change})
    written_out = {**cfg, "attention_bias": False, "mlp_bias": False, "use_sliding_window": False, "sliding_window": None,
                   "layer_types": ["full_attention"] * 3, "final_logit_softcapping": None,
                   "dflash_config": {**cfg["dflash_config"], "block_size": cfg["block_size"]}}
    assert DraftConfig.from_hf(written_out) == DraftConfig.from_hf(cfg)


def test_the_training_drafter_reads_its_config_as_the_server_does() -> None:
    """It read raw keys: a config with block_size only in dflash_config, or transformers 5's
    rope_parameters, failed with a KeyError (the server loads both)."""
    from train.modeling import TrainDrafter

    cfg = json.loads(Path("models/demo/drafter/config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("block_size", "rope_theta", "rope_scaling")}
    cfg["dflash_config"] = {**cfg["dflash_config"], "block_size": 8}
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    embed = torch.randn(cfg["vocab_size"], cfg["hidden_size"])
    drafter = TrainDrafter(cfg, embed, embed)
    assert drafter.block == 8
    assert torch.allclose(drafter.inv_freq, 1.0 / 5000.0 ** (torch.arange(0, 32, 2) / 32))


@pytest.mark.parametrize("field", ["num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
                                   "norm_topk_prob", "first_k_dense_replace", "n_shared_experts"])
def test_a_moe_config_must_name_its_routing(target_dir: Path, field: str) -> None:
    """Their defaults differ between transformers' DeepseekV3Config and the configuration_deepseek.py
    the checkpoints ship (x2.5 vs x1.0, normalised or not, 3 dense layers or 0, 1 shared expert or
    none): a config without one was served with this loader's guess (without n_shared_experts, the
    shared experts were left unread)."""
    cfg = json.loads((target_dir / "config.json").read_text())
    del cfg[field]
    with pytest.raises(CheckpointError, match=rf"field '{field}' is missing: a MoE config must set it"):
        TargetConfig.from_hf(cfg)
    dense = {k: v for k, v in cfg.items() if k not in ("quantization_config", "moe_intermediate_size")}
    dense["n_routed_experts"] = None
    assert TargetConfig.from_hf(dense).n_routed_experts is None   # a dense model needs none of them


def test_git_lfs_pointers_are_named_as_such(target_dir: Path) -> None:
    """A clone without git-lfs leaves pointer files, which read as "invalid JSON" or "not a
    safetensors file"."""
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 123\n"
    weights = target_dir / SINGLE_FILE
    weights.write_text(pointer)
    with pytest.raises(CheckpointError, match=rf"{SINGLE_FILE}: a Git LFS pointer, not the file itself"):
        TargetModel.load(target_dir)
    (target_dir / INDEX_FILE).write_text(pointer)
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE}: a Git LFS pointer, not the file itself"):
        TargetModel.load(target_dir)
    (target_dir / "config.json").write_text(pointer)
    with pytest.raises(CheckpointError, match=r"config.json: a Git LFS pointer.*git lfs pull"):
        read_config(target_dir)


def test_a_layer_quantised_past_the_routed_experts_is_named(target_dir: Path) -> None:
    """An INT4 quantisation that also covers the shared experts was reported as a plain missing
    tensor."""
    name = "model.layers.1.mlp.shared_experts.gate_proj"

    def quantise(t: dict) -> None:
        w = t.pop(name + ".weight")
        t[name + ".weight_packed"] = torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.int32)
    _rewrite_tensors(target_dir, quantise)
    with pytest.raises(CheckpointError, match=rf"missing tensor {name}.weight: the checkpoint holds it INT4-quantised"):
        TargetModel.load(target_dir)


def test_a_config_that_disagrees_with_the_tensors_names_its_field(target_dir: Path, tmp_path: Path) -> None:
    """A missing tensor's message says which config field most likely disagrees: an INT4 checkpoint
    whose config lost its quantization_config was told to list its other layers as ignored. Each
    way round: INT4 experts or a q LoRA in the checkpoint and not in the config, and in the config
    and not in the checkpoint."""
    cfg = json.loads((target_dir / "config.json").read_text())
    no_quant = {k: v for k, v in cfg.items() if k != "quantization_config"}
    (target_dir / "config.json").write_text(json.dumps(no_quant))
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj\.weight \(\+\d+ more\): the checkpoint holds the "
                                              r"routed experts INT4-quantised .* config.json has no quantization_config"):
        TargetModel.load(target_dir)
    (target_dir / "config.json").write_text(json.dumps(dict(cfg, q_lora_rank=None)))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight .*has a q LoRA .* q_lora_rank is null or missing"):
        TargetModel.load(target_dir)
    dense = tmp_path / "dense"   # a quantization_config over dense experts
    write_random_target(dense, VOCAB, int4=False, seed=3, overrides={"q_lora_rank": None})
    hf = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps(dict(hf, quantization_config=cfg["quantization_config"])))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight_packed "
                                              r"\(\+\d+ more\): config\.json's quantization_config says INT4 routed experts, "
                                              r"and the checkpoint holds them dense \(model\.layers\.1\.mlp\.experts\.0\."
                                              r"gate_proj\.weight\)"):
        TargetModel.load(dense)
    (dense / "config.json").write_text(json.dumps(dict(hf, q_lora_rank=32)))   # a q LoRA the checkpoint lacks
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.0\.self_attn\.q_a_proj\.weight .*: the "
                                              r"checkpoint has no q LoRA \(q_proj\), and config\.json's q_lora_rank is 32"):
        TargetModel.load(dense)


@pytest.mark.parametrize("tp", [False, True])
def test_layers_past_the_configs_and_its_mtp_layers_are_refused_not_a_truncated_model(target_dir: Path, tp) -> None:
    """Every layer past num_hidden_layers was skipped as an MTP layer: a config of 2 layers over a
    checkpoint of 3 served a truncated model. Only num_nextn_predict_layers of them are skipped;
    tensors of the served modules outside the layers (a bias of the head, embedding or final norm)
    are refused too."""
    cfg = json.loads((target_dir / "config.json").read_text())
    config = lambda: read_target_config(target_dir)   # noqa: E731
    loaders = [lambda: load_rank_slice(target_dir, config(), expected_tensors(config()), rank=0, size=1)] if tp \
        else [lambda: TargetModel.load(target_dir)]
    (target_dir / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=2)))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.2\..* num_hidden_layers is 2, num_nextn_predict_layers 0"):
        loaders[0]()
    (target_dir / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=2, num_nextn_predict_layers=1)))
    loaders[0]()   # layer 2 is an MTP layer now: not served, not read
    (target_dir / "config.json").write_text(json.dumps(cfg))
    for name in ("lm_head.bias", "model.embed_tokens.bias", "model.norm.bias"):
        _rewrite_tensors(target_dir, lambda t: t.__setitem__(name, torch.randn(4)))  # noqa: B023 - called at once
        with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)} is not one config\.json implies"):
            loaders[0]()
        _rewrite_tensors(target_dir, lambda t: t.pop(name))  # noqa: B023 - called at once


@pytest.mark.parametrize("tp", [False, True])
@pytest.mark.parametrize(("name", "needle"), [
    ("model.layers.1.mlp.shared_experts.up_proj.weight", "n_shared_experts is 0"),
    ("model.layers.0.mlp.experts.0.up_proj.weight_packed", "first_k_dense_replace 1"),
    ("model.layers.0.mlp.gate.weight", "n_routed_experts 16, first_k_dense_replace 1, moe_layer_freq 1"),
    ("model.layers.1.self_attn.q_proj.weight", r"\)$"),   # no field to name
])
def test_a_tensor_of_a_served_layer_the_config_does_not_read_is_refused(target_dir: Path, name, needle, tp) -> None:
    """A config without n_shared_experts (or with 0) loaded without the shared experts the
    checkpoint holds, and served other numbers; every tensor of a served layer must be read. An
    MTP layer's past them, and a saved rotary buffer, are not."""
    cfg = dict(json.loads((target_dir / "config.json").read_text()), num_nextn_predict_layers=1)
    (target_dir / "config.json").write_text(json.dumps(cfg))

    def load() -> None:   # tp: the tensor-parallel ranks' loader (one rank: this target splits no further)
        if tp:
            config = read_target_config(target_dir)
            load_rank_slice(target_dir, config, expected_tensors(config), rank=0, size=1)
        else:
            TargetModel.load(target_dir)
    extra = {"model.layers.3.mlp.up_proj.weight": torch.randn(4, 4),   # an MTP layer's (num_hidden_layers 3)
             "model.layers.1.self_attn.rotary_emb.inv_freq": torch.randn(4)}
    _rewrite_tensors(target_dir, lambda t: t.update(extra))
    load()
    if "shared_experts" in name:
        (target_dir / "config.json").write_text(json.dumps(dict(cfg, n_shared_experts=0)))
    else:
        _rewrite_tensors(target_dir, lambda t: t.__setitem__(name, torch.randn(4, 4)))
    shown = r"model\.layers\.1\.mlp\.shared_experts\.\w+\.weight \(\+5 more\)" if "shared" in name else re.escape(name)
    with pytest.raises(CheckpointError, match=rf"tensor {shown} is not one config.json implies, and would be left "
                                              rf"unread \(does the config match the checkpoint\?.*{needle}"):
        load()


def wrap_as_kimi_k25(src: Path, dst: Path, shard_bytes: int = 1 << 20) -> None:
    """``src`` rewritten as Kimi-K2.5 / K2.6 ship their language model: config.json a `kimi_k25`
    wrapper with the model in `text_config` and the quantisation at the top, every tensor under
    `language_model.`, a vision tower beside them, sharded with an index."""
    cfg = read_config(src)
    quant = cfg.pop("quantization_config", None)
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "eos_token_id": cfg["eos_token_id"], "text_config": {**cfg, "model_type": "deepseek_v3"},
               "vision_config": {"vt_hidden_size": 16}}
    if quant is not None:
        wrapper["quantization_config"] = quant
    tensors = {f"language_model.{k}": v for k, v in load_tensors(src).items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(16, 3, 14, 14)
    save_tensors(dst, tensors, max_shard_bytes=shard_bytes)
    (dst / "config.json").write_text(json.dumps(wrapper))


def test_a_kimi_k25_wrapper_serves_its_language_model(tmp_path: Path, target_dir: Path) -> None:
    """Kimi-K2.5 / K2.6 (INT4 experts, as K2-Thinking) wrap the K2 language model in a multimodal
    config, its tensors under `language_model.`: they were refused as model type 'kimi_k25'."""
    wrapped = tmp_path / "k25"
    wrap_as_kimi_k25(target_dir, wrapped, shard_bytes=64 * 1024)
    assert len(set(json.loads((wrapped / INDEX_FILE).read_text())["weight_map"].values())) > 1
    a, b = TargetModel.load(target_dir), TargetModel.load(wrapped)
    assert a.config == b.config and b.config.quantization is not None
    assert torch.equal(a.layers[2].moe.w_down, b.layers[2].moe.w_down) and torch.equal(a.lm_head_weight, b.lm_head_weight)
    expected = expected_tensors(b.config)
    sa = load_rank_slice(target_dir, a.config, expected, 0, 1)   # the tensor-parallel loader: by the stored names
    sb = load_rank_slice(wrapped, b.config, expected, 0, 1)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert "vision_tower.patch_embed.proj.weight" not in load_tensors(wrapped)   # not this stack's


def test_a_drafter_pairs_with_a_wrapped_target(tmp_path: Path) -> None:
    """The drafter reads its target's embedding and lm_head, and `ddtree up` checks the pair from
    the target's config: both through the wrapper."""
    demo = Path("models/demo")
    wrapped = tmp_path / "demo-k25"
    wrap_as_kimi_k25(demo, wrapped)
    assert check_pairing(demo / "drafter", wrapped).vocab_size == read_config(demo)["vocab_size"]
    a = DFlashDrafter.load(demo / "drafter", demo)
    b = DFlashDrafter.load(demo / "drafter", wrapped)
    assert torch.equal(a.lm_head_weight, b.lm_head_weight)


def test_a_wrapper_without_its_text_config_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25"}))
    with pytest.raises(CheckpointError, match="field 'text_config' of a kimi_k25 config must be an object"):
        read_config(tmp_path)


def test_a_wrappers_fields_in_both_places_must_agree(tmp_path: Path, target_dir: Path) -> None:
    """Kimi-K2.5 repeats its quantisation in `text_config`: the inner copy won even where it was
    null (no quantisation) or said another eos id."""
    wrapped = tmp_path / "k25"
    wrap_as_kimi_k25(target_dir, wrapped)
    cfg = json.loads((wrapped / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = cfg["quantization_config"]   # as K2.5 ships it
    cfg["text_config"]["eos_token_id"] = None
    (wrapped / "config.json").write_text(json.dumps(cfg))
    got = read_config(wrapped)
    assert got["quantization_config"] == cfg["quantization_config"] and got["eos_token_id"] == cfg["eos_token_id"]
    cfg["text_config"]["eos_token_id"] = 99
    (wrapped / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="field 'eos_token_id' differs between the top level and text_config"):
        read_config(wrapped)


def test_a_wrapper_over_tensors_without_its_prefix_says_so(tmp_path: Path, target_dir: Path) -> None:
    """Reported as "missing tensor model.embed_tokens.weight (+N more)", the prefix unsaid; and a
    bad field is named where it is, in text_config."""
    wrapped = tmp_path / "k25"
    wrap_as_kimi_k25(target_dir, wrapped)
    save_tensors(tmp_path / "plain", load_tensors(target_dir))
    for f in wrapped.glob("*.safetensors*"):
        f.unlink()
    for f in (tmp_path / "plain").iterdir():
        f.rename(wrapped / f.name)
    with pytest.raises(CheckpointError, match=r"no tensor's name starts with 'language_model\.', where its config.json"):
        TargetModel.load(wrapped)
    cfg = json.loads((wrapped / "config.json").read_text())
    del cfg["text_config"]["kv_lora_rank"]
    (wrapped / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json text_config: field 'kv_lora_rank' is missing"):
        read_target_config(wrapped)


# Config fields a checkpoint leaves out, and configs the model would serve wrongly.

def test_target_fields_left_out_take_the_transformers_defaults() -> None:
    """Every test config spelled these out: a wrong default changed the rope or the norm of a
    checkpoint that leaves them out, without an error."""
    hf = copy.deepcopy(TINY_TARGET_CONFIG)
    del hf["rope_theta"], hf["rms_norm_eps"]
    hf["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    c = TargetConfig.from_hf(hf)
    assert c.rope_theta == 10000.0 and c.rms_norm_eps == 1e-6
    y = c.rope_scaling
    assert (y.beta_fast, y.beta_slow, y.mscale, y.mscale_all_dim) == (32.0, 1.0, 1.0, 0.0)


def test_target_floats_written_as_integers_and_a_yarn_factor_of_one_are_read() -> None:
    """DeepSeek-V3's own config.json writes `"rope_theta": 10000` and the yarn `"factor": 40`,
    `"beta_fast": 32` as JSON integers. A reader that took only floats would refuse the real
    checkpoint ("must be float, got 10000"); one that wanted factor > 1 would refuse factor 1."""
    yarn = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1, "mscale_all_dim": 1}
    c = TargetConfig.from_hf({**copy.deepcopy(TINY_TARGET_CONFIG), "rope_theta": 10000, "routed_scaling_factor": 3,
                              "rope_scaling": yarn})
    assert isinstance(c.rope_theta, float) and c.rope_theta == 10000.0
    assert isinstance(c.routed_scaling_factor, float) and c.routed_scaling_factor == 3.0
    assert (c.rope_scaling.factor, c.rope_scaling.beta_fast) == (40.0, 32.0)
    one = TargetConfig.from_hf({**copy.deepcopy(TINY_TARGET_CONFIG), "rope_scaling": {**yarn, "factor": 1.0}})
    assert one.rope_scaling.factor == 1.0


def test_null_target_fields_read_as_left_out() -> None:
    """configuration_deepseek.py writes a dense model's unused routing fields as null. A reader
    that took null for a value would refuse that config ("must be int, got None")."""
    nulls = dict.fromkeys(("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
                           "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "moe_intermediate_size",
                           "rope_theta", "num_nextn_predict_layers"))
    c = TargetConfig.from_hf({**copy.deepcopy(TINY_TARGET_CONFIG), **nulls})
    assert c.n_routed_experts is None and c.n_shared_experts == 0 and c.n_group == 1
    assert (c.routed_scaling_factor, c.rope_theta, c.num_nextn_predict_layers) == (1.0, 10000.0, 0)
    assert not any(c.is_moe_layer(i) for i in range(c.num_hidden_layers))


def test_moe_layer_freq_and_first_k_dense_pick_the_moe_layers() -> None:
    """The writer, the reference and the loader share `is_moe_layer`, so they agreed with each
    other whatever it said."""
    c = TargetConfig.from_hf(dict(copy.deepcopy(TINY_TARGET_CONFIG), num_hidden_layers=6, first_k_dense_replace=1,
                                  moe_layer_freq=2))
    assert [c.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    all_dense = TargetConfig.from_hf(dict(copy.deepcopy(TINY_TARGET_CONFIG), first_k_dense_replace=3))
    assert not any(all_dense.is_moe_layer(i) for i in range(3))


@pytest.mark.parametrize(("change", "field"), [
    ({"vocab_size": 0}, "vocab_size"),
    ({"moe_layer_freq": 0}, "moe_layer_freq"),
    ({"eos_token_id": 512}, "eos_token_id"),                      # == vocab_size: a token never emitted
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),               # rope rotates pairs
    ({"n_group": 16, "topk_group": 8}, "n_group"),                 # one expert a group: no top-2 group score
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),           # more than the kept groups' 2 x 4 experts
    ({"topk_group": 5}, "topk_group"),                             # more groups kept than the 4 there are
    ({"moe_intermediate_size": 48, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                            "strategy": "group", "group_size": 32}}}}}, "moe_intermediate_size"),
    ({"scoring_func": "softmax"}, "scoring_func"),                 # DeepSeek-V2's routing: other experts, weights
    ({"topk_method": "greedy"}, "topk_method"),                    # no group-limited selection
    ({"eos_token_id": -1}, "eos_token_id"),                        # an id no token has
    ({"eos_token_id": [1, -1]}, "eos_token_id"),
    ({"q_lora_rank": True}, "q_lora_rank"),                        # a JSON boolean is no rank
    ({"n_routed_experts": True}, "n_routed_experts"),
])
def test_a_target_config_the_model_would_serve_wrongly_is_refused_by_field(change: dict, field: str) -> None:
    with pytest.raises(CheckpointError, match=f"field '{re.escape(field)}'"):
        TargetConfig.from_hf({**copy.deepcopy(TINY_TARGET_CONFIG), **change})


def _demo_drafter_config() -> dict:
    return json.loads(Path("models/demo/drafter/config.json").read_text())


def test_a_drafters_head_dim_defaults_to_hidden_over_query_heads() -> None:
    """Not over the key-value heads: a GQA drafter without `head_dim` failed at its weights with
    a shape error naming neither."""
    cfg = {k: v for k, v in _demo_drafter_config().items() if k != "head_dim"}   # hidden 256, 8 heads, 4 kv heads
    assert DraftConfig.from_hf(cfg).head_dim == 32


@pytest.mark.parametrize(("change", "needle"), [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"head_dim": 31}, "head_dim"),
    ({"block_size": 1}, "block_size"),
    ({"intermediate_size": 0}, "intermediate_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),    # dropped, not applied
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures"),                # another model's config
    ({"dflash_config": {"mask_token_id": 4096, "target_layer_ids": [1, 3, 4]}}, "mask_token_id"),   # == vocab_size
    ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 3, 6]}}, "target_layer_ids"),   # == the depth
    ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [-1, 3, 4]}}, "target_layer_ids"),  # Python's last
    ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": []}}, "target_layer_ids"),
])
def test_a_drafter_config_of_impossible_shapes_is_refused(change: dict, needle: str) -> None:
    """Each would load a drafter that cannot work: an empty MLP, no layers, a rope other than its
    training's, a mask id past the embedding, features of a layer the target does not have (or
    of its last, for -1), or fail on max([]) without naming the field."""
    with pytest.raises(CheckpointError, match=needle):
        DraftConfig.from_hf({**_demo_drafter_config(), **change})


def test_drafter_fields_left_out_or_null_take_their_defaults() -> None:
    """One key-value head a query head, eps 1e-6, theta 10000, 32768 positions, as transformers'
    Qwen3 config has them, whether a field is left out or written as null (as the target's reader
    takes null); the target's depth may sit in dflash_config and is then checked. A wrong default
    would build other shapes or numerics than the checkpoint's without an error."""
    fields = ("num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings", "num_target_layers")
    base = {k: v for k, v in _demo_drafter_config().items() if k not in fields}
    dflash = {**base["dflash_config"], "num_target_layers": 6}
    for cfg in ({**base, "dflash_config": dflash}, {**base, "dflash_config": dflash, **dict.fromkeys(fields[:4])}):
        c = DraftConfig.from_hf(cfg)
        assert c.num_key_value_heads == c.num_attention_heads == 8
        assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings, c.num_target_layers) == (1e-6, 10000.0, 32768, 6)
    with pytest.raises(CheckpointError, match="target_layer_ids"):
        DraftConfig.from_hf({**base, "dflash_config": {**dflash, "target_layer_ids": [1, 3, 6]}})


def _pairing(tmp_path: Path, drafter_changes: dict, target_layers: int):
    """`check_pairing` of the demo drafter, changed so, with the demo target of that depth."""
    target, drafter = tmp_path / "t", tmp_path / "d"
    target.mkdir()
    drafter.mkdir()
    config = json.loads(Path("models/demo/config.json").read_text())
    (target / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=target_layers)))
    (drafter / "config.json").write_text(json.dumps({**_demo_drafter_config(), **drafter_changes}))
    return lambda: check_pairing(drafter, target)


def test_a_drafter_trained_on_a_target_of_another_depth_is_refused(tmp_path) -> None:
    """Its layer ids (1, 3, 4) are in range of an 8-layer target too: it drafted from other layers'
    features, accepted nothing, and said nothing."""
    with pytest.raises(CheckpointError, match="num_target_layers"):
        _pairing(tmp_path, {}, 8)()


def test_a_drafter_reading_the_layer_past_the_targets_last_is_refused(tmp_path) -> None:
    check = _pairing(tmp_path, {"num_target_layers": None,
                                "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 3, 6]}}, 6)
    with pytest.raises(CheckpointError, match="target_layer_ids"):
        check()


def test_a_wrapper_s_text_config_must_be_an_object_and_lends_its_top_level_fields(tmp_path: Path) -> None:
    """A kimi_k25 wrapper whose text_config is a string or list is named (not a ValueError from
    dict()); its top-level tie_word_embeddings, like its eos id, is the language model's."""
    for text in ("deepseek_v3", [["model_type", "deepseek_v3"]]):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text}))
        with pytest.raises(CheckpointError, match="field 'text_config' of a kimi_k25 config must be an object"):
            read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "kimi_k25", "tie_word_embeddings": True, "eos_token_id": 7,
        "text_config": {"model_type": "deepseek_v3", "vocab_size": 9}}))
    got = read_config(tmp_path)
    assert got == {"model_type": "deepseek_v3", "vocab_size": 9, "tie_word_embeddings": True, "eos_token_id": 7}


def test_a_json_file_that_cannot_be_read_is_a_checkpoint_error_and_a_missing_one_is_no_lfs_pointer(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"missing\.json: cannot read \(No such file or directory\)"):
        read_json_object(tmp_path / "missing.json")
    with pytest.raises(CheckpointError, match="cannot read"):
        read_json_object(tmp_path)   # a directory
    refuse_lfs_pointer(tmp_path / "missing.json")   # the caller's own read names it


def test_rope_parameters_must_be_an_object_and_a_rope_theta_inside_the_old_scaling_is_no_disagreement() -> None:
    """transformers 5 writes rope_theta inside the scaling object too; an agreeing pair of the two
    forms is read, a list where the object goes is named."""
    with pytest.raises(CheckpointError, match="'rope_parameters' must be an object"):
        with_rope_parameters({"rope_parameters": []}, "config.json")
    yarn = {"rope_type": "yarn", "factor": 32.0, "rope_theta": 50000.0}
    out = with_rope_parameters({"rope_scaling": dict(yarn), "rope_parameters": dict(yarn)}, "config.json")
    assert out["rope_theta"] == 50000.0 and out["rope_scaling"] == {"rope_type": "yarn", "factor": 32.0}


def test_the_shared_weights_digest_tells_another_model_of_the_same_shapes_apart(tmp_path: Path) -> None:
    """What a draft and its verifier compare at the handshake: the same checkpoint anywhere gives
    the same digest, another one of the same shapes another, one without the tensors none."""
    import json

    import torch
    from safetensors.torch import save_file

    from services.common.checkpoint import shared_weights_digest

    def target(name: str, seed: int, tensors=("model.embed_tokens.weight", "lm_head.weight")) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 300}))
        gen = torch.Generator().manual_seed(seed)
        save_file({t: torch.randn(300, 64, generator=gen).to(torch.bfloat16) for t in tensors} |
                  {"model.norm.weight": torch.ones(64)}, str(path / "model.safetensors"))
        return path
    base, copy, tuned = target("base", 1), target("copy", 1), target("tuned", 2)
    assert len(shared_weights_digest(base)) == 16
    assert shared_weights_digest(base) == shared_weights_digest(copy) != shared_weights_digest(tuned)
    assert shared_weights_digest(target("tied", 1, ("model.embed_tokens.weight",))) not in ("", shared_weights_digest(base))
    assert shared_weights_digest(target("none", 1, ())) == ""
