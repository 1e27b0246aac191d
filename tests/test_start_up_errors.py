"""Start-up failures a user makes by configuration: each names the setting, early, without a
traceback (``SettingsError`` / ``ServiceError``, which ``ddtree serve`` prints as one line)."""

from __future__ import annotations

import asyncio
import errno
import socket
import subprocess
from pathlib import Path

import grpc
import pytest

from services.common.auth import server_credentials
from services.common.grpc_server import ServiceError, listen, new_server
from services.common.launcher import free_port
from services.common.metrics import Metrics, serve_metrics
from services.common.settings import SchedulerSettings, SettingsError
from services.scheduler.router import Router
from services.common.tokenizer_files import load_tokenizer


def test_a_port_in_use_is_refused_not_shared() -> None:
    """gRPC's default SO_REUSEPORT let a second server bind a port in use and share its calls."""
    async def run() -> None:
        first, _ = new_server([])
        port = listen(first, "127.0.0.1:0", "verifier.port")
        await first.start()
        try:
            second, _ = new_server([])
            with pytest.raises(SettingsError, match=r"scheduler\.port: cannot listen on 127\.0\.0\.1:%d" % port):
                listen(second, f"127.0.0.1:{port}", "scheduler.port")
        finally:
            await first.stop(0)
    asyncio.run(run())


def test_a_busy_port_is_found_before_the_slow_work() -> None:
    """Each service checks its port first (the real bind waits until it can serve: a port bound
    early accepts connections whose calls hang), so a busy one fails in a second, not after the
    weights load."""
    from services.common.grpc_server import check_port_free

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(SettingsError, match=r"verifier\.port: cannot listen on 127\.0\.0\.1:%d" % held.getsockname()[1]):
            check_port_free("127.0.0.1", held.getsockname()[1], "verifier.port")
    check_port_free("127.0.0.1", 0, "verifier.port")  # any free port: nothing to check


def test_a_busy_metrics_port_names_the_setting() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(SettingsError, match=r"draft\.metrics_port: cannot listen"):
            serve_metrics(Metrics("draft"), "127.0.0.1", held.getsockname()[1])


