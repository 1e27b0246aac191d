"""The compose deployment agrees with the launcher's topology and the settings the services read."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from services import healthcheck
from services.common.settings import DraftSettings, SchedulerSettings, VerifierSettings, load_settings
from services.scheduler import router
from services.scheduler.router import discover

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose" / "docker-compose.yml"
CONFIG = ROOT / "compose" / "ddtree.toml"
SETTINGS = {"scheduler": SchedulerSettings, "draft": DraftSettings, "verifier": VerifierSettings}


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE.read_text())


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("dns:").rpartition(":")
    return host, int(port)


def test_services_and_commands_match_the_launcher(compose):
    services = {k: v for k, v in compose["services"].items() if k != "internal-token"}
    assert set(services) == set(SETTINGS)
    for name, svc in services.items():
        assert svc["command"][0] == name and svc["command"][1:] == ["--config", "/etc/ddtree/ddtree.toml"]
        assert "shm_size" not in svc and "healthcheck" in svc
    for name in ("draft", "verifier"):   # their rings in the host's /dev/shm (shm_size is ignored there)
        assert services[name]["ipc"] == "host"
    assert "ipc" not in services["scheduler"]   # the published one has no business in the host's IPC namespace
    for name in ("draft", "verifier"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]


def test_the_bearer_token_reaches_the_scheduler_alone(compose):
    services = compose["services"]
    assert services["scheduler"]["environment"]["DDTREE_SCHEDULER_AUTH_TOKEN"] == "${DDTREE_AUTH_TOKEN:-}"
    assert not any("AUTH_TOKEN" in key for name in ("draft", "verifier") for key in services[name]["environment"])


def test_the_three_services_read_the_internal_token_made_once_before_them(compose, tmp_path, capsys):
    """Draft and verifier ports refuse calls without the token; the scheduler and drafts present it.
    One run of `ddtree make-token` writes it into a volume they all mount (kept on later runs, so a
    restarted service reads what its peers hold)."""
    from services.cli import main

    services = compose["services"]
    maker = services["internal-token"]
    assert maker["entrypoint"][:2] == ["ddtree", "make-token"] and "restart" not in maker
    path = maker["entrypoint"][2]
    volume = next(v for v in maker["volumes"] if v.startswith("internal-token:"))
    assert path.startswith(volume.split(":")[1] + "/") and "internal-token" in compose["volumes"]
    for name in SETTINGS:
        svc = services[name]
        assert svc["environment"]["DDTREE_INTERNAL_TOKEN_FILE"] == path
        assert f"{volume}:ro" in svc["volumes"]
        assert svc["depends_on"]["internal-token"] == {"condition": "service_completed_successfully"}
    token = tmp_path / "token"
    assert main(["make-token", str(token)]) == 0
    first = token.read_text()
    assert len(first.strip()) >= 32 and token.stat().st_mode & 0o077 == 0
    assert main(["make-token", str(token)]) == 0 and token.read_text() == first   # kept
    token.write_text("")
    assert main(["make-token", str(token)]) == 2   # an unusable file is said now, not by three services
    assert "docker volume rm ddtree_internal-token" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token"]   # its own temporary files gone
    assert main(["make-token", str(tmp_path / "no-such-dir" / "token")]) == 2
    capsys.readouterr()
    assert main(["make-token", str(tmp_path)]) == 2   # a folder (a volume's mount point), not the file in it
    assert f"{tmp_path} is a directory: give the token file's path (e.g. {tmp_path / 'token'})" in capsys.readouterr().err


def test_the_build_context_leaves_out_what_the_image_does_not_copy():
    """The context is the repository: without a .dockerignore every build sent the virtualenv
    (gigabytes) and the git history to the daemon."""
    ignored = {line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")}
    assert {".git", ".venv", "models/random"} <= ignored
    copied = re.findall(r"^COPY (\S+)", (ROOT / "compose" / "Dockerfile").read_text(), flags=re.M)
    assert copied and not any(c.split("/")[0] in ignored for c in copied)


def test_gpu_services_keep_compiled_kernels_in_a_named_volume(compose):
    """The Triton cache outlives containers, so a restart or a new draft replica loads the
    kernels it would otherwise compile for tens of seconds at start-up."""
    assert "triton-cache" in compose["volumes"]
    for name in ("draft", "verifier"):
        svc = compose["services"][name]
        cache = svc["environment"]["TRITON_CACHE_DIR"]
        assert f"triton-cache:{cache}" in svc["volumes"]
    # The published one does not share it: compiled kernels it could write there, they would load.
    assert not any("triton-cache" in v for v in compose["services"]["scheduler"]["volumes"])


def test_the_step_sockets_are_files_in_one_in_memory_volume_the_three_services_mount(compose):
    """Each container has its own network namespace, where another's abstract socket names do not
    reach: the verifier's and the drafts' step sockets are files in a folder every service mounts at
    the same path, so a draft streams its steps to the verifier, and a scheduler lane to its draft,
    on a Unix socket instead of gRPC."""
    services = compose["services"]
    volume = compose["volumes"]["step-sockets"]
    assert volume["driver_opts"]["type"] == "tmpfs"   # nothing outlives the stack
    folders = set()
    for name in SETTINGS:
        svc = services[name]
        mounts = [v for v in svc["volumes"] if v.startswith("step-sockets:")]
        assert len(mounts) == 1 and not mounts[0].endswith(":ro"), name   # a socket file is made there
        folders.add(mounts[0].split(":")[1])
        env = {k: str(v) for k, v in svc["environment"].items()}
        if name != "scheduler":
            settings = load_settings(SETTINGS[name], CONFIG, env=env)
            assert settings.step_socket and settings.step_socket_dir == mounts[0].split(":")[1]
    assert len(folders) == 1


def test_only_the_scheduler_is_published_and_on_loopback_by_default(compose):
    services = compose["services"]
    assert "ports" not in services["draft"] and "ports" not in services["verifier"]
    (mapping,) = services["scheduler"]["ports"]
    assert mapping.startswith("${DDTREE_PUBLISH_ADDR:-127.0.0.1}:")
    sched = load_settings(SchedulerSettings, CONFIG, env={})
    assert mapping.endswith(f":{sched.port}:{sched.port}")


def test_config_file_is_valid_for_every_service_and_addresses_agree(compose):
    s = {name: load_settings(cls, CONFIG, env={}) for name, cls in SETTINGS.items()}
    for address in s["scheduler"].draft_addresses:
        host, port = _host_port(address)
        assert host == "draft" and port == s["draft"].port
    host, port = _host_port(s["draft"].verifier_address)
    assert host == "verifier" and port == s["verifier"].port
    for name in SETTINGS:   # the one-shot internal-token maker serves nothing
        svc = compose["services"][name]
        env = svc["environment"]
        # The probe reads its service's port where the service does: one changed in ddtree.toml is
        # followed (a fixed DDTREE_HEALTH_PORT kept probing the old one: unhealthy, nothing after it started).
        assert env["DDTREE_HEALTH_SERVICE"] == name and "DDTREE_HEALTH_PORT" not in env
        assert env["DDTREE_HEALTH_CONFIG"] == "/etc/ddtree/ddtree.toml"
        assert "./ddtree.toml:/etc/ddtree/ddtree.toml:ro" in svc["volumes"]
        assert healthcheck.service_port(name, str(CONFIG), {}) == str(s[name].port)
        for key in env:   # every DDTREE_<SERVICE>_<FIELD> the file sets must be a real setting
            m = re.fullmatch(r"DDTREE_(SCHEDULER|DRAFT|VERIFIER)_(\w+)", key)
            if m:
                fields = {f.name for f in dataclasses.fields(SETTINGS[m.group(1).lower()])}
                assert m.group(2).lower() in fields, key
    assert s["scheduler"].host == "0.0.0.0"   # inside its container; publishing decides exposure


def test_the_scheduler_has_its_stop_grace_before_compose_kills_it(compose):
    """Compose sends SIGTERM, then SIGKILL after the service's stop_grace_period (10 s unless set):
    the scheduler's running requests must get their `stop_grace_s` and the stop after it."""
    period = compose["services"]["scheduler"]["stop_grace_period"]
    seconds = float(re.fullmatch(r"(\d+)s", period).group(1))
    assert seconds >= load_settings(SchedulerSettings, CONFIG, env={}).stop_grace_s + 10
    assert compose["services"]["scheduler"]["depends_on"]["draft"]   # compose stops it before the draft


