from __future__ import annotations

import struct
from pathlib import Path

import pytest

from services.common.settings import (MAX_BUDGET, TEMPERATURE_RANGE, DraftSettings, SchedulerSettings, SettingsError,
                                      VerifierSettings, is_device, load_settings, temperature_ok)


def test_file_env_and_overrides_layer_in_order(tmp_path):
    cfg = tmp_path / "ddtree.toml"
    cfg.write_text('[verifier]\npage_size = 32\nmodel_path = "a"\n[scheduler]\ndraft_addresses = ["x:1", "y:2"]\n')
    v = load_settings(VerifierSettings, cfg, env={"DDTREE_VERIFIER_MODEL_PATH": "b"}, overrides={"port": 7})
    assert (v.page_size, v.model_path, v.port) == (32, "b", 7)
    s = load_settings(SchedulerSettings, cfg, env={})
    assert s.draft_addresses == ("x:1", "y:2")
    s = load_settings(SchedulerSettings, cfg, env={"DDTREE_SCHEDULER_DRAFT_ADDRESSES": "a:1,b:2",
                                                   "DDTREE_SCHEDULER_JSON_LOGS": "true"})
    assert s.draft_addresses == ("a:1", "b:2") and s.json_logs is True
    assert load_settings(DraftSettings, None, env={"DDTREE_DRAFT_WARMUP_BUDGETS": "4, 64"}).warmup_budgets == (4, 64)


@pytest.mark.parametrize("cls,env,needle", [
    (VerifierSettings, {"DDTREE_VERIFIER_PAGE_SIZE": "0"}, "verifier.page_size"),
    (VerifierSettings, {"DDTREE_VERIFIER_PAGE_SIZE": "big"}, "DDTREE_VERIFIER_PAGE_SIZE"),
    (VerifierSettings, {"DDTREE_VERIFIER_NOPE": "1"}, "DDTREE_VERIFIER_NOPE"),
    (DraftSettings, {"DDTREE_DRAFT_TRANSPORT": "carrier-pigeon"}, "draft.transport"),
    (SchedulerSettings, {"DDTREE_SCHEDULER_DEFAULT_BUDGET": "500"}, "scheduler.default_budget"),
    (SchedulerSettings, {"DDTREE_SCHEDULER_DEFAULT_MODE": "fast"}, "scheduler.default_mode"),
    (DraftSettings, {"DDTREE_DRAFT_WARMUP_BUDGETS": "8,200"}, "draft.warmup_budgets"),
    (DraftSettings, {"DDTREE_DRAFT_WARMUP_BUDGETS": "8,x"}, "DDTREE_DRAFT_WARMUP_BUDGETS"),
    # TOML's list form in a variable: "'[1' is not a list of integers", "'[\"a:1\"' is not host:port"
    (VerifierSettings, {"DDTREE_VERIFIER_FEATURE_LAYERS": "[1, 3, 4]"}, "a list in an environment variable is "
     "comma-separated"),
    (SchedulerSettings, {"DDTREE_SCHEDULER_DRAFT_ADDRESSES": '["a:1", "b:2"]'}, "e.g. 1,2,4 or host:1,host:2"),
    (VerifierSettings, {"DDTREE_VERIFIER_GRAPH_BATCHES": "(1, 2)"}, "comma-separated, without brackets"),
    # "wait for ever" gave up at once (a deadline past what gRPC holds), or overflowed with ranks
    (SchedulerSettings, {"DDTREE_SCHEDULER_DRAFT_WAIT_S": "inf"}, "'inf' is not a finite number"),
    (DraftSettings, {"DDTREE_DRAFT_VERIFIER_WAIT_S": "1e10"}, "seconds; at most 1e"),
    (VerifierSettings, {"DDTREE_VERIFIER_TP_TIMEOUT_S": "nan"}, "DDTREE_VERIFIER_TP_TIMEOUT_S: 'nan' is not a finite"),
    # each failed only once loaded: the draft at its first handshake, a service at its gRPC bind
    (DraftSettings, {"DDTREE_DRAFT_TRANSPORT": "cuda_ipc"}, "cuda_ipc puts the rings on the draft's GPU"),
    (VerifierSettings, {"DDTREE_VERIFIER_METRICS_PORT": "50053"}, "verifier.metrics_port: 50053 is verifier.port too"),
    (DraftSettings, {"DDTREE_DRAFT_METRICS_PORT": "7", "DDTREE_DRAFT_PORT": "7"}, "draft.metrics_port"),
    (SchedulerSettings, {"DDTREE_SCHEDULER_METRICS_PORT": "50051"}, "scheduler.metrics_port"),
    # refused by the verifier only after its weights loaded (minutes on Kimi-K2), under the handshake's name
    (VerifierSettings, {"DDTREE_VERIFIER_FEATURE_LAYERS": "1,3,1"}, "1, 3, 1] names a layer twice"),
])
def test_bad_settings_name_the_field(cls, env, needle):
    with pytest.raises(SettingsError, match=needle.replace(".", r"\.")):
        load_settings(cls, None, env=env)


