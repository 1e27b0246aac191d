"""Putting services on GPUs: device settings, per-service launcher environments, pinning."""

from __future__ import annotations

import pytest
import torch

from services.common.devices import pin_device
from services.common.launcher import Stack, StackSpec
from services.common.settings import DraftSettings, SettingsError, VerifierSettings, is_device, load_settings


@pytest.mark.parametrize("text,ok", [
    ("cpu", True), ("cuda", True), ("cuda:0", True), ("cuda:1", True), ("cuda:12", True),
    ("cuda1", False), ("gpu", False), ("cuda:", False), ("cuda:-1", False), ("CUDA:0", False), (" cuda", False),
])
def test_device_strings(text, ok) -> None:
    assert is_device(text) is ok


def test_verifier_and_draft_take_different_gpus_from_the_environment() -> None:
    env = {"DDTREE_VERIFIER_DEVICE": "cuda:0", "DDTREE_DRAFT_DEVICE": "cuda:1"}
    assert load_settings(VerifierSettings, None, env=env).device == "cuda:0"
    assert load_settings(DraftSettings, None, env=env).device == "cuda:1"
    with pytest.raises(SettingsError, match=r"draft\.device"):
        load_settings(DraftSettings, None, env={"DDTREE_DRAFT_DEVICE": "cuda1"})
    with pytest.raises(SettingsError, match=r"verifier\.device"):
        load_settings(VerifierSettings, None, env={"DDTREE_VERIFIER_DEVICE": "gpu:0"})


def test_service_env_layers_role_then_name_and_never_touches_addresses() -> None:
    spec = StackSpec(draft_replicas=2, scheduler_port=0, extra_env={"DDTREE_DRAFT_DEVICE": "cuda:0", "X": "base"},
                     service_env={"verifier": {"CUDA_VISIBLE_DEVICES": "1,0"},
                                  "draft": {"X": "draft"},
                                  "draft-1": {"DDTREE_DRAFT_DEVICE": "cuda:1", "DDTREE_DRAFT_PORT": "1"}})
    env = {s.name: s.env for s in Stack(spec)._plan()}
    assert env["verifier"]["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert "1,0" not in (env["draft-0"].get("CUDA_VISIBLE_DEVICES"), env["scheduler"].get("CUDA_VISIBLE_DEVICES"))
    assert (env["draft-0"]["DDTREE_DRAFT_DEVICE"], env["draft-1"]["DDTREE_DRAFT_DEVICE"]) == ("cuda:0", "cuda:1")
    assert env["draft-0"]["X"] == env["draft-1"]["X"] == "draft" and env["verifier"]["X"] == "base"
    assert env["draft-1"]["DDTREE_DRAFT_PORT"] != "1"   # the launcher's own addresses win


def test_pin_device_leaves_cpu_alone() -> None:
    assert pin_device("cpu") == torch.device("cpu")


def test_pin_device_names_the_setting_and_why_there_is_no_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(SettingsError, match=r"draft\.device: cuda:1 asked for, but this torch build has no CUDA"):
        pin_device("cuda:1", "draft.device")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(SettingsError, match=r"verifier\.device: device cuda:1 does not exist: this process sees "
                                            r"1 GPU\(s\) \(CUDA_VISIBLE_DEVICES=3\)"):
        pin_device("cuda:1", "verifier.device")


def test_rank_device_starts_at_the_configured_gpu() -> None:
    from services.verifier.ranks import rank_device
    assert [rank_device("cuda", r) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert [rank_device("cuda:1", r) for r in range(2)] == ["cuda:1", "cuda:2"]
    assert rank_device("cpu", 3) == "cpu"


def test_a_tp_rank_binds_nccl_to_the_gpu_its_model_is_on(monkeypatch) -> None:
    """`verifier.device = "cuda:4"` puts rank r on cuda:4+r; its NCCL communicator must be bound
    there too, not to cuda:r (another group's GPU in a several-group layout)."""
    import torch.distributed as dist

    from services.verifier import parallel
    from services.verifier.ranks import rank_device
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", str(d))))
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: calls.append(("store", a[:2], k["is_master"])))
    monkeypatch.setattr(parallel.TensorParallel, "_meet", lambda self, step, limit: calls.append(("meet", step)))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append(("device_id", str(k["device_id"]))))
    for rank in range(2):
        calls.clear()
        parallel.TensorParallel(rank, 2, "tcp://127.0.0.1:1", backend="nccl", device=rank_device("cuda:4", rank))
        assert calls == [("set_device", f"cuda:{4 + rank}"), ("store", ("127.0.0.1", 1), rank == 0),
                         ("meet", "joined"), ("device_id", f"cuda:{4 + rank}")]


def test_a_group_past_the_gpus_this_process_sees_is_refused_before_any_rank_starts(monkeypatch) -> None:
    """`verifier.tp` ranks take consecutive GPUs from `verifier.device`; one past the GPUs there
    died in its own start-up and the group failed UNAVAILABLE (exit 3: "may work later")."""
    import asyncio

    from services.verifier import server
    from services.verifier.ranks import check_rank_devices

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 5)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4")
    with pytest.raises(SettingsError, match=r"verifier\.tp: 4 ranks on verifier\.device = cuda:2 take cuda:2\.\.cuda:5, "
                                            r"and this process sees 5 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1,2,3,4\)"):
        check_rank_devices(VerifierSettings(tp=4, device="cuda:2"))
    check_rank_devices(VerifierSettings(tp=4, device="cuda:1"))   # cuda:1..cuda:4: there
    with pytest.raises(SettingsError, match=r"^verifier\.device: device cuda:7 does not exist: this process sees 5"):
        check_rank_devices(VerifierSettings(tp=2, device="cuda:7"))   # rank 0's own GPU: the device's fault
    with pytest.raises(SettingsError, match=r"^verifier\.device: device cuda:5 does not exist"):
        check_rank_devices(VerifierSettings(tp=2, device="cuda:5"))   # one past the last GPU
    check_rank_devices(VerifierSettings(tp=5, device="cuda"))
    check_rank_devices(VerifierSettings(tp=1, device="cuda:7"))   # one rank: pin_device's to name
    check_rank_devices(VerifierSettings(tp=8, device="cpu"))
    spawned = []
    monkeypatch.setattr(server, "spawn_workers", lambda *a: spawned.append(a))
    with pytest.raises(SettingsError, match=r"verifier\.tp: 6 ranks"):
        asyncio.run(server.serve(VerifierSettings(tp=6, device="cuda", port=0)))
    monkeypatch.setattr(torch.version, "cuda", None)   # a CPU build: said as pin_device says it
    with pytest.raises(SettingsError, match=r"verifier\.device: cuda asked for, but this torch build has no CUDA"):
        check_rank_devices(VerifierSettings(tp=2, device="cuda"))
    assert spawned == []