def test_a_mounted_checkpoint_reaches_the_scheduler_too(compose):
    """The scheduler's `volumes:` replaces the shared list: the commented checkpoint mount must be
    offered in both, or a tokenizer_path under /models fails the scheduler (restarting for ever)."""
    text = COMPOSE.read_text()
    assert text.count("# - /path/to/checkpoints:/models:ro") == 2
    shared, scheduler = text.split("\n  scheduler:\n")
    assert "# - /path/to/checkpoints:/models:ro" in shared and "# - /path/to/checkpoints:/models:ro" in scheduler


def test_the_scheduler_is_not_pid_1(compose):
    """As PID 1 it ignored SIGTERM until it served (the kernel drops what PID 1 has no handler for):
    a stop while it waited for its drafts took the whole stop_grace_period, then SIGKILL. Draft
    and verifier share the host's PID namespace, so they are not PID 1."""
    services = compose["services"]
    assert services["scheduler"]["init"] is True
    assert all(services[name]["pid"] == "host" for name in ("draft", "verifier"))


def test_dns_discovery_lists_every_address():
    assert discover(["dns:localhost:50052", "10.0.0.9:1"])[-1] == "10.0.0.9:1"
    assert any(a.endswith(":50052") for a in discover(["dns:localhost:50052"]))