def test_an_empty_token_variable_leaves_the_files_token(tmp_path):
    """Compose hands the scheduler an unset shell variable as "": it replaced the file's token, and
    the published port took every call, without a warning."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[scheduler]\nauth_token = "s3cret-token"\n')
    assert load_settings(SchedulerSettings, cfg, env={"DDTREE_SCHEDULER_AUTH_TOKEN": ""}).auth_token == "s3cret-token"
    assert load_settings(SchedulerSettings, cfg, env={"DDTREE_SCHEDULER_AUTH_TOKEN": "other"}).auth_token == "other"
    assert load_settings(SchedulerSettings, cfg, env={"DDTREE_SCHEDULER_DRAFT_WAIT_S": "1e6"}).draft_wait_s == 1e6


def test_an_ipv6_address_first_in_a_list_variable_is_an_address_not_brackets():
    s = load_settings(SchedulerSettings, None, env={"DDTREE_SCHEDULER_DRAFT_ADDRESSES": "[::1]:50052,127.0.0.1:2"})
    assert s.draft_addresses == ("[::1]:50052", "127.0.0.1:2")


def test_unknown_key_and_missing_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[draft]\nbudgett = 3\n")
    with pytest.raises(SettingsError, match="draft.budgett"):
        load_settings(DraftSettings, cfg, env={})
    with pytest.raises(SettingsError, match="config file"):
        load_settings(DraftSettings, tmp_path / "missing.toml", env={})


@pytest.mark.parametrize("toml,needle", [
    ("[scheduler]\ndraft_addresses = 5\n", "scheduler.draft_addresses: 5 is not a list"),
    ("[draft]\nwarmup_budgets = 16\n", "draft.warmup_budgets: 16 is not a list"),
    ("[verifier]\ngraph_batches = [1, 2.5]\n", "verifier.graph_batches"),
    ("[verifier]\ngraph_nodes = [0, 9]\n", "verifier.graph_nodes: must be one or more tree sizes in 1..129"),
    ("[verifier]\ngraph_nodes = [9, 130]\n", "verifier.graph_nodes: must be one or more tree sizes in 1..129"),
    ("[draft]\nwarmup_budgets = [\"8\", \"16\"]\n", "draft.warmup_budgets: ['8', '16'] is not a list of integers"),
    ("[scheduler]\nmax_batch = 1.7\n", "scheduler.max_batch: 1.7 is not an integer"),
    ("[scheduler]\nmax_batch = true\n", "scheduler.max_batch: True is not an integer"),
    ("[scheduler]\nmax_batch = \"8\"\n", "scheduler.max_batch: '8' is a string"),
    ("[scheduler]\ndraft_addresses = \"a:1\"\n", "scheduler.draft_addresses: 'a:1' is a string; this setting is tuple"),
    ("[scheduler]\njson_logs = 5\n", "scheduler.json_logs: 5 is not a boolean"),
    ("[verifier]\ncuda_graphs = 2\n", "verifier.cuda_graphs: 2 is not a boolean"),
    ("[scheduler]\nhost = 5\n", "scheduler.host: 5 is not a string"),
    ("[scheduler]\nauth_token = 982734982374\n", "scheduler.auth_token: the value is not a string \\(quote it\\)$"),
    ("[scheduler]\nstep_timeout_s = true\n", "scheduler.step_timeout_s: True is not a number"),
    ("scheduler = 5\n", "'scheduler' is not one of the tables"),
    ("[schedular]\nmax_batch = 8\n", "'schedular' is not one of the tables"),
    ("max_batch = 8\n", "'max_batch' is not one of the tables"),
    ("[scheduler]\nmetrics_port = 70000\n", "scheduler.metrics_port"),
    ("[draft]\nmetrics_port = -5\n", "draft.metrics_port"),
    ("[verifier]\nring_slot_bytes = 0\n", "verifier.ring_slot_bytes"),
    ("[verifier]\ngraph_batches = []\n", "verifier.graph_batches: must be one or more"),
    ("[verifier]\ngraph_nodes = []\n", "verifier.graph_nodes: must be one or more"),
    ("[scheduler]\nspec_backoff_steps = 257\n", "scheduler.spec_backoff_steps: must be in 1..256"),
    # a token no client can send (a header value): every call was refused, and start-up said nothing
    ("[scheduler]\nauth_token = \"p\u00e4sswort\"\n", "scheduler.auth_token: must be printable ASCII"),
    ("[scheduler]\nauth_token = \"tok\\n\"\n", "scheduler.auth_token: must be printable ASCII"),
    ("[scheduler]\nauth_token = \" tok\"\n", "scheduler.auth_token: must be printable ASCII"),
    # gRPC dials a port past 65535 modulo 65536: another service's port
    ("[scheduler]\ndraft_addresses = [\"127.0.0.1:99999\"]\n", "scheduler.draft_addresses: '127.0.0.1:99999' is not"),
    ("[draft]\nverifier_address = \"127.0.0.1:0\"\n", "draft.verifier_address: '127.0.0.1:0' is not host:port"),
])
def test_a_config_file_slip_names_the_setting(tmp_path, toml, needle):
    """A value of the wrong shape fails at start-up with the setting's name; before, a scalar where a
    list belongs crashed with a TypeError, ``true`` and 1.7 became the integer 1, and a misspelt
    table was ignored."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    with pytest.raises(SettingsError, match=needle.replace(".", r"\.").replace("[", r"\[")):
        for cls in (SchedulerSettings, DraftSettings, VerifierSettings):
            load_settings(cls, cfg, env={})


def test_a_config_file_that_is_not_utf8_names_the_file(tmp_path):
    """tomllib decodes the file itself: a Latin-1 byte raised a bare UnicodeDecodeError."""
    cfg = tmp_path / "latin1.toml"
    cfg.write_bytes(b"[scheduler]\nhost = \"caf\xe9\"\n")
    with pytest.raises(SettingsError, match=r"config file .*latin1\.toml: not UTF-8 text"):
        load_settings(SchedulerSettings, cfg, env={})


def test_the_shipped_config_still_loads():
    for cls in (SchedulerSettings, DraftSettings, VerifierSettings):
        load_settings(cls, "compose/ddtree.toml", env={})


def test_a_setting_under_a_misspelt_service_name_is_refused_and_the_stacks_own_variables_are_not() -> None:
    """DDTREE_SCHEDULR_MAX_QUEUE=0 was read by no service and the scheduler started with its
    default queue, where a misspelt field or config table is refused."""
    from services.common.settings import OTHER_VARIABLES

    with pytest.raises(SettingsError, match=r"DDTREE_SCHEDULR_MAX_QUEUE: no service is called 'schedulr' "
                                            r"\(the setting is DDTREE_SCHEDULER_MAX_QUEUE\)"):
        load_settings(SchedulerSettings, env={"DDTREE_SCHEDULR_MAX_QUEUE": "0"})
    with pytest.raises(SettingsError, match="DDTREE_SCHEDULER_PORT or DDTREE_DRAFT_PORT or DDTREE_VERIFIER_PORT"):
        load_settings(DraftSettings, env={"DDTREE_VERIFER_PORT": "5"})   # any service's load refuses it
    # A setting's name without a service: the whole name, not the setting its last word names.
    with pytest.raises(SettingsError, match=r"DDTREE_MAX_QUEUE: no service is named \(the setting is "
                                            r"DDTREE_SCHEDULER_MAX_QUEUE\)"):
        load_settings(SchedulerSettings, env={"DDTREE_MAX_QUEUE": "0"})
    with pytest.raises(SettingsError, match=r"DDTREE_METRICS_PORT: no service is named \(the setting is "
                                            r"DDTREE_SCHEDULER_METRICS_PORT or DDTREE_DRAFT_METRICS_PORT or "
                                            r"DDTREE_VERIFIER_METRICS_PORT\)"):
        load_settings(VerifierSettings, env={"DDTREE_METRICS_PORT": "9101"})
    with pytest.raises(SettingsError, match=r"DDTREE_MY_VERIFIER_PAGE_SIZE: no service is called 'my_verifier' "
                                            r"\(the setting is DDTREE_VERIFIER_PAGE_SIZE\)"):
        load_settings(VerifierSettings, env={"DDTREE_MY_VERIFIER_PAGE_SIZE": "1"})
    with pytest.raises(SettingsError, match=r"DDTREE_MY_OWN_SCHED_MAX_QUEUE: no service is called 'my_own_sched' "):
        load_settings(SchedulerSettings, env={"DDTREE_MY_OWN_SCHED_MAX_QUEUE": "1"})
    env = {name: "1" for name in OTHER_VARIABLES} | {"DDTREE_SOMETHING": "x", "DDTREE_SCHEDULER_MAX_QUEUE": "3",
                                                     "OLD_DDTREE_MAX_QUEUE": "1", "MY_DDTREE_PORT": "1"}
    assert load_settings(SchedulerSettings, env=env).max_queue == 3   # no setting's name: not ours to judge


def test_the_variable_the_verifier_sets_for_its_ranks_is_named_as_that_when_set_by_hand() -> None:
    """Under the verifier's prefix but no setting of it: "unknown setting" sent a user looking for
    a misspelt field."""
    from services.common.settings import RANK0_SETTINGS_ENV as SETTINGS_ENV

    with pytest.raises(SettingsError, match=f"{SETTINGS_ENV}: set by the verifier for its tensor-parallel ranks, "
                                            "not by hand; unset it"):
        load_settings(VerifierSettings, None, env={SETTINGS_ENV: "{}"})
    with pytest.raises(SettingsError, match="DDTREE_VERIFIER_RANK1_SETTINGS: unknown setting for verifier"):
        load_settings(VerifierSettings, None, env={"DDTREE_VERIFIER_RANK1_SETTINGS": "{}"})


def test_every_ddtree_variable_the_project_names_is_a_setting_or_known_as_another() -> None:
    """A variable the code reads but `OTHER_VARIABLES` lacks would be refused where its second word
    happens to be a setting's name (DDTREE_HEALTH_PORT ends in `port`)."""
    import re
    from pathlib import Path

    from services.common.settings import OTHER_VARIABLES

    root = Path(__file__).resolve().parent.parent
    files = [f for d in ("services", "kernels", "bench", "compose", ".ci") for f in (root / d).rglob("*")
             if f.is_file() and f.suffix in ("", ".py", ".yml", ".yaml", ".toml", ".sh")]
    files += [root / "Makefile", root / "README.md"]
    pattern = re.compile(r"DDTREE_[A-Z0-9][A-Z0-9_]*(?![A-Z0-9_*\[])")   # a whole name, not DDTREE_HEALTH_*
    named = {m for f in files for m in pattern.findall(f.read_text(errors="replace"))}
    services = ("DDTREE_SCHEDULER_", "DDTREE_DRAFT_", "DDTREE_VERIFIER_")
    examples = {"DDTREE_SCHEDULR_MAX_QUEUE", "DDTREE_MAX_QUEUE", "DDTREE_METRICS_PORT"}   # the mistakes the docs show
    assert len(named) > 20
    assert sorted(n for n in named - examples if not n.startswith(services) and n not in OTHER_VARIABLES) == []


def test_the_readme_settings_table_gives_the_code_defaults() -> None:
    """Each default the README's settings table names is the setting's default in the code, read
    through the environment's own parsing (a default changed in one place only went unnoticed)."""
    import dataclasses
    import re
    from pathlib import Path

    classes = {"scheduler": SchedulerSettings, "draft": DraftSettings, "verifier": VerifierSettings}

    def split(cell: str) -> list[list[str]]:
        return [group.split(" / ") for group in cell.split(", ")]

    compared = 0
    for line in (Path(__file__).resolve().parent.parent / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.match(r"`(scheduler|draft|verifier)\.", cells[0]):
            continue
        names, role = [], None
        for group in split(cells[0]):
            for piece in group:
                piece = piece.strip("`")
                role, field = piece.split(".", 1) if "." in piece else (role, piece)
                names.append((role, field))
        values = [v for group in split(cells[1]) for v in group]
        if len(values) != len(names):   # one value for all, or a list's items
            values = [cells[1]] * len(names)
        for (role, field), text in zip(names, values):
            text = text.strip().strip("`")
            if field not in {f.name for f in dataclasses.fields(classes[role])} or re.search(r"[a-z] [a-z]", text):
                continue   # prose, not a default
            want = getattr(classes[role](), field)
            if "..." in text:   # a doubling run: 1, 2, 4, ..., 128
                first, last = int(text.split(",")[0]), int(text.split(",")[-1])
                assert want == tuple(first << i for i in range((last // first).bit_length())), (role, field)
            else:
                mib = re.fullmatch(r"(\d+) MiB", text)
                text = str(int(mib.group(1)) << 20) if mib else "" if text == "(empty)" else text
                got = load_settings(classes[role], env={f"DDTREE_{role.upper()}_{field.upper()}": text})
                assert getattr(got, field) == want, (role, field, text, want)
            compared += 1
    assert compared >= 45, compared


def test_tls_cert_and_key_come_together_and_addresses_need_a_tcp_port() -> None:
    """A key alone (or a certificate alone: an unset variable) would have served the public port in
    plaintext; :65536 would have been dialled as port 0."""
    for half in ({"tls_key": "k.pem"}, {"tls_cert": "c.pem"}):
        with pytest.raises(SettingsError, match="tls_cert and tls_key must be set together"):
            SchedulerSettings(**half)
    for address in ("127.0.0.1:65536", "127.0.0.1:0"):
        with pytest.raises(SettingsError):
            SchedulerSettings(draft_addresses=(address,))
        with pytest.raises(SettingsError):
            DraftSettings(verifier_address=address)
    assert SchedulerSettings(draft_addresses=("127.0.0.1:65535",)).draft_addresses == ("127.0.0.1:65535",)


@pytest.mark.parametrize("cls, field, bad, good", [
    (SchedulerSettings, "max_request_bytes", 1023, 1024),
    (SchedulerSettings, "max_queue", 0, 1),
    (SchedulerSettings, "max_tokens_limit", 0, 1),
    (SchedulerSettings, "stop_grace_s", 3600.5, 3600.0),
    (SchedulerSettings, "stop_grace_s", -0.5, 0.0),
    (DraftSettings, "ring_slots", 1, 2),
    (DraftSettings, "verifier_address", "dns:verifier:50053", "verifier:50053"),
    (VerifierSettings, "tp", 9, 8),
    (VerifierSettings, "tp", 0, 1),
    (VerifierSettings, "kv_capacity_tokens", 15, 16),   # one page of the default 16 tokens
    (VerifierSettings, "ring_slots", 1, 2),
    (VerifierSettings, "ring_slot_bytes", 4095, 4096),
])
def test_each_bound_refuses_the_value_past_it_and_takes_the_one_at_it(cls, field, bad, good) -> None:
    with pytest.raises(SettingsError, match=field):
        cls(**{field: bad})
    assert getattr(cls(**{field: good}), field) == good


def test_a_boolean_variable_reads_1_as_true() -> None:
    assert load_settings(SchedulerSettings, env={"DDTREE_SCHEDULER_JSON_LOGS": "1"}).json_logs is True
    assert load_settings(SchedulerSettings, env={"DDTREE_SCHEDULER_JSON_LOGS": "0"}).json_logs is False


def test_a_bind_failure_is_said_in_its_own_words_also_without_an_errno() -> None:
    """An OSError raised with a message only has no strerror: the refusal said "None"."""
    from services.common.settings import cannot_listen

    err = cannot_listen(OSError("no socket for you"), "127.0.0.1", 1, "draft.port")
    assert str(err) == "draft.port: cannot listen on 127.0.0.1:1: no socket for you"
    err = cannot_listen(OSError(98, "Address already in use"), "0.0.0.0", 50051, "scheduler.port")
    assert str(err) == "scheduler.port: cannot listen on 0.0.0.0:50051: Address already in use"


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def test_a_flag_overrides_the_environment_which_overrides_the_file(tmp_path: Path) -> None:
    """The precedence the module states: flags (overrides) > environment > file > defaults, for
    the same setting; a None override leaves the value below it."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[scheduler]\nmax_queue = 5\n")
    assert load_settings(SchedulerSettings, cfg, env={}).max_queue == 5
    env = {"DDTREE_SCHEDULER_MAX_QUEUE": "6"}
    assert load_settings(SchedulerSettings, cfg, env=env).max_queue == 6
    assert load_settings(SchedulerSettings, cfg, env=env, overrides={"max_queue": "7"}).max_queue == 7
    assert load_settings(SchedulerSettings, cfg, env=env, overrides={"max_queue": None}).max_queue == 6


@pytest.mark.parametrize("cls, field, bad, good", [
    (SchedulerSettings, "draft_addresses", (), ("h:1",)),   # an empty variable reads as (): no draft to send to
    (SchedulerSettings, "default_budget", 0, 1),
    (SchedulerSettings, "default_budget", MAX_BUDGET + 1, MAX_BUDGET),
    (SchedulerSettings, "spec_backoff_steps", 0, 1),
    (SchedulerSettings, "spec_backoff_steps", 257, 256),
    (DraftSettings, "ring_slot_bytes", (64 << 20) + 1, 64 << 20),
    (DraftSettings, "ring_slot_bytes", 4095, 4096),
    (DraftSettings, "graph_context", 63, 64),
    (DraftSettings, "warmup_budgets", (0,), (1, MAX_BUDGET)),
    (VerifierSettings, "warmup_budgets", (MAX_BUDGET + 1,), (0, MAX_BUDGET)),
    # torch.set_num_threads takes a C int: 2**31 passed the check, then the service died with a traceback
    (DraftSettings, "cpu_threads", 1025, 1024),
    (VerifierSettings, "cpu_threads", 1025, 1024),
    (DraftSettings, "cpu_threads", 0, 1),
    (VerifierSettings, "ring_slots", 65, 64),
    (VerifierSettings, "tp_timeout_s", 0.5, 1.0),   # 0.0001 passed, and the group's start died in a store traceback
])
def test_more_bounds_refuse_the_value_past_them_and_take_the_one_at_them(cls, field, bad, good) -> None:
    with pytest.raises(SettingsError, match=field):
        cls(**{field: bad})
    assert getattr(cls(**{field: good}), field) == good


def test_a_device_needs_its_index_after_the_colon_and_temperature_takes_both_ends_of_its_range() -> None:
    assert is_device("cuda") and is_device("cuda:0") and is_device("cpu")
    for bad in ("cuda:", "cuda:x", "gpu", "cuda0", ""):
        assert not is_device(bad), bad
    with pytest.raises(SettingsError, match="draft.device: 'cuda:' is not cpu, cuda or cuda:N"):
        load_settings(DraftSettings, env={"DDTREE_DRAFT_DEVICE": "cuda:"})
    lo, hi = TEMPERATURE_RANGE
    assert temperature_ok(0) and temperature_ok(_f32(lo)) and temperature_ok(_f32(hi))   # as the wire holds them
    assert temperature_ok(lo) and temperature_ok(hi)
    assert not temperature_ok(lo / 2) and not temperature_ok(hi * 2) and not temperature_ok(float("nan"))


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("Yes", True), ("on", True),
                                         ("0", False), ("FALSE", False), ("no", False), ("off", False)])
def test_a_boolean_variable_takes_the_words_a_shell_user_writes(text, value) -> None:
    assert load_settings(SchedulerSettings, env={"DDTREE_SCHEDULER_JSON_LOGS": text}).json_logs is value
