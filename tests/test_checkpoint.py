"""Checkpoint reading/writing and the errors a bad target checkpoint produces."""

import json
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
from services.verifier.config import TargetConfig, read_target_config
from services.verifier.make_target import write_random_target
from services.verifier.model import TargetModel
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
    assert len(set(index["weight_map"].values())) > 1
    for d in ("one", "many"):
        got = load_tensors(tmp_path / d)
        assert got.keys() == tensors.keys()
        assert all(torch.equal(got[k], v) for k, v in tensors.items())
        assert load_tensors(tmp_path / d, names=["t3"]).keys() == {"t3"}
        assert load_tensors(tmp_path / d, prefix="t").keys() == {f"t{i}" for i in range(5)}
    with pytest.raises(CheckpointError, match="missing tensor.*nope"):
        load_tensors(tmp_path / "many", names=["t1", "nope"])


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


def test_wrong_shape_names_file_and_tensor(target_dir: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    _rewrite_tensors(target_dir, lambda t: t.__setitem__(name, torch.zeros(64, 100, dtype=torch.bfloat16)))
    with pytest.raises(CheckpointError, match=rf"{SINGLE_FILE}: tensor {name} has shape \(64, 100\), config implies \(64, 128\)"):
        TargetModel.load(target_dir)
    with pytest.raises(CheckpointError, match=name):
        ReferenceModel.load(target_dir)


def test_packed_weight_must_be_int32(target_dir: Path) -> None:
    name = "model.layers.1.mlp.experts.3.up_proj.weight_packed"
    _rewrite_tensors(target_dir, lambda t: t.__setitem__(name, t[name].to(torch.int64)))
    with pytest.raises(CheckpointError, match=f"{name} must be int32"):
        TargetModel.load(target_dir)


def test_weight_shape_mismatch(target_dir: Path) -> None:
    name = "model.layers.2.mlp.experts.0.down_proj.weight_shape"
    _rewrite_tensors(target_dir, lambda t: t.__setitem__(name, torch.tensor([32, 64])))
    with pytest.raises(CheckpointError, match=rf"{name} holds \[32, 64\], config implies \[64, 32\]"):
        TargetModel.load(target_dir)


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