def test_a_slow_dns_lookup_leaves_the_event_loop_running(monkeypatch):
    """The scheduler looks for new replicas every few seconds; a resolver that takes its time
    must not hold up the streams it serves."""
    def slow_getaddrinfo(host, port, *args, **kwargs):
        time.sleep(0.5)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", port))]
    monkeypatch.setattr(router.socket, "getaddrinfo", slow_getaddrinfo)

    async def scenario() -> tuple[list[str], float]:
        gaps, last = [], time.monotonic()

        async def tick() -> None:
            nonlocal last
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now
        ticker = asyncio.create_task(tick())
        found = await router.resolve(["dns:draft:50052"])
        ticker.cancel()
        return found, max(gaps)

    found, gap = asyncio.run(scenario())
    assert found == ["10.1.2.3:50052"]
    assert gap < 0.25, gap   # inline, the loop would stop for the whole 0.5 s look-up


@pytest.mark.skipif(shutil.which("docker") is None or subprocess.run(
    ["docker", "compose", "version"], capture_output=True).returncode != 0, reason="docker compose not installed")
def test_docker_compose_config_accepts_the_file():
    subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"], check=True)


def test_every_service_reads_the_settings_file_as_edited(compose):
    """The image holds a copy of compose/ddtree.toml from its build; a mount makes an edit count
    without a rebuild (it was silently ignored)."""
    for name in SETTINGS:
        svc = compose["services"][name]
        assert "./ddtree.toml:/etc/ddtree/ddtree.toml:ro" in svc["volumes"], name
        assert "/etc/ddtree/ddtree.toml" in svc["command"], name


def test_the_image_can_build_tritons_launcher():
    """Triton compiles a small C launcher (against Python's headers) the first time a kernel runs on
    a GPU: an image without a C compiler failed every Triton kernel at its first launch."""
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    installs = " ".join(line for line in dockerfile.replace("\\\n", " ").splitlines() if "apt-get install" in line)
    for package in ("gcc", "libc6-dev", "python3-dev"):
        assert package in installs.split(), package