def test_a_host_that_is_no_address_here_is_said_against_the_host_setting(monkeypatch) -> None:
    """`draft.host = nonexistent.invalid` failed the start as `draft.port: cannot listen ...`, the
    port being fine; so did an address of another machine."""
    from services.common.grpc_server import check_port_free

    other = "192.0.2.1"   # TEST-NET-1: no machine's own address (where non-local binds are off, as by default)
    real_bind = socket.socket.bind

    def bind(self, address):
        if address[0] == other:
            raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
        return real_bind(self, address)
    monkeypatch.setattr(socket.socket, "bind", bind)
    with pytest.raises(SettingsError, match=r"^verifier\.host: cannot listen on '192\.0\.2\.1': .* \(a name or address "
                                            r"of this machine\)$"):
        check_port_free(other, 50999, "verifier.port")
    with pytest.raises(SettingsError, match=r"^draft\.host: cannot listen on '192\.0\.2\.1'"):
        serve_metrics(Metrics("draft"), other, 50998)
    with pytest.raises(SettingsError, match=r"^--host/--port: cannot listen on '192\.0\.2\.1'"):
        check_port_free(other, 50999, "--host/--port")
    with pytest.raises(SettingsError, match=r"^draft\.host: cannot listen on '192\.0\.2\.1'"):
        check_port_free(other, 0, "draft.port")   # any free port: the host is checked all the same
    check_port_free("127.0.0.1", 0, "draft.port")

    def unknown(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    with pytest.raises(SettingsError, match=r"^scheduler\.host: cannot listen on 'nonexistent\.invalid': Name or service "
                                            r"not known"):
        check_port_free("nonexistent.invalid", 50051, "scheduler.port")
    with pytest.raises(SettingsError, match=r"^scheduler\.host: cannot listen on 'nonexistent\.invalid'"):
        serve_metrics(Metrics("scheduler"), "nonexistent.invalid", 9100)


def test_a_host_with_an_empty_label_is_said_against_the_host_setting() -> None:
    """getaddrinfo encodes a name with IDNA, which raises UnicodeError (no OSError) for an empty
    label: `ddtree up --host 127.0.0..1` ended in a traceback and exit 1, and the scheduler's DNS
    discovery of `dns:draft..svc:50052` raised where an unresolvable name is left out."""
    from services.common.grpc_server import check_port_free
    from services.scheduler.router import discover

    with pytest.raises(SettingsError, match=r"^scheduler\.host: cannot listen on '127\.0\.0\.\.1': not a host name"):
        check_port_free("127.0.0..1", 50051, "scheduler.port")
    with pytest.raises(SettingsError, match=r"^draft\.host: cannot listen on 'a\.\.b'"):
        serve_metrics(Metrics("draft"), "a..b", 9100)
    failed: list[str] = []
    assert discover(["dns:draft..svc:50052", "10.0.0.9:1"], failed) == ["10.0.0.9:1"]
    assert failed == ["dns:draft..svc:50052"]


def test_tls_files_are_checked_before_anything_starts(tmp_path) -> None:
    with pytest.raises(SettingsError, match=r"scheduler\.tls_cert: cannot read"):
        server_credentials(str(tmp_path / "missing.pem"), str(tmp_path / "missing.key"))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(SettingsError, match=r"scheduler\.tls_cert: .* is not a PEM certificate"):
        server_credentials(str(junk), str(junk))


def test_a_tls_key_of_another_certificate_or_with_a_passphrase_names_the_setting(tmp_path) -> None:
    """gRPC itself only fails to bind the port on these, which read as a port in use."""
    def pair(name: str, *extra: str, bits: int = 2048) -> tuple[str, str]:
        cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", f"rsa:{bits}", "-days", "1", "-subj", "/CN=localhost",
                        "-keyout", str(key), "-out", str(cert), *extra], check=True, capture_output=True)
        return str(cert), str(key)
    cert, key = pair("a", "-nodes")
    other_cert, _ = pair("b", "-nodes")
    server_credentials(cert, key)
    server_credentials(*pair("weak", "-nodes", bits=1024))   # gRPC serves it: the host OpenSSL's level is not its
    with pytest.raises(SettingsError, match=r"scheduler\.tls_key: .* does not go with scheduler\.tls_cert"):
        server_credentials(other_cert, key)
    locked_cert, locked_key = pair("c", "-passout", "pass:secret")
    with pytest.raises(SettingsError, match=r"scheduler\.tls_key: .* is encrypted"):
        server_credentials(locked_cert, locked_key)


def test_a_missing_tokenizer_is_refused_and_empty_means_token_ids_only(tmp_path) -> None:
    with pytest.raises(SettingsError, match=r"scheduler\.tokenizer_path: no tokenizer at"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(SettingsError, match=r"scheduler\.tokenizer_path: .* is not a tokenizer"):
        load_tokenizer(str(tmp_path))
    assert load_tokenizer("") is None
    assert load_tokenizer("models/demo") is not None


def test_no_draft_replica_says_why_for_each_address() -> None:
    """Before: 'no draft replica answered within 120 s' whatever the cause, even after 3 s."""
    async def run(addresses: tuple[str, ...], timeout_s: float) -> str:
        from services.common.metrics import Metrics
        router = Router(SchedulerSettings(draft_addresses=addresses), Metrics("scheduler"))
        with pytest.raises(ServiceError) as info:
            await router.start(timeout_s=timeout_s)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        return info.value.message

    closed = f"127.0.0.1:{free_port()}"
    msg = asyncio.run(run((closed,), 0.5))
    assert msg.startswith("scheduler.draft_addresses:") and f"{closed}: nothing answered within" in msg

    async def wrong_service() -> str:  # a server that is not a draft (a verifier, say) answers UNIMPLEMENTED
        server, _ = new_server([])
        port = listen(server, "127.0.0.1:0", "verifier.port")
        await server.start()
        try:
            return await run((f"127.0.0.1:{port}",), 5.0)
        finally:
            await server.stop(0)
    assert "UNIMPLEMENTED" in asyncio.run(wrong_service())
    assert "no dns: name resolved" in asyncio.run(run(("dns:no-such-host.invalid:50052",), 0.5))


def test_the_schedulers_wait_for_a_draft_is_its_setting() -> None:
    """`scheduler.draft_wait_s`: a scheduler started before its drafts waited a fixed 120 s."""
    import os
    import sys
    import time

    closed = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "DDTREE_SCHEDULER_DRAFT_ADDRESSES": closed, "DDTREE_SCHEDULER_DRAFT_WAIT_S": "1.5",
           "DDTREE_SCHEDULER_PORT": str(free_port()), "DDTREE_SCHEDULER_TOKENIZER_PATH": ""}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "services.cli", "serve", "scheduler"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and f"{closed}: nothing answered within 2 s" in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - t0 < 30
    with pytest.raises(SettingsError, match=r"scheduler\.draft_wait_s"):
        SchedulerSettings(draft_wait_s=0)