def test_the_gpu_services_can_open_each_others_cuda_ipc_rings(compose):
    """CUDA IPC between containers needs one IPC and one PID namespace: with `ipc: host` alone,
    opening the draft's ring failed and the stream fell back to shared memory without a word."""
    for name in ("draft", "verifier"):
        svc = compose["services"][name]
        assert svc["ipc"] == "host" and svc["pid"] == "host", name


def test_the_image_installs_the_torch_and_triton_the_kernels_were_measured_on():
    """`pip install '.[gpu]'` took whatever torch and Triton PyPI had on the build's day; the
    dependencies install before the code is copied, so an edit does not fetch them again."""
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    pins = dict(line.split("==") for line in (ROOT / "compose" / "gpu-constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert set(pins) == {"torch", "triton", "nvidia-nccl-cu13"}
    # NCCL comes with torch: the gpu extra's nvidia-nccl-cu12 shipped the same libnccl.so.2 and,
    # installed after torch 2.11's cu13 one, replaced it (any flavour named there would, for a torch
    # of the other CUDA).
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    assert not [r for r in requirements if r.startswith("nvidia-nccl")]
    install = dockerfile.index("pip install -c gpu-constraints.txt")
    assert install < dockerfile.index("COPY services") < dockerfile.index("pip install --no-deps '.'")
    # Only what the dependency list is read from goes before it (a README edit refetched it all).
    before = [src for line in re.findall(r"^COPY (.+)$", dockerfile[:install], flags=re.M) for src in line.split()[:-1]]
    assert sorted(before) == ["compose/gpu-constraints.txt", "pyproject.toml"], before
    assert "NVIDIA_VISIBLE_DEVICES=" not in dockerfile   # the reservations choose the GPUs
    makefile = (ROOT / "Makefile").read_text()
    assert "-c compose/gpu-constraints.txt" in makefile


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="the CPU branch of the install runs without a GPU")
def test_make_install_stops_where_the_cpu_torch_cannot_be_installed(tmp_path):
    """The CPU torch step's failure was ignored: the project's install went on and pulled PyPI's
    multi-GB CUDA torch, and `make` (so `make test`, CI) went on green on it. Then, with the local
    attempt's errors thrown away, a full disk showed in CI only as the CPU index's network errors."""
    for name in ("Makefile", "pyproject.toml", "compose/gpu-constraints.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    fake = tmp_path / "python3"
    fake.write_text("""#!/bin/sh
case "$*" in
  *"sys.version_info"*) exit 0;;
  "-m venv "*) mkdir -p "$3/bin"; rm -f "$3/bin/python"; cp "$0" "$3/bin/python"; exit 0;;
  *"pip install"*--no-index*torch==*) echo "OSError: [Errno 28] No space left on device" >&2; exit 1;;
  *"pip install"*torch==*) echo "no torch here" >&2; exit 1;;
  *"pip install"*) echo "pip $*" >> "$(dirname "$0")/../../installs.log"; exit 0;;
esac
exit 0
""")
    fake.chmod(0o755)
    # Its own .venv, whatever the outer make passed down (`make test VENV=...`): never a real one.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "VENV")}
    run = subprocess.run(["make", "install", f"PYTHON={fake}", "VENV=.venv"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0, run.stdout + run.stderr
    assert not (tmp_path / ".venv" / ".installed").exists()
    log = (tmp_path / "installs.log").read_text() if (tmp_path / "installs.log").exists() else ""
    assert "upgrade pip" in log and ".[dev" not in log, log   # the project was not installed
    # The local attempt's reason is shown, not only the index's: a full disk read as a network error.
    assert "could not be installed" in run.stderr and "No space left on device" in run.stderr, run.stderr