@pytest.mark.parametrize("address", ["dns:draft", "localhost", "draft:port"])
def test_a_draft_address_without_a_port_is_refused(address) -> None:
    with pytest.raises(SettingsError, match=r"scheduler\.draft_addresses"):
        SchedulerSettings(draft_addresses=(address,))


def test_a_checkpoint_directory_without_one_names_its_setting(tmp_path) -> None:
    import torch

    from services.common.checkpoint import CheckpointError
    from services.common.settings import VerifierSettings
    from services.draft.proposer import load_proposer
    from services.verifier.server import build_engine

    with pytest.raises(CheckpointError, match=rf"verifier\.model_path: no checkpoint at {tmp_path}"):
        build_engine(VerifierSettings(model_path=str(tmp_path), device="cpu"))
    with pytest.raises(CheckpointError, match=rf"draft\.drafter_path: no checkpoint at {tmp_path}"):
        load_proposer(str(tmp_path), "models/demo", torch.float32, "cpu")
    with pytest.raises(CheckpointError, match=rf"draft\.target_path: no checkpoint at {tmp_path}"):
        load_proposer("models/demo/drafter", str(tmp_path), torch.float32, "cpu")


def test_a_damaged_weights_file_is_a_checkpoint_error(tmp_path) -> None:
    import shutil

    from services.common.checkpoint import CheckpointError, load_tensors

    shutil.copy("models/demo/config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        load_tensors(tmp_path)


def test_a_verifier_address_without_a_port_is_refused() -> None:
    from services.common.settings import DraftSettings

    with pytest.raises(SettingsError, match=r"draft\.verifier_address"):
        DraftSettings(verifier_address="verifier")


def test_a_context_past_the_model_is_refused() -> None:
    from services.common.settings import VerifierSettings
    from services.verifier.server import build_engine

    from services.verifier import server

    loaded = []
    real = server.TargetModel.load
    server.TargetModel.load = lambda *a, **k: loaded.append(1) or real(*a, **k)
    try:   # refused from the config, before the weights (minutes on a large model): none loaded
        with pytest.raises(SettingsError, match=r"verifier\.max_context: 100000 is past the model's max_position_embeddings"):
            build_engine(VerifierSettings(model_path="models/demo", max_context=100000))
    finally:
        server.TargetModel.load = real
    assert loaded == []


def test_the_feature_layers_setting_is_taken_before_the_captures_and_checked() -> None:
    """``verifier.feature_layers`` is the engine's from the start (the graphs capture with it), and
    a layer the target does not have fails the start naming the setting."""
    from services.common.settings import VerifierSettings
    from services.verifier.server import build_engine
    engine = build_engine(VerifierSettings(model_path="models/demo", feature_layers=(1, 3), kv_capacity_tokens=256))
    assert engine.feature_layers == (1, 3)
    with pytest.raises(SettingsError, match=r"verifier\.feature_layers: \[99\] outside the target's \d+ layers"):
        build_engine(VerifierSettings(model_path="models/demo", feature_layers=(1, 99), kv_capacity_tokens=256))
    with pytest.raises(SettingsError, match=r"verifier\.feature_layers"):
        VerifierSettings(feature_layers=(-1,))


def test_a_draft_without_its_verifier_names_the_address_and_the_wait() -> None:
    """It used to wait a fixed 120 s without a word, then say 'verifier handshake failed: Deadline
    Exceeded' without the address."""
    import os
    import subprocess
    import sys

    address = f"127.0.0.1:{free_port()}"
    env = {"DDTREE_DRAFT_VERIFIER_ADDRESS": address, "DDTREE_DRAFT_VERIFIER_WAIT_S": "1", "DDTREE_DRAFT_PORT": "0",
           "DDTREE_DRAFT_TRANSPORT": "inline"}
    out = subprocess.run([sys.executable, "-m", "services.cli", "serve", "draft"], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr[-2000:]
    assert f"draft.verifier_address {address}: nothing answered within 1 s (draft.verifier_wait_s)" in out.stderr
    assert "verifier_connecting" in out.stdout + out.stderr


def _draft_start_against_a_demo_verifier(verifier_env: dict[str, str], draft_env: dict[str, str]):
    """`ddtree serve draft` against a `serve verifier` of the demo target (both with these
    variables besides), until the draft exits; its CompletedProcess."""
    import os
    import subprocess
    import sys

    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "protos")])}
    env.pop("DDTREE_INTERNAL_TOKEN", None)
    verifier = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "verifier"], cwd=root,
                                env={**env, "DDTREE_VERIFIER_PORT": str(port), "DDTREE_VERIFIER_KV_CAPACITY_TOKENS": "256",
                                     **verifier_env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return subprocess.run([sys.executable, "-m", "services.cli", "serve", "draft"], cwd=root,
                              env={**env, "DDTREE_DRAFT_VERIFIER_ADDRESS": f"127.0.0.1:{port}", "DDTREE_DRAFT_PORT": "0",
                                   "DDTREE_DRAFT_TRANSPORT": "inline", "DDTREE_DRAFT_VERIFIER_WAIT_S": "100", **draft_env},
                              capture_output=True, text=True, timeout=150)
    finally:
        verifier.terminate()
        verifier.wait(timeout=30)


def test_a_verifier_context_that_holds_no_prompt_beside_a_tree_fails_the_drafts_start() -> None:
    """`verifier.max_context` at or below the drafter's block + 1: the stack served, then refused
    every request with "-1 prompt tokens at most", blaming the prompt."""
    out = _draft_start_against_a_demo_verifier({"DDTREE_VERIFIER_MAX_CONTEXT": "17"}, {})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "the verifier's max context (17: verifier.max_context, or the target's max_position_embeddings) holds " \
           "no prompt beside one tree of this drafter's block_size 16: it must be at least 18" in out.stderr, out.stderr[-2000:]


def test_a_draft_reading_another_target_than_its_verifiers_fails_its_start(tmp_path) -> None:
    """draft.target_path at another model of the same shapes (here the demo target with its
    lm_head scaled): it passed every check and drafted for the wrong model, at an acceptance of 1."""
    import shutil

    from safetensors.torch import load_file, save_file

    other = tmp_path / "tuned"
    other.mkdir()
    shutil.copy("models/demo/config.json", other / "config.json")
    weights = load_file("models/demo/model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 2
    save_file(weights, str(other / "model.safetensors"))
    out = _draft_start_against_a_demo_verifier({}, {"DDTREE_DRAFT_TARGET_PATH": str(other)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "the verifier's target is another model than draft.target_path" in out.stderr, out.stderr[-2000:]


def test_the_scheduler_process_runs_without_torch() -> None:
    """The scheduler needs no torch (README, "The pieces"): `ddtree serve scheduler` must not import it,
    a second or two of start-up and a few hundred MB a process (it is imported here only when a
    settings error stops it after its imports)."""
    import os
    import subprocess
    import sys

    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
            "from services.cli import main\n"
            "sys.exit(main(['serve', 'scheduler']))\n")
    env = {**os.environ, "DDTREE_SCHEDULER_PORT": "-1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "scheduler.port" in out.stderr, out.stderr
    assert "torch imported: False" in out.stdout, out.stdout


def test_a_kv_cache_larger_than_memory_names_the_setting(tmp_path, monkeypatch) -> None:
    """The allocator's refusal is the CPU allocator's, raised here: a host that overcommits memory
    hands out the 100-billion-token cache and the kernel kills the process as it is zeroed (a
    128 GiB GPU host did), where a small CI machine's allocator refuses it."""
    from services.common.make_checkpoint import make_random_checkpoint
    from services.common.settings import VerifierSettings
    from services.verifier import server
    ckpt = make_random_checkpoint(tmp_path / "ckpt", vocab_size=512, seed=0)
    settings = VerifierSettings(model_path=str(ckpt), kv_capacity_tokens=100_000_000_000, max_context=512)

    def refused(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory")
    monkeypatch.setattr(server, "PagedKVCache", refused)
    with pytest.raises(SettingsError, match=r"verifier\.kv_capacity_tokens: 100000000000 tokens need [\d.]+ GiB on cpu "
                                            r"beside the weights, more than there is \(\[enforce fail"):
        server.build_engine(settings)


def test_a_warm_up_out_of_gpu_memory_names_the_settings(tmp_path, monkeypatch) -> None:
    """The warm-up runs the largest graph bucket's step: a GPU without room for it beside the KV
    cache fails the start naming what to lower, not with a traceback (the CPU runs no warm-up, so
    the engine's warm-up raises here as CUDA's allocator would)."""
    import torch

    from services.common.make_checkpoint import make_random_checkpoint
    from services.common.settings import VerifierSettings
    from services.verifier import server
    ckpt = make_random_checkpoint(tmp_path / "ckpt", vocab_size=512, seed=0)
    settings = VerifierSettings(model_path=str(ckpt), max_context=512, kv_capacity_tokens=4096, graph_batches=(1, 32),
                                graph_nodes=(1, 9, 33))
    engine = server.build_engine(settings)
    engine.enable_graphs(capture=False, batch_buckets=settings.graph_batches, node_buckets=settings.graph_nodes)

    def out_of_memory(budgets) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text")

    monkeypatch.setattr(engine, "warm_up", out_of_memory)
    with pytest.raises(SettingsError, match=r"lower verifier\.kv_capacity_tokens or drop the largest entry of "
                                            r"verifier\.graph_batches or verifier\.graph_nodes \(the warm-up runs 32 "
                                            r"trees of 33 nodes\)\. "
                                            r"CUDA out of memory\. Tried to allocate 2\.00 GiB$"):
        server.warm_up(engine, settings)
    engine.graphs = None   # eager verify: only the KV cache to lower
    with pytest.raises(SettingsError, match=r"a KV cache of 4096 tokens: lower verifier\.kv_capacity_tokens\. CUDA"):
        server.warm_up(engine, settings)


def test_an_ipv6_host_is_listened_on_in_brackets() -> None:
    """`host = "::"` reached gRPC as ":::PORT", refused as a port in use; so would any IPv6 host
    (a global "2001:db8::1" as much as "::"), and one in brackets already must not get two."""
    from services.common.grpc_server import host_port, listen
    assert host_port("::", 50051) == "[::]:50051" and host_port("[::1]", 1) == "[::1]:1"
    assert host_port("2001:db8::1", 50051) == "[2001:db8::1]:50051" and host_port("fe80::1", 1) == "[fe80::1]:1"
    assert host_port("127.0.0.1", 1) == "127.0.0.1:1" and host_port("verifier", 5) == "verifier:5"

    async def bind() -> int:
        server = grpc.aio.server()
        try:
            return listen(server, host_port("::1", 0), "scheduler.port")
        finally:
            await server.stop(0)
    try:
        socket.socket(socket.AF_INET6).close()
    except OSError:
        return   # no IPv6 on this host: the address form above is what counts
    assert asyncio.run(bind()) > 0


def test_ctrl_c_during_a_services_start_up_is_one_line(monkeypatch, capsys) -> None:
    """A Ctrl-C while a service loads or waits for its peers printed uvloop's traceback."""
    from services import cli

    def interrupted(coro) -> None:
        coro.close()
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_run_async", interrupted)
    assert cli.main(["serve", "scheduler"]) == 130
    assert capsys.readouterr().err == "ddtree serve scheduler: interrupted during start-up\n"


def test_a_misspelt_tree_attention_backend_fails_the_verifiers_start_by_name(monkeypatch) -> None:
    """`DDTREE_TREE_MLA_BACKEND=Hopper` passed the start-up, whose warm-up compiled nothing for
    it, and failed the first request INTERNAL with a message that named no variable."""
    import asyncio

    from kernels.tree_mla import BACKEND_ENV, backend_from_env
    from services.common.settings import SettingsError, VerifierSettings
    from services.verifier.server import serve

    monkeypatch.setenv(BACKEND_ENV, "Hopper")
    with pytest.raises(SettingsError, match="DDTREE_TREE_MLA_BACKEND='Hopper': must be 'hopper', 'triton' or"):
        asyncio.run(serve(VerifierSettings(port=0)))
    for gpu_only in ("hopper", "triton"):   # on the CPU no kernel reads it: it was ignored silently
        monkeypatch.setenv(BACKEND_ENV, gpu_only)
        with pytest.raises(SettingsError, match=f"{BACKEND_ENV}={gpu_only}: a GPU kernel, and verifier.device is cpu"):
            asyncio.run(serve(VerifierSettings(port=0)))
    for ok in ("hopper", "triton", "reference"):
        monkeypatch.setenv(BACKEND_ENV, ok)
        assert backend_from_env() == ok
    monkeypatch.setenv(BACKEND_ENV, "")
    assert backend_from_env() is None


def test_the_other_kernel_overrides_fail_the_start_by_name_where_they_do_not_parse(monkeypatch) -> None:
    """`DDTREE_PDL=false` left PDL on without a word; a `DDTREE_INT4_MOE_CONFIG` that does not
    parse (`hopper=off` read as on; `bm=x`, `gu=64x128`, `bm=7`: a bare ValueError or
    AssertionError) failed at the first fused-MoE launch, after the weights loaded."""
    import asyncio

    from kernels import pdl
    from kernels.int4_moe import CONFIG_ENV, Int4MoEConfig, config_from_env
    from services.common.settings import DraftSettings, SettingsError, VerifierSettings
    from services.draft import server as draft_server
    from services.verifier.server import kernel_overrides, serve

    for word, on in (("", True), ("1", True), ("on", True), ("TRUE", True), ("yes", True), ("0", False),
                     ("false", False), ("No", False), (" off ", False)):
        monkeypatch.setenv(pdl.ENV, word)
        assert pdl.switch_from_env() is on
    monkeypatch.setenv(pdl.ENV, "disabled")
    with pytest.raises(ValueError, match=r"DDTREE_PDL='disabled': must be 0 \(off\) or 1 \(on\)"):
        pdl.switch_from_env()
    with pytest.raises(SettingsError, match="DDTREE_PDL='disabled'"):
        asyncio.run(serve(VerifierSettings(port=0)))
    with pytest.raises(SettingsError, match="DDTREE_PDL='disabled'"):
        asyncio.run(draft_server.serve(DraftSettings(port=0)))
    monkeypatch.delenv(pdl.ENV)

    for spec, said in (("hopper=off", "hopper='off': must be 0 or 1"), ("bm=x", "bm='x': 'x' is not an integer"),
                       ("dn=64x128xfourx3", "dn='64x128xfourx3': 'four' is not an integer"),
                       ("gu=64x128", "gu='64x128': must be BLOCK_NxBLOCK_KxWARPSxSTAGES"),
                       ("gu=64x128x4x3x2", "gu='64x128x4x3x2': must be BLOCK_NxBLOCK_KxWARPSxSTAGES"),
                       ("bm=7", "block_m=7 must be a power of two"), ("tiles=3", "unknown key 'tiles'")):
        monkeypatch.setenv(CONFIG_ENV, spec)
        with pytest.raises(ValueError, match=f"^{CONFIG_ENV}='{spec}': .*{said}.*the syntax: bm=16,gu=") as info:
            config_from_env()
        assert str(info.value).count(CONFIG_ENV) == 1   # named once, also for an unknown key
        with pytest.raises(SettingsError, match=f"{CONFIG_ENV}='{spec}'"):
            asyncio.run(serve(VerifierSettings(port=0, device="cuda")))   # before the CPU build's own refusal
        assert kernel_overrides(VerifierSettings(device="cpu")) is None   # the CPU path reads no MoE config
    monkeypatch.setenv(CONFIG_ENV, "bm=32,hopper=0,gemv=true")
    assert config_from_env() == Int4MoEConfig(block_m=32, hopper=False, gemv=True)
    assert Int4MoEConfig.parse("hopper=False,swap=TRUE") == Int4MoEConfig(hopper=False, swap_ab=True)
    assert Int4MoEConfig.parse(Int4MoEConfig(hopper=False, swap_ab=False).spec()) == Int4MoEConfig(hopper=False,
                                                                                                   swap_ab=False)
    monkeypatch.setenv(CONFIG_ENV, "")
    assert config_from_env() is None


def test_the_kernels_read_ddtree_pdl_at_import_and_a_refused_word_keeps_the_default() -> None:
    """What every launch reads is `kernels.pdl.PDL`, set at import: `DDTREE_PDL=0` must turn it off
    there, and a word the start refuses must not fail an import (a bench script, a test)."""
    import os
    import subprocess
    import sys

    script = ("import importlib, os\nfrom kernels import pdl\n"
              "for word in ('0', 'false', '1', '', 'disabled'):\n"
              "    os.environ['DDTREE_PDL'] = word\n    print(word or '-', importlib.reload(pdl).PDL)\n")
    env = {k: v for k, v in os.environ.items() if k != "DDTREE_PDL"}
    out = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:5] == ["0 False", "false False", "1 True", "- True", "disabled True"]


def test_a_tokenizer_larger_than_the_models_vocabulary_fails_the_start(monkeypatch) -> None:
    """Another model's tokenizer passed the start and failed every text prompt with "prompt.token_ids[2]
    = 613 is outside the vocabulary", for a user who sent text."""
    from ddtree.v1 import common_pb2
    from services.scheduler import server
    from services.scheduler.router import limits_from_info

    stopped = []

    class Router:
        def __init__(self, settings, metrics, internal_token) -> None:
            self.limits = None

        async def start(self, wait_s):
            info = common_pb2.ModelInfo(vocab_size=512, max_context=1024, block_size=16)
            self.limits = limits_from_info(info)
            return info

        async def stop(self) -> None:
            stopped.append(1)
    monkeypatch.setattr(server, "Router", Router)
    settings = SchedulerSettings(port=0, tokenizer_path="models/demo")   # 4096 tokens
    with pytest.raises(SettingsError, match="scheduler.tokenizer_path: models/demo holds 4096 tokens, more than "
                                            "the model's vocabulary of 512"):
        asyncio.run(server.serve(settings))
    assert stopped == [1]


def test_a_tokenizer_of_another_vocabulary_than_the_drafts_target_fails_the_start(tmp_path, monkeypatch) -> None:
    """compose's `scheduler.tokenizer_path` left at the demo's while the other paths moved to another
    model served every text prompt as other tokens, without a word: the drafts now tell the digest
    of their target's tokenizer, and another vocabulary fails the start (the same one, re-saved
    elsewhere, does not)."""
    from tokenizers import Tokenizer

    from ddtree.v1 import common_pb2
    from services.common.make_checkpoint import make_random_checkpoint
    from services.common.tokenizer_files import load_tokenizer, model_tokenizer_digest, vocab_digest
    from services.scheduler import server
    from services.scheduler.router import limits_from_info

    other = make_random_checkpoint(tmp_path / "other", vocab_size=8192, seed=1)
    digest = [model_tokenizer_digest(str(other), "draft.target_path")]
    stopped = []

    class Router:
        def __init__(self, settings, metrics, internal_token) -> None:
            self.limits = None

        async def start(self, wait_s):
            info = common_pb2.ModelInfo(vocab_size=8192, max_context=1024, block_size=16, tokenizer_digest=digest[0])
            self.limits = limits_from_info(info)
            return info

        async def stop(self) -> None:
            stopped.append(1)

    class Started(Exception):
        pass

    def servicer(*args):   # past every start-up check
        raise Started
    monkeypatch.setattr(server, "Router", Router)
    monkeypatch.setattr(server, "SchedulerServicer", servicer)
    monkeypatch.setattr(server, "configure_logging", lambda *a: None)
    with pytest.raises(SettingsError, match="scheduler.tokenizer_path: models/demo is not the tokenizer of the model "
                                            "the drafts serve"):
        asyncio.run(server.serve(SchedulerSettings(port=0, metrics_port=0, tokenizer_path="models/demo")))
    assert stopped == [1]
    Tokenizer.from_file("models/demo/tokenizer.json").save(str(tmp_path / "resaved.json"), pretty=False)
    assert (tmp_path / "resaved.json").read_bytes() != Path("models/demo/tokenizer.json").read_bytes()
    digest[0] = vocab_digest(load_tokenizer("models/demo"))
    for path in ("models/demo", str(tmp_path / "resaved.json")):
        with pytest.raises(Started):
            asyncio.run(server.serve(SchedulerSettings(port=0, metrics_port=0, tokenizer_path=path)))
    digest[0] = ""   # a target directory without a tokenizer: nothing to compare
    with pytest.raises(Started):
        asyncio.run(server.serve(SchedulerSettings(port=0, metrics_port=0, tokenizer_path="models/demo")))
    assert model_tokenizer_digest(str(tmp_path), "draft.target_path") == ""


def test_a_step_whose_reply_cannot_fit_grpcs_message_fails_the_start_and_a_long_prefill_is_capped(monkeypatch) -> None:
    """The scheduler learns a token's feature bytes from its drafts; a step's reply carries the
    features of every token it commits, under gRPC's 1 GiB message cap."""
    from structlog.testing import capture_logs

    from ddtree.v1 import common_pb2
    from services.scheduler import server
    from services.scheduler.router import limits_from_info

    per_token = [1 << 20]
    stopped = []

    class Router:
        def __init__(self, settings, metrics, internal_token) -> None:
            self.limits = None

        async def start(self, wait_s):
            info = common_pb2.ModelInfo(vocab_size=512, max_context=1024, block_size=16,
                                        feature_bytes_per_token=per_token[0])
            self.limits = limits_from_info(info)
            return info

        async def stop(self) -> None:
            stopped.append(1)
    monkeypatch.setattr(server, "Router", Router)
    monkeypatch.setattr(server, "configure_logging", lambda *a: None)   # it would replace capture_logs' set-up
    with pytest.raises(SettingsError, match=r"scheduler.max_batch: 64 requests a step can commit 1024 tokens, "
                                            r"whose features \(1048576 bytes a token\) would not fit"):
        asyncio.run(server.serve(SchedulerSettings(port=0, tokenizer_path="")))
    assert stopped == [1]

    per_token[0] = 3 * 7168 * 2   # Kimi-K2's widths: a start with a warning, and then (here) a tokenizer refused
    with capture_logs() as logs, pytest.raises(SettingsError, match="tokenizer_path"):
        asyncio.run(server.serve(SchedulerSettings(port=0, max_prefill_tokens=65536, tokenizer_path="models/demo")))
    capped = [e for e in logs if e["event"] == "max_prefill_tokens_capped"]
    assert len(capped) == 1 and capped[0]["setting"] == 65536 and 20_000 < capped[0]["tokens"] < 24_000


def test_an_internal_service_reachable_beyond_loopback_says_so() -> None:
    """Draft and verifier check no token: `ddtree serve` with compose's `host = "0.0.0.0"` opened
    them to the network without a word."""
    from structlog.testing import capture_logs

    from services.common.grpc_server import warn_if_reachable

    with capture_logs() as quiet:
        warn_if_reachable("127.0.0.1", "verifier.host", False)
        warn_if_reachable("localhost", "draft.host", False)
        warn_if_reachable("0.0.0.0", "draft.host", True)   # the internal token guards it
    with capture_logs() as said:
        warn_if_reachable("0.0.0.0", "verifier.host", False)
    assert quiet == []
    assert [(e["event"], e["setting"], e["log_level"]) for e in said] == \
        [("internal_port_reachable", "verifier.host", "warning")]
    assert "private network" in said[0]["advice"]


def test_a_port_in_time_wait_is_free_and_a_bracketed_ipv6_host_is_probed() -> None:
    """gRPC binds with SO_REUSEADDR: a port whose last connection is in TIME_WAIT (a stack stopped and
    started again at once) is free to it, so the early probe must not refuse it; and "[::1]" is a
    host the settings take (`host_port` writes it so), loopback to the reachable-port warning."""
    import time

    from services.common.grpc_server import check_port_free, is_loopback

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()   # the server's side closes first: its (port, peer) pair waits in TIME_WAIT
    time.sleep(0.05)
    client.close()
    listener.close()
    check_port_free("127.0.0.1", port, "verifier.port")
    assert is_loopback("[::1]") and is_loopback("::1") and is_loopback("127.0.0.2") and not is_loopback("0.0.0.0")
    probe = socket.socket(socket.AF_INET6)
    try:
        probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    v6 = probe.getsockname()[1]
    probe.close()
    check_port_free("[::1]", v6, "draft.port")
