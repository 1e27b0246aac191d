"""The scheduler's request rules on the demo tokenizer: what `validate` refuses, and where a stop
string ends the output (text, token ids and usage alike)."""

from __future__ import annotations

import os

import grpc
import pytest

from ddtree.v1 import common_pb2, scheduler_pb2
from services.common.grpc_server import ServiceError
from services.common.settings import MAX_BUDGET, TEMPERATURE_RANGE, SchedulerSettings
from services.scheduler.client import Client, ClientError, build_request
from services.scheduler import request as request_module
from services.scheduler.request import (MAX_REQUEST_ID_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                        ActiveRequest, Limits,
                                        encode_prompt, kv_reservation, max_token_bytes, validate)
from services.scheduler.router import limits_from_info
from services.common.tokenizer_files import load_tokenizer

TOKENIZER = load_tokenizer("models/demo")
LIMITS = Limits(vocab_size=TOKENIZER.get_vocab_size(), max_context=2048, block_size=16, eos_token_ids=(0,),
                kv_capacity_tokens=65536)


def _refused(req: scheduler_pb2.GenerateRequest) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        validate(req, SchedulerSettings(), LIMITS, TOKENIZER)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return info.value


@pytest.mark.parametrize("temperature", [float("inf"), 1e39, 1e-40, TEMPERATURE_RANGE[1] * 2, TEMPERATURE_RANGE[0] / 2])
def test_temperatures_the_verifier_cannot_divide_by_are_refused(temperature) -> None:
    req = build_request("def f():", max_tokens=4)
    req.sampling.temperature = temperature  # past the SDK, as a raw client would send it
    assert "temperature" in _refused(req).message


def test_temperatures_in_range_pass() -> None:
    for t in (0.0, TEMPERATURE_RANGE[0], 0.7, TEMPERATURE_RANGE[1]):
        assert validate(build_request("def f():", max_tokens=4, temperature=t), SchedulerSettings(), LIMITS, TOKENIZER)


@pytest.mark.parametrize("mode", [99, -1])
def test_unknown_mode_is_refused(mode) -> None:
    req = build_request("def f():", max_tokens=4)
    req.mode = mode
    assert "mode" in _refused(req).message


def test_stop_rules_and_request_id_are_bounded() -> None:
    assert "stop" in _refused(build_request("x", max_tokens=4, stop=["a"] * (MAX_STOP_STRINGS + 1))).message
    assert "stop" in _refused(build_request("x", max_tokens=4, stop=["a" * (MAX_STOP_CHARS + 1)])).message
    assert "request_id" in _refused(build_request("x", max_tokens=4, request_id="r" * (MAX_REQUEST_ID_CHARS + 1))).message
    # Stop token ids are bounded (1.3M of them, walked one by one, held the event loop for 0.5 s).
    many = build_request("x", max_tokens=4, stop_token_ids=[3] * 1_300_000)
    assert "stop_token_ids has 1300000 ids; at most 4096" in _refused(many).message
    ok = build_request("x", max_tokens=4, stop=["a" * MAX_STOP_CHARS] * MAX_STOP_STRINGS, request_id="r" * MAX_REQUEST_ID_CHARS,
                       stop_token_ids=[3] * MAX_STOP_TOKEN_IDS)
    assert validate(ok, SchedulerSettings(), LIMITS, TOKENIZER).request_id == "r" * MAX_REQUEST_ID_CHARS


@pytest.mark.parametrize("request_id", ["nul\x00byte", "\x1b[2K\x1b[31mFORGED", "a\nb", "a\tb", "a\x0bb", "a\x85b",
                                        "a\u2028b", "no\xa0break", "back\x08space"])
def test_a_request_id_that_is_not_printable_is_refused(request_id) -> None:
    """It is logged with every line of its request: a NUL made the log a binary file to grep, an
    escape sequence rewrote the console, a line break or a look-alike space forged a line."""
    message = _refused(build_request("x", max_tokens=4, request_id=request_id)).message
    assert message.startswith("request_id must be printable text") and repr(request_id) in message


@pytest.mark.parametrize("request_id", ["a b", "é-日本-🙂", "user:42/req#7"])
def test_a_printable_request_id_passes(request_id) -> None:
    assert validate(build_request("x", max_tokens=4, request_id=request_id), SchedulerSettings(), LIMITS,
                    TOKENIZER).request_id == request_id


def test_a_text_too_large_for_the_context_is_refused_by_its_size() -> None:
    token_bytes = max_token_bytes(TOKENIZER)
    longest = max(len(TOKENIZER.decode([i], skip_special_tokens=False).encode())
                  for i in range(TOKENIZER.get_vocab_size()))
    assert token_bytes == longest
    most = LIMITS.max_context - LIMITS.block_size - 1
    with pytest.raises(ServiceError) as info:
        encode_prompt("a" * (most * token_bytes + 1), TOKENIZER, LIMITS, token_bytes)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"is more than {most} tokens" in info.value.message and f"{most} prompt tokens at most" in info.value.message
    # at the bound it is tokenized, and the token count decides (here: too long), naming the same limit
    assert f"({most} prompt tokens at most" in _refused(build_request("a" * (most * token_bytes), max_tokens=4)).message


def test_a_stop_string_ends_token_ids_and_usage_where_it_ends_the_text() -> None:
    """A verify step may accept tokens past the one that completes a stop string: they are dropped
    from token_ids and usage as from the text."""
    text = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    stop = "return"
    req = ActiveRequest(request_id="r", prompt_ids=[1], sampling=common_pb2.SamplingParams(), max_tokens=100,
                        budget=8, mode=common_pb2.MODE_DDTREE, stop=(stop,), stop_ids=frozenset(), eos_ids=frozenset(),
                        tokenizer=TOKENIZER)
    req.add_tokens(ids[:2], 2)
    messages = [req.take()]
    req.add_tokens(ids[2:], len(ids) - 2)  # one step takes the rest, far past the stop string
    messages.append(req.take())
    kept = [t for m in messages for t in m.token_ids]
    assert "".join(m.text for m in messages) == text[:text.index(stop)]
    k = next(k for k in range(1, len(ids) + 1) if stop in TOKENIZER.decode(ids[:k], skip_special_tokens=False))
    assert kept == ids[:k] < ids  # through the token that completes "return", none after it
    assert messages[-1].finish_reason == scheduler_pb2.FINISH_REASON_STOP
    assert messages[-1].usage.completion_tokens == k


@pytest.mark.parametrize("kwargs, field", [
    (dict(budget=2**31), "budget"), (dict(max_tokens=2**31), "max_tokens"), (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"), (dict(stop_token_ids=[2**40]), "stop_token_ids"), (dict(prompt=[2**40]), "prompt"),
    (dict(prompt=[1.7, 2.2]), "prompt"), (dict(prompt="a\ud800b"), "prompt"), (dict(mode="fast"), "mode"),
])
def test_the_sdk_names_the_argument_it_cannot_send(kwargs, field) -> None:
    kwargs = {"prompt": "def f():", **kwargs}
    with pytest.raises(ClientError) as info:
        build_request(kwargs.pop("prompt"), **kwargs)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.message, info.value.message


def test_one_stop_string_is_not_split_into_characters() -> None:
    assert list(build_request("x", stop="ab").stop) == ["ab"]


def test_a_long_text_tokenizes_beside_the_event_loop() -> None:
    """The tokenizer keeps the GIL while it encodes, so the scheduler encodes long texts in a worker
    process: the event loop keeps ticking meanwhile, and the ids are the inline ones."""
    import asyncio
    import time

    from services.scheduler.tokenizing import PromptEncoder

    text = "def f(x):\n    return x  # " + "word " * 4 + "\n"
    text = text * (600_000 // len(text))
    t0 = time.perf_counter()
    want = TOKENIZER.encode(text, add_special_tokens=False).ids
    inline_s = time.perf_counter() - t0
    encoder = PromptEncoder(TOKENIZER, apart=True, inline_chars=1000)

    async def scenario() -> tuple[list[int], float]:
        gaps, done = [], asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await encoder.encode("warm up the worker " * 100)
        gaps.clear()
        ids = await encoder.encode(text)
        done.set()
        await tick
        return ids, max(gaps)

    try:
        ids, gap = asyncio.run(scenario())
        assert asyncio.run(encoder.encode("def f():")) == TOKENIZER.encode("def f():", add_special_tokens=False).ids
    finally:
        encoder.close()
    assert ids == want
    assert gap < max(0.1, inline_s / 3), (gap, inline_s)   # inline, the loop would stall inline_s


@pytest.mark.parametrize("text", ["a b", "a b " * 20])
def test_a_tokenizer_that_adds_a_bos_adds_none_to_a_prompt_inline_or_in_the_worker(text) -> None:
    """DeepSeek-V3's tokenizer.json adds a BOS in its post-processor: every text prompt would get
    one (a second after a chat template's). The demo tokenizer adds nothing, so it could not tell."""
    import asyncio

    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from services.scheduler.tokenizing import PromptEncoder

    tok = Tokenizer(models.WordLevel({"<bos>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    assert tok.encode("a b").ids == [0, 1, 2]   # the post-processor adds it, where asked to
    encoder = PromptEncoder(tok, apart=True, inline_chars=10)   # the short text inline, the long one apart
    try:
        ids = asyncio.run(encoder.encode(text))
    finally:
        encoder.close()
    assert ids == [1, 2] * text.count("a")


def test_texts_waiting_for_a_tokenizer_worker_that_died_go_to_a_new_one(monkeypatch) -> None:
    """The long texts that waited for a worker that died were encoded inline, one after another,
    holding the event loop (and with it every stream) for seconds; a text that killed the worker
    was encoded in the scheduler itself. They go to a new worker, and a text whose worker dies
    twice fails UNAVAILABLE."""
    import asyncio
    import signal

    from services.scheduler import tokenizing
    from services.scheduler.tokenizing import PromptEncoder

    texts = [f"text {i} " * 50 for i in range(4)]
    want = [TOKENIZER.encode(t, add_special_tokens=False).ids for t in texts]
    encoder = PromptEncoder(TOKENIZER, apart=True, inline_chars=10)
    inline = []
    real = TOKENIZER.encode

    async def scenario() -> tuple[list, str]:
        await encoder.encode("warm up the worker " * 10)
        pids = list(encoder._pool._processes)
        waiting = [asyncio.ensure_future(encoder.encode(t)) for t in texts]
        await asyncio.sleep(0)
        os.kill(pids[0], signal.SIGKILL)   # the worker dies with texts waiting
        got = await asyncio.gather(*waiting)
        # a text the worker dies on every time, among others waiting: it fails alone
        monkeypatch.setattr(tokenizing, "_encode", _die_on_poison)
        mixed = [texts[0], "POISON " * 20, *texts[1:]]
        outcomes = await asyncio.gather(*(encoder.encode(t) for t in mixed), return_exceptions=True)
        poisoned = outcomes.pop(1)
        assert outcomes == want, outcomes
        assert isinstance(poisoned, ServiceError), poisoned
        assert poisoned.retryable is False   # UNAVAILABLE, but sent again it dies again
        return got, f"{poisoned.code.name}: {poisoned.message}"

    class Spy:
        def encode(self, *a, **k):
            inline.append(1)
            return real(*a, **k)

    try:
        encoder.tokenizer = Spy()
        got, fatal = asyncio.run(scenario())
    finally:
        encoder.close()
    assert got == want and not inline   # every one in the new worker, none on the event loop
    assert fatal.startswith("UNAVAILABLE: the tokenizing worker died twice")


def test_a_tokenizer_worker_that_dies_before_it_starts_fails_the_text_and_holds_nothing(tmp_path, monkeypatch) -> None:
    """Spawn wrote the worker's start arguments (the whole tokenizer, 100 KB here) into the child's
    pipe on the event loop; past the pipe's 64 KB the write waits for the child to read, and a child
    that died first left the scheduler blocked in that write for good: no stream, no health check.
    Here every worker dies at once, before Python starts: the text fails UNAVAILABLE, the loop was
    never held, and no copy of the tokenizer is left behind."""
    import asyncio
    import multiprocessing.resource_tracker
    import multiprocessing.spawn
    import tempfile
    import threading
    import time

    from services.scheduler.tokenizing import PromptEncoder

    assert len(TOKENIZER.to_str()) > 65536   # more than a pipe holds
    dead = tmp_path / "python-that-dies"
    dead.write_text("#!/bin/sh\nexit 3\n")
    dead.chmod(0o755)
    multiprocessing.resource_tracker.ensure_running()   # spawned by the same executable: first
    monkeypatch.setattr(multiprocessing.spawn, "_python_exe", os.fsencode(dead))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    encoder = PromptEncoder(TOKENIZER, apart=True, inline_chars=10)
    result: dict = {}

    async def scenario() -> None:
        gaps, done = [], asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                gaps.append(time.perf_counter() - last)
                last = time.perf_counter()

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        try:
            await encoder.encode("def f(x): return x " * 10)
        except ServiceError as exc:
            result["error"] = exc
        done.set()
        await tick
        result["gap"] = max(gaps)

    runner = threading.Thread(target=lambda: asyncio.run(scenario()), daemon=True)
    runner.start()
    runner.join(60)
    # (stuck, it holds the pool's lock, which closing it would wait for as well)
    assert not runner.is_alive(), "the scheduler's thread is stuck starting the tokenizing worker"
    encoder.close()
    assert result["error"].code == grpc.StatusCode.UNAVAILABLE and "tokenizing worker died" in result["error"].message
    assert result["gap"] < 2.0, result["gap"]   # (it was held for good; a loaded runner may pause it a moment)
    assert list((tmp_path / "tmp").iterdir()) == []


def _die_on_poison(text: str) -> list[int]:
    """A worker the kernel kills for its memory on one text (run there: this module's, by name)."""
    from services.scheduler.tokenizing import _encode

    if text.startswith("POISON"):
        os.kill(os.getpid(), 9)
    return _encode(text)


def test_the_tokenizer_worker_goes_with_a_scheduler_that_was_killed(tmp_path) -> None:
    """A scheduler killed outright (SIGKILL, the OOM killer) cannot stop its pool: the worker lived
    on, one more for every restart. It watches its parent and exits."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = (f"import asyncio, os, sys; sys.path[:0] = [{str(root)!r}, {str(root / 'protos')!r}]\n"
              "from tokenizers import Tokenizer\n"
              "from services.scheduler.tokenizing import PromptEncoder\n"
              "encoder = PromptEncoder(Tokenizer.from_file('models/demo/tokenizer.json'), apart=True, inline_chars=10)\n"
              "asyncio.run(encoder.encode('def f(x): return x ' * 10))\n"
              "print(*encoder._pool._processes, flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    scheduler = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True)
    line = scheduler.stdout.readline()   # not to EOF: an orphaned worker keeps the pipe open
    assert scheduler.wait(timeout=60) == -9
    (worker,) = (int(w) for w in line.split())
    scheduler.stdout.close()

    def alive(pid: int) -> bool:   # an exited orphan may stay a zombie until init reaps it
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        except (FileNotFoundError, IndexError):
            return False
    deadline = time.monotonic() + 15
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(worker):
        os.kill(worker, 9)
        raise AssertionError(f"tokenizer worker {worker} outlived its scheduler")


def _request(stop: tuple[str, ...] = (), max_tokens: int = 100) -> ActiveRequest:
    return ActiveRequest(request_id="r", prompt_ids=[1], sampling=common_pb2.SamplingParams(), max_tokens=max_tokens,
                         budget=8, mode=common_pb2.MODE_DDTREE, stop=stop, stop_ids=frozenset(), eos_ids=frozenset(),
                         tokenizer=TOKENIZER)


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot() -> None:
    """A message never shows text a stop string may yet complete: sent, it could not be taken back
    when the stop string completed in a later step."""
    ids = TOKENIZER.encode("x = a + b\nmore + c", add_special_tokens=False).ids
    req = _request(stop=("+ b\n",))
    texts = []
    for i, tok in enumerate(ids):
        if req.done:
            break
        req.add_tokens([tok], 0 if i == 0 else 1)
        texts.append(req.take().text)
    assert "".join(texts) == req.text == "x = a " and req.finish == scheduler_pb2.FINISH_REASON_STOP
    assert not any("+" in t for t in texts)


def test_steps_not_yet_sent_go_out_as_one_message_and_a_failure_follows_its_last_tokens() -> None:
    """The stream's next message is built when it is sent: every step since the last one in it,
    the same text and tokens as a message a step; a failure's last tokens come without a finish or
    usage, then the error."""
    ids = TOKENIZER.encode("def add(a, b):\n    return a + b\n", add_special_tokens=False).ids
    one_a_step, merged = _request(stop=("b\n",)), _request(stop=("b\n",))
    sent = []
    for req in (one_a_step, merged):
        req.add_tokens(ids[:1], 0)
        for i in range(1, len(ids), 2):
            if req.done:
                break
            req.add_tokens(ids[i:i + 2], 2)
            if req is one_a_step:
                sent.append(req.take())
    whole = merged.take()
    assert merged.take() is None and whole.finish_reason == scheduler_pb2.FINISH_REASON_STOP
    assert whole.text == "".join(m.text for m in sent) and whole.text.endswith("a + ") and len(sent) > 3
    assert list(whole.token_ids) == [t for m in sent for t in m.token_ids]
    assert list(whole.acceptance_lengths) == [a for m in sent for a in m.acceptance_lengths]
    assert whole.usage == sent[-1].usage
    failing = _request()
    failing.add_tokens(ids[:3], 3)
    error = ServiceError(grpc.StatusCode.UNAVAILABLE, "lost")
    failing.fail(error)
    last = failing.take()
    assert list(last.token_ids) == ids[:3] and not last.finish_reason and not last.HasField("usage")
    assert failing.take() is error and failing.take() is None


def test_the_step_that_completes_a_stop_string_decodes_its_window_not_the_whole_output(monkeypatch) -> None:
    """The cut after a stop string decoded the output from its first token for each candidate
    token of the step, on the event loop (30k tokens: 32 ms); it decodes from the detokenizer's
    window now, and keeps the same tokens. So too where the client has read nothing: the cut's
    cursors were the sent message's, and 8000 unread tokens took 3.4 s of decoding."""
    body = TOKENIZER.encode("def add(a, b):\n    return a + b\n\n", add_special_tokens=False).ids
    tail = TOKENIZER.encode(" x y z STOPHERE w v", add_special_tokens=False).ids
    ids = (body * 200)[:2000] + tail
    decode = TOKENIZER.decode
    for read in (True, False):
        req = _request(stop=("STOPHERE",), max_tokens=10**6)
        decoded: list[int] = []

        class Spy:
            def decode(self, ids, **kw):
                decoded.append(len(ids))
                return decode(ids, **kw)
        req.tokenizer = Spy()
        req.add_tokens(ids[:1], 0)
        for i in range(1, 2000, 16):
            req.add_tokens(ids[i:min(i + 16, 2000)], len(ids[i:min(i + 16, 2000)]))
            if read:
                req.take()
        decoded.clear()
        req.add_tokens(tail, len(tail))
        assert req.done and req.finish == scheduler_pb2.FINISH_REASON_STOP and req.text.rstrip().endswith(" x y z")
        assert max(decoded) < 100 and sum(decoded) < 1000, (read, max(decoded), sum(decoded))
        want = decode(req.out_ids)
        assert "STOPHERE" in want and not want.endswith(" w v") and want.rstrip().endswith("STOPHERE")
        assert req.take().text.rstrip().endswith(" x y z")


def _run(req: ActiveRequest, ids: list[int], step: int = 5) -> list[scheduler_pb2.GenerateResponse]:
    req.add_tokens(ids[:1], 0)  # the prefill's token
    for i in range(1, len(ids), step):
        if req.done:
            break
        req.add_tokens(ids[i:i + step], len(ids[i:i + step]))
    out = []
    while (message := req.take()) is not None:
        out.append(message)
    return out


def test_the_stop_string_that_starts_first_ends_the_text_whatever_the_order() -> None:
    """'elf' and 'self' complete in the same step: the text ends before 'self' both ways (before, the
    list's first entry won, and 'elf' left 's' in the text)."""
    text = "class Stack:\n    def __init__(self):\n        self.items = []\n"
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    for stop in (("elf", "self"), ("self", "elf")):
        messages = _run(_request(stop), ids, step=len(ids))
        assert "".join(m.text for m in messages) == text[:text.index("self")], stop


@pytest.mark.parametrize("cut", ["max_tokens", "stop"])
def test_acceptance_counts_only_the_tokens_returned(cut) -> None:
    """A verify step cut by max_tokens or a stop string reports the tokens kept, so the acceptance
    lengths add up to the tokens after the prefill's."""
    text = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 3
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    req = _request(stop=("return",)) if cut == "stop" else _request(max_tokens=13)
    messages = _run(req, ids, step=5)
    steps = [a for m in messages for a in m.acceptance_lengths]
    usage = messages[-1].usage
    assert sum(steps) == usage.completion_tokens - 1 == len([t for m in messages for t in m.token_ids]) - 1
    assert steps[-1] < 5 and usage.mean_acceptance == pytest.approx(sum(steps) / len(steps))


def test_the_first_token_time_is_the_first_steps() -> None:
    """`request_end`'s ttft_ms: a later step must not move it (it would read as time to last token)."""
    import time

    req = _request()
    req.add_tokens([5], 0)
    first = req.first_token_at
    time.sleep(0.01)
    req.add_tokens([6, 7], 2)
    assert first is not None and req.first_token_at == first


@pytest.mark.parametrize("kwargs, needle", [
    (dict(prompt=b"hello"), "prompt must be text or a list of token ids, not bytes"),
    (dict(prompt=None), "prompt must be text or a list of token ids, not NoneType"),
    (dict(prompt=5), "prompt must be text or a list of token ids, not int"),
    (dict(prompt="x", stop_token_ids=5), "stop_token_ids must be a list, not int"),
    # a dict went out as its keys, a set of token ids in no set order
    (dict(prompt="x", stop={"a": 1}), "stop must be a list, not dict"),
    (dict(prompt={5: 1, 6: 2}), "prompt must be text or a list of token ids, not dict"),
    (dict(prompt={5, 6}), "prompt must be text or a list of token ids, not set"),
    (dict(prompt="x", ignore_eos="no"), "ignore_eos must be True or False"),
    # float32 on the wire: a tiny top_p would arrive as 0 (no cut at all), a tiny temperature as greedy
    (dict(prompt="x", top_p=1e-50), "top_p = 1e-50 is sent as a float32 and would arrive as 0.0"),
    (dict(prompt="x", temperature=1e-50), "temperature = 1e-50 is sent as a float32 and would arrive as 0.0"),
    (dict(prompt="x", temperature=1e39), r"temperature = 1e\+39 is sent as a float32 and would arrive as inf"),
    # a bool would go out as 1 / 0; protobuf's own refusals named no argument ("bad argument type")
    (dict(prompt="x", temperature=True), "temperature must be a number, not True"),
    (dict(prompt="x", top_k=2.5), "top_k must be an integer, not 2.5"),
    (dict(prompt="x", max_tokens=None), "max_tokens must be an integer, not None"),
    (dict(prompt="x", budget=None), "budget must be an integer, not None"),
    (dict(prompt="x", seed=True), "seed must be an integer or None, not True"),
    (dict(prompt="x", request_id=5), "request_id must be text, not 5"),
    (dict(prompt="x", request_id=None), "request_id must be text, not None"),
    (dict(prompt="x", stop=[None]), "stop: each stop must be text, got None"),
    (dict(prompt="x", stop=["a", 3]), "stop: each stop must be text, got 3"),
])
def test_the_sdk_refuses_what_it_would_misread(kwargs, needle) -> None:
    """Bytes passed as integers (b"hello" went out as token ids 104, 101, ...); the others raised
    plain TypeErrors."""
    with pytest.raises(ClientError, match=needle) as info:
        build_request(**kwargs)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_the_sdk_refuses_a_token_it_cannot_send_when_the_client_is_made() -> None:
    """gRPC failed each call with INTERNAL ("Illegal header value") instead."""
    for token in ("a\nb", "ä", b"abc"):
        with pytest.raises(ClientError, match="token must be text of printable ASCII") as info:
            Client("127.0.0.1:1", token=token)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    Client("127.0.0.1:1", token="Abc-123_~ ok").close()
    assert build_request("x", top_p=1e-40).sampling.top_p > 0     # a float32 subnormal: still a cut
    assert build_request("x", temperature=None, top_p=None).sampling.temperature == 0   # None: the default
    # Sets where order does not matter: stop strings, stop ids.
    assert sorted(build_request("x", stop={"a", "b"}, stop_token_ids=frozenset({3, 4})).stop) == ["a", "b"]


def test_the_sdk_takes_any_iterable_of_ids_and_none_for_no_stop() -> None:
    req = build_request((i for i in (5, 6, 7)), stop=None, stop_token_ids=None)  # a generator is read once
    assert list(req.token_ids.ids) == [5, 6, 7] and not req.stop and not req.stop_token_ids


def test_the_sdk_reports_a_missing_ca_file_and_a_closed_client(tmp_path) -> None:
    from services.scheduler.client import AsyncClient, Client

    with pytest.raises(ClientError, match="tls_ca: cannot read") as info:
        Client("127.0.0.1:1", tls_ca=str(tmp_path / "missing.pem"))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    c = Client("127.0.0.1:1")
    c.close()
    for call in (lambda: c.generate("x"), lambda: c.abort("x"), lambda: c.model_info()):
        with pytest.raises(ClientError, match="closed") as info:
            call()
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION

    async def closed_async() -> None:
        a = AsyncClient("127.0.0.1:1")
        await a.close()
        with pytest.raises(ClientError, match="closed"):
            await a.generate("x")
        with pytest.raises(ClientError, match="closed"):
            await a.abort("x")
    import asyncio
    asyncio.run(closed_async())


def _byte_token(b: int) -> int:
    """The demo tokenizer's token for one byte (byte-level BPE's printable stand-in for it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char = chr(b) if b in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(b))
    return TOKENIZER.token_to_id(char)


def _steps(req: ActiveRequest, steps: list[list[int]]) -> tuple[str, list[int], list[int]]:
    req.add_tokens(steps[0], 0)
    for step in steps[1:]:
        if req.done:
            break
        req.add_tokens(step, len(step))
    if not req.done:
        req.end(scheduler_pb2.FINISH_REASON_LENGTH)
    messages = []
    while (message := req.take()) is not None:
        messages.append(message)
    return ("".join(m.text for m in messages), [t for m in messages for t in m.token_ids],
            [a for m in messages for a in m.acceptance_lengths])


def test_a_failed_requests_last_messages_carry_the_text_of_every_token_they_carry() -> None:
    """The SDK's `partial` of a failed request is the output before the error: the text held back
    as a stop string's possible start ("world" against "STOP!"), or a character's first bytes, went
    with its tokens' ids but not as text ("hello w" beside the ids of "hello world")."""
    for text, tail in (("hello world", []), ("hello world", [_byte_token(0xE4)])):
        req = _request(stop=("STOP!",))
        ids = TOKENIZER.encode(text, add_special_tokens=False).ids + tail
        req.add_tokens(ids[:1], 0)
        req.add_tokens(ids[1:], len(ids) - 1)
        req.fail(ServiceError(grpc.StatusCode.UNAVAILABLE, "replica lost"))
        messages = []
        while (message := req.take()) is not None:
            messages.append(message)
        assert isinstance(messages[-1], ServiceError)
        got = "".join(m.text for m in messages[:-1])
        assert [t for m in messages[:-1] for t in m.token_ids] == ids
        assert got == TOKENIZER.decode(ids, skip_special_tokens=False) == text + ("\ufffd" if tail else ""), got


def test_a_stop_string_before_a_split_character_is_seen_in_its_own_step() -> None:
    """A step that ends inside a multi-byte character still shows the text before it, so a stop
    string completed there ends the output then (before, it was seen a step late, with the split
    character's tokens kept)."""
    x, c = TOKENIZER.token_to_id("x"), TOKENIZER.token_to_id("c")
    e4, b8, ad = (_byte_token(b) for b in (0xE4, 0xB8, 0xAD))  # 中
    assert TOKENIZER.decode([e4, b8, ad]) == "中"
    for steps in ([[x], [c], [e4], [b8], [ad]], [[x], [c, e4], [b8, ad]]):
        text, ids, acceptance = _steps(_request(stop=("c",)), steps)
        assert (text, ids, sum(acceptance)) == ("x", [x, c], 1), steps


def test_the_same_tokens_stop_the_same_way_however_they_came_in_steps() -> None:
    """The stop string completed first wins, as with one token a step: 'c' inside 'abcd'."""
    x, a, b, c, d, y = (TOKENIZER.token_to_id(ch) for ch in "xabcdy")
    tokens = [x, a, b, c, d, y]
    one_a_step = _steps(_request(stop=("abcd", "c")), [[t] for t in tokens])
    together = _steps(_request(stop=("abcd", "c")), [tokens[:1], tokens[1:]])
    assert one_a_step[:2] == together[:2] == ("xab", [x, a, b, c])


def test_a_run_of_steps_that_end_inside_a_character_decodes_a_bounded_window() -> None:
    """Invalid UTF-8 at every step's end (a lead byte, then ASCII): the window still moves on."""
    from services.scheduler.detokenize import IncrementalDetokenizer

    class Counting:
        tokens = 0

        def decode(self, ids, skip_special_tokens=False):
            Counting.tokens += len(ids)
            return TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)

    x, e4 = TOKENIZER.token_to_id("x"), _byte_token(0xE4)
    detok, ids = IncrementalDetokenizer(Counting()), []
    for _ in range(400):
        ids += [x, e4]
        text = detok.update(ids)
        assert TOKENIZER.decode(ids).startswith(text)
    before = Counting.tokens
    ids += [x, e4]
    detok.update(ids)
    assert Counting.tokens - before <= 4 * IncrementalDetokenizer.MAX_WINDOW
    assert detok.update(ids, final=True) == TOKENIZER.decode(ids)


def _ids(ids: list[int], **fields) -> scheduler_pb2.GenerateRequest:
    req = scheduler_pb2.GenerateRequest(**fields)
    req.token_ids.ids.extend(ids)
    return req


def test_the_prompt_and_max_tokens_bounds_leave_room_for_one_tree() -> None:
    """A prompt may fill the context but one tree and one output token; max_tokens is clamped to
    what is left after that tree's room (a prompt of exactly the room was admitted with nothing
    left to generate, and the draft refused it naming an internal field)."""
    room = LIMITS.max_context - LIMITS.block_size
    longest = validate(_ids([5] * (room - 1), max_tokens=100), SchedulerSettings(), LIMITS, TOKENIZER)
    assert longest.max_tokens == 1
    assert f"prompt has {room} tokens" in _refused(_ids([5] * room, max_tokens=100)).message
    limit = SchedulerSettings().max_tokens_limit
    assert limit > room
    short = validate(_ids([5] * 100, max_tokens=limit), SchedulerSettings(), LIMITS, TOKENIZER)
    assert short.max_tokens == room - 100
    assert short.kv_tokens == LIMITS.max_context   # prompt + output + one block: the whole context, not past it
    assert validate(_ids([5] * 100, max_tokens=7), SchedulerSettings(), LIMITS, TOKENIZER).max_tokens == 7


def test_the_budget_and_token_ids_bounds_are_inclusive_where_documented() -> None:
    assert validate(build_request("x", max_tokens=4, budget=MAX_BUDGET), SchedulerSettings(), LIMITS, TOKENIZER).budget == MAX_BUDGET
    assert validate(build_request("x", max_tokens=4, budget=1), SchedulerSettings(), LIMITS, TOKENIZER).budget == 1
    assert f"budget must be in 1..{MAX_BUDGET}, or 0 for the server's default (got {MAX_BUDGET + 1})" in _refused(
        _ids([5], max_tokens=4, budget=MAX_BUDGET + 1)).message
    top = LIMITS.vocab_size - 1
    assert validate(_ids([5, top], max_tokens=4, stop_token_ids=[top]), SchedulerSettings(), LIMITS, TOKENIZER)
    assert f"prompt.token_ids[1] = {LIMITS.vocab_size} is outside" in _refused(
        _ids([5, LIMITS.vocab_size], max_tokens=4)).message
    assert "stop_token_ids[0]" in _refused(_ids([5], max_tokens=4, stop_token_ids=[LIMITS.vocab_size])).message


def test_a_request_reserves_kv_in_the_verifiers_whole_pages() -> None:
    """The verifier reserves ceil(tokens / page) pages: admitting by tokens alone let 64 requests
    of 65536 tokens in all into a cache of 4096 pages that they needed 4156 of."""
    paged = Limits(vocab_size=LIMITS.vocab_size, max_context=2048, block_size=16, eos_token_ids=(0,),
                   kv_capacity_tokens=65536, kv_page_size=16)
    req = scheduler_pb2.GenerateRequest(max_tokens=10)
    req.token_ids.ids.extend([5, 6, 7])
    assert validate(req, SchedulerSettings(), paged, TOKENIZER).kv_tokens == 32        # 3 + 10 + 16 = 29 -> 2 pages
    assert validate(req, SchedulerSettings(), LIMITS, TOKENIZER).kv_tokens == 29       # pages of one token
    assert [kv_reservation(n, paged) for n in (1, 16, 17, 1025)] == [16, 16, 32, 1040]


def test_every_eos_id_of_the_model_ends_a_request_unless_it_ignores_eos() -> None:
    """A model may have several end-of-sequence ids (end of text, end of turn); any of them ends
    the output, and is not shown in the text."""
    ids = TOKENIZER.encode("def add(a, b):\n    return a + b\n", add_special_tokens=False).ids
    limits = Limits(vocab_size=LIMITS.vocab_size, max_context=2048, block_size=16, eos_token_ids=(0, 1),
                    kv_capacity_tokens=65536)
    for eos in (0, 1):
        req = validate(build_request(ids[:3], max_tokens=50), SchedulerSettings(), limits, TOKENIZER)
        messages = _run(req, ids[:6] + [eos] + ids[6:], step=4)
        assert messages[-1].finish_reason == scheduler_pb2.FINISH_REASON_STOP
        assert [t for m in messages for t in m.token_ids] == ids[:6] + [eos]
        assert "".join(m.text for m in messages) == TOKENIZER.decode(ids[:6])
    req = validate(build_request(ids[:3], max_tokens=9, ignore_eos=True), SchedulerSettings(), limits, TOKENIZER)
    messages = _run(req, [0, 1] * 8, step=4)
    assert messages[-1].finish_reason == scheduler_pb2.FINISH_REASON_LENGTH and len(req.out_ids) == 9


def test_limits_take_every_eos_id_and_an_older_drafts_single_one() -> None:
    info = common_pb2.ModelInfo(vocab_size=64, max_context=512, block_size=16, eos_token_id=3, eos_token_ids=[3, 4])
    assert limits_from_info(info).eos_token_ids == (3, 4)
    assert limits_from_info(common_pb2.ModelInfo(eos_token_id=3)).eos_token_ids == (3,)
    assert limits_from_info(common_pb2.ModelInfo(eos_token_id=-1)).eos_token_ids == ()


def test_the_sdk_pings_an_open_call_as_the_servers_accept() -> None:
    """A call with no deadline to a scheduler whose host vanished (no FIN) waited for good; the
    client now pings while a call is open, at the interval the servers' policy takes."""
    from services.common.grpc_server import keepalive_options
    from services.scheduler.client import _channel_args
    server = dict(keepalive_options())
    options = dict(_channel_args(None, None, None)[1])
    assert options["grpc.keepalive_time_ms"] == server["grpc.keepalive_time_ms"]
    assert options["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    assert options["grpc.keepalive_timeout_ms"] == options["grpc.http2.ping_timeout_ms"] == server["grpc.keepalive_timeout_ms"]


def test_the_sdk_reaches_a_restarted_server_within_a_second() -> None:
    """gRPC's default reconnect back-off grows towards two minutes: after a scheduler restart a
    long-lived client failed UNAVAILABLE for seconds after the server was back."""
    from services.scheduler.client import _channel_args
    for tls_ca in (None, b""):
        options = dict(_channel_args(tls_ca, None, None)[1])
        assert options["grpc.max_reconnect_backoff_ms"] <= 1000 and options["grpc.initial_reconnect_backoff_ms"] <= 1000
        # gRPC's minimum time for one connection attempt stays (20 s): a short one failed every
        # first call of a client ~100 ms away (the attempt's TCP + TLS + HTTP/2 did not fit).
        assert "grpc.min_reconnect_backoff_ms" not in options


def test_long_texts_waiting_for_the_tokenizer_are_bounded() -> None:
    """Texts long enough for the worker queued without bound before any admission check: one
    client's many held every other long prompt behind them for seconds."""
    import asyncio

    from services.scheduler.tokenizing import PromptEncoder

    encoder = PromptEncoder(TOKENIZER, apart=True, inline_chars=10, max_pending=3)
    text = "def f(x):\n    return x\n" * 2000

    async def scenario() -> tuple[list, list[int]]:
        results = await asyncio.gather(*(encoder.encode(text) for _ in range(6)), return_exceptions=True)
        return results, await encoder.encode(text)   # the waiting ones done: room again
    try:
        results, again = asyncio.run(scenario())
    finally:
        encoder.close()
    want = TOKENIZER.encode(text, add_special_tokens=False).ids
    refused = [r for r in results if isinstance(r, ServiceError)]
    assert [r for r in results if isinstance(r, list)] == [want] * 3 and len(refused) == 3
    assert refused[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED and "long prompts wait to be tokenized" in refused[0].message
    assert refused[0].reason == "tokenizer_busy"
    assert again == want and encoder._pending == 0
    assert encoder.encode.__doc__ and PromptEncoder(TOKENIZER).max_pending == 32


def test_a_request_that_ended_keeps_how_it_ended() -> None:
    """An abort racing a finish turned a finished output into "aborted", and a failure after an
    abort counted an aborted request as failed."""
    lost = ServiceError(grpc.StatusCode.UNAVAILABLE, "lost")
    finished = _request(max_tokens=2)
    finished.add_tokens([5, 6], 2)
    finished.end(scheduler_pb2.FINISH_REASON_ABORTED)
    finished.fail(lost)
    assert (finished.finish, finished.error) == (scheduler_pb2.FINISH_REASON_LENGTH, None)
    assert finished.take().finish_reason == scheduler_pb2.FINISH_REASON_LENGTH and finished.take() is None
    failed = _request()
    failed.add_tokens([5], 0)
    failed.fail(lost)
    failed.end(scheduler_pb2.FINISH_REASON_ABORTED)
    assert not failed.take().finish_reason and failed.take() is lost
    aborted = _request()
    aborted.add_tokens([5], 0)
    aborted.end(scheduler_pb2.FINISH_REASON_ABORTED)
    aborted.fail(lost)   # its step in flight failed after the abort
    assert aborted.error is None and aborted.take().finish_reason == scheduler_pb2.FINISH_REASON_ABORTED


def test_a_stop_token_id_ends_the_output_in_token_ids_not_in_the_text() -> None:
    ids = TOKENIZER.encode("def add(a, b):", add_special_tokens=False).ids
    stop_id = TOKENIZER.encode(" return", add_special_tokens=False).ids[-1]
    req = _request()
    req.stop_ids = frozenset({stop_id})
    req.add_tokens(ids[:1], 0)
    req.add_tokens(ids[1:] + [stop_id], len(ids))
    msg = req.take()
    assert req.finish == scheduler_pb2.FINISH_REASON_STOP and list(msg.token_ids)[-1] == stop_id
    assert msg.text == TOKENIZER.decode(ids) and "return" not in msg.text


def test_stop_strings_on_a_server_without_a_tokenizer_are_refused_not_ignored() -> None:
    with pytest.raises(ServiceError) as info:
        validate(build_request([1, 2, 3], max_tokens=4, stop=["\n"]), SchedulerSettings(), LIMITS, None)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "stop strings" in info.value.message


def test_a_client_far_behind_gets_its_output_in_messages_of_bounded_size(monkeypatch) -> None:
    """Unsent steps merge into one message, but only up to a message's caps: a client far behind
    on a long output would otherwise get one message past gRPC's 4 MB receive cap and lose the
    stream. The rest follows at once; the finish and usage come with the last piece only."""
    monkeypatch.setattr(request_module, "MESSAGE_MAX_TOKENS", 7)
    monkeypatch.setattr(request_module, "MESSAGE_MAX_CHARS", 11)
    ids = TOKENIZER.encode("def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 3, add_special_tokens=False).ids
    req = _request(max_tokens=len(ids))
    req.add_tokens(ids[:1], 0)
    for i in range(1, len(ids), 2):
        req.add_tokens(ids[i:i + 2], len(ids[i:i + 2]))
    assert req.done and req.finish == scheduler_pb2.FINISH_REASON_LENGTH
    messages = []
    while (msg := req.take()) is not None:
        messages.append(msg)
    assert all(len(m.token_ids) <= 7 and len(m.text) <= 11 and len(m.acceptance_lengths) <= 7 for m in messages)
    assert len(messages) == -(-len(req.text) // 11) > -(-len(ids) // 7)   # the text needs the most pieces here
    assert [t for m in messages for t in m.token_ids] == ids and "".join(m.text for m in messages) == req.text
    assert [a for m in messages for a in m.acceptance_lengths] == req.acceptance
    assert [m.finish_reason for m in messages[:-1]] == [scheduler_pb2.FINISH_REASON_UNSPECIFIED] * (len(messages) - 1)
    assert not any(m.HasField("usage") for m in messages[:-1])
    assert messages[-1].finish_reason == scheduler_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == len(ids)


def test_a_running_request_far_behind_gets_all_it_has_in_capped_messages_at_once(monkeypatch) -> None:
    """Not only at the finish: while the request runs, what a message's caps left over goes out at
    once, not a step later; each step's acceptance length travels with the step's last token."""
    monkeypatch.setattr(request_module, "MESSAGE_MAX_CHARS", 5)
    ids = TOKENIZER.encode("hello world, how are you today", add_special_tokens=False).ids
    req = _request(max_tokens=1000)
    req.add_tokens(ids, len(ids))
    assert not req.done
    messages = []
    while (msg := req.take()) is not None:
        messages.append(msg)
    assert all(len(m.text) <= 5 for m in messages) and "".join(m.text for m in messages) == req.text
    assert len(req.text) > 5 and [t for m in messages for t in m.token_ids] == ids[:len(req.out_ids)]

    monkeypatch.setattr(request_module, "MESSAGE_MAX_CHARS", 10**6)
    monkeypatch.setattr(request_module, "MESSAGE_MAX_TOKENS", 7)
    ids = TOKENIZER.encode("a b c d e f g h i j k l m n o p q r s t", add_special_tokens=False).ids
    req = _request(max_tokens=1000)
    for t in ids:
        req.add_tokens([t], 1)
    messages = []
    while (msg := req.take()) is not None:
        messages.append(msg)
    assert len(messages) == -(-len(ids) // 7)
    assert [len(m.acceptance_lengths) for m in messages] == [len(m.token_ids) for m in messages]


def test_a_message_at_its_caps_fits_grpcs_default_receive_limit() -> None:
    """The largest message the caps allow, of the widest values (5-byte ids, 4-byte characters),
    stays under half of gRPC's default 4 MB: any client reads it without raising its limit."""
    worst = scheduler_pb2.GenerateResponse(
        request_id="r" * MAX_REQUEST_ID_CHARS, token_ids=[2**31 - 1] * request_module.MESSAGE_MAX_TOKENS,
        text="\U0001F600" * request_module.MESSAGE_MAX_CHARS,
        acceptance_lengths=[MAX_BUDGET + 1] * request_module.MESSAGE_MAX_TOKENS)
    worst.usage.CopyFrom(scheduler_pb2.Usage(prompt_tokens=2**31 - 1, completion_tokens=2**31 - 1, steps=2**31 - 1,
                                             mean_acceptance=129.0, tree_steps=2**31 - 1))
    assert worst.ByteSize() < 2 * 2**20


def test_long_texts_without_a_writable_temporary_folder_are_refused_by_name(tmp_path, monkeypatch) -> None:
    """The tokenizing worker reads the tokenizer from a temporary file; where none can be written
    (a read-only container), a long text fails naming the cause and the way out, not INTERNAL."""
    import asyncio
    import tempfile

    from services.scheduler.tokenizing import PromptEncoder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    encoder = PromptEncoder(TOKENIZER, apart=True, inline_chars=10)
    try:
        assert asyncio.run(encoder.encode("a b")) == TOKENIZER.encode("a b", add_special_tokens=False).ids
        with pytest.raises(ServiceError) as info:
            asyncio.run(encoder.encode("def f(x): return x " * 10))
    finally:
        encoder.close()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and info.value.reason == "tokenizer_no_tmp"
    assert "set TMPDIR" in info.value.message and info.value.retryable is False

    # A full folder may have room later: retryable, and the part written is removed.
    import errno

    (tmp_path / "full").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "full"))

    for code, words in ((errno.ENOSPC, "No space left on device"), (errno.EDQUOT, "Disk quota exceeded")):
        def full(fd, *args, **kwargs):
            os.close(fd)
            raise OSError(code, words)
        monkeypatch.setattr(os, "fdopen", full)
        encoder = PromptEncoder(TOKENIZER, apart=True, inline_chars=10)
        try:
            with pytest.raises(ServiceError) as info:
                asyncio.run(encoder.encode("def f(x): return x " * 10))
        finally:
            encoder.close()
        assert info.value.reason == "tokenizer_no_tmp" and info.value.retryable is True
        assert words in info.value.message and list((tmp_path / "full").iterdir()) == []


def test_closing_while_the_worker_starts_leaves_it_its_file_and_starts_no_other(tmp_path, monkeypatch, capfd) -> None:
    """The scheduler's stop closes the encoder, maybe while its worker starts: the file was removed
    under the worker, whose start then failed with a traceback, and the text waiting for it started
    a second worker after the close, which nothing ended."""
    import asyncio
    import tempfile
    import time

    from services.scheduler.tokenizing import PromptEncoder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    encoder = PromptEncoder(TOKENIZER, apart=True, inline_chars=10)
    text = "def f(x): return x " * 10

    async def scenario():
        waiting = asyncio.ensure_future(encoder.encode(text))
        await asyncio.sleep(0.01)
        workers = list(encoder._pool._processes.values())
        encoder.close()
        outcome = (await asyncio.gather(waiting, return_exceptions=True))[0]
        return outcome, workers

    outcome, workers = asyncio.run(scenario())
    if isinstance(outcome, ServiceError):   # the worker was gone before it took the text
        assert outcome.code == grpc.StatusCode.UNAVAILABLE and "stopping" in outcome.message
    else:
        assert outcome == TOKENIZER.encode(text, add_special_tokens=False).ids
    assert encoder._pool is None and workers
    deadline = time.monotonic() + 30
    for worker in workers:   # (reaped by the pool's own thread too: its exit code may show a moment late)
        while worker.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.exitcode == 0, worker.exitcode
    # Its start did not fail: a pool worker whose initializer raises prints the traceback and
    # still exits 0.
    assert "Exception in initializer" not in capfd.readouterr().err
    deadline = time.monotonic() + 5
    while list(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.iterdir()) == []


def test_a_long_text_after_close_is_refused_as_the_stop_and_starts_no_worker() -> None:
    import asyncio

    from services.scheduler.tokenizing import PromptEncoder

    encoder = PromptEncoder(TOKENIZER, apart=True, inline_chars=10)
    encoder.close()
    with pytest.raises(ServiceError) as info:
        asyncio.run(encoder.encode("def f(x): return x " * 10))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and info.value.reason == "stopping"
    assert info.value.retryable and encoder._pool is None
    assert asyncio.run(encoder.encode("a b")) == TOKENIZER.encode("a b", add_special_tokens=False).ids   # inline still


def test_no_temporary_folder_is_said_at_the_start_where_texts_go_to_a_worker_and_only_there(monkeypatch) -> None:
    import tempfile

    from structlog.testing import capture_logs

    from services.scheduler.tokenizing import PromptEncoder

    def missing():
        raise FileNotFoundError("No usable temporary directory found in ['/tmp']")
    monkeypatch.setattr(tempfile, "gettempdir", missing)
    with capture_logs() as inline:
        PromptEncoder(TOKENIZER)
    with capture_logs() as apart:
        PromptEncoder(TOKENIZER, apart=True).close()
    assert inline == []
    assert [e["event"] for e in apart] == ["tokenizer_no_tmp"] and "TMPDIR" in apart[0]["advice"]
    assert apart[0]["log_level"] == "warning"


def test_a_worker_pool_that_cannot_be_made_leaves_no_tokenizer_file(tmp_path, monkeypatch) -> None:
    import asyncio
    import tempfile

    from services.scheduler import tokenizing

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def no_pool(*args, **kwargs):
        raise OSError(24, "Too many open files")
    monkeypatch.setattr(tokenizing, "ProcessPoolExecutor", no_pool)
    encoder = tokenizing.PromptEncoder(TOKENIZER, apart=True, inline_chars=10)
    try:
        with pytest.raises(OSError, match="Too many open files"):
            asyncio.run(encoder.encode("def f(x): return x " * 10))
        assert list(tmp_path.iterdir()) == []   # at once, not only at the stop
    finally:
        encoder.close()


def test_a_stop_string_holds_back_one_character_less_than_its_length() -> None:
    """The stream holds back the longest stop string's length less one character (all a stop
    string not yet complete can have written); the rest goes out at once. Holding one more would
    delay every stream with a stop string by a character."""
    x, y, z = (TOKENIZER.token_to_id(ch) for ch in "xyz")
    req = _request(stop=("ab",))
    req.add_tokens([x], 0)
    assert req.take().text == ""          # the last character is held
    req.add_tokens([y], 1)
    assert req.take().text == "x"
    req.add_tokens([z], 1)
    assert req.take().text == "y" and req.finish == scheduler_pb2.FINISH_REASON_UNSPECIFIED
    single = _request(stop=("q",))        # a one-character stop holds nothing back
    single.add_tokens([x], 0)
    assert single.take().text == "x"


def test_without_stop_strings_the_text_is_decoded_when_the_stream_takes_it(monkeypatch) -> None:
    """The step loop takes a step's tokens and sends the next step before any text is decoded (the
    stream's handler decodes when it builds its message); with a stop string the text is decoded at
    once, since it decides whether the request takes another step. Either way the stream and a
    failure's last message get the same text, through every token."""
    ids = TOKENIZER.encode("def add(a, b):\n    return a + b\n", add_special_tokens=False).ids
    decoded: list[str] = []
    real = ActiveRequest._decode
    monkeypatch.setattr(ActiveRequest, "_decode", lambda self: (decoded.append(self.request_id), real(self))[1])

    plain = _request()
    plain.request_id = "plain"
    for i in range(0, 6, 2):
        plain.add_tokens(ids[i:i + 2], 2)
    assert decoded == [] and plain.text == ""          # nothing decoded in the step loop
    first = plain.take()
    assert decoded == ["plain"] and first.text == TOKENIZER.decode(ids[:6]) and list(first.token_ids) == ids[:6]
    plain.add_tokens(ids[6:8], 2)
    plain.fail(ServiceError(grpc.StatusCode.INTERNAL, "verifier lost"))
    assert first.text + plain.take().text == TOKENIZER.decode(ids[:8])   # the tokens before the failure too

    decoded.clear()
    stopped = _request(stop=("return",))
    stopped.request_id = "stopped"
    for i in range(0, len(ids), 2):
        stopped.add_tokens(ids[i:i + 2], 2)
        if stopped.done:
            break
    assert decoded and set(decoded) == {"stopped"} and stopped.finish == scheduler_pb2.FINISH_REASON_STOP
    assert stopped.take().text == TOKENIZER.decode(ids)[:TOKENIZER.decode(ids).index("return")]


def test_budget_0_takes_the_servers_default_budget() -> None:
    """Budget 0 (the SDK's default) is the server's `scheduler.default_budget`, not a budget of 0:
    that would go to the draft as 'no tree' and run every default DDTree request autoregressively
    (with the same tokens, so no end-to-end test would see it)."""
    req = build_request("def f():", max_tokens=4)
    assert req.budget == 0
    assert validate(req, SchedulerSettings(), LIMITS, TOKENIZER).budget == SchedulerSettings().default_budget
    assert validate(req, SchedulerSettings(default_budget=5), LIMITS, TOKENIZER).budget == 5
    assert validate(build_request("def f():", max_tokens=4, budget=3), SchedulerSettings(), LIMITS, TOKENIZER).budget == 3


def test_text_shorter_than_the_hold_goes_out_in_order_once_it_is_safe() -> None:
    """While the output is shorter than what a stop string holds back, nothing is sent; then the
    text goes out in order, never ahead of the hold (a safe length under the sent one would slice
    the text from its end: a middle character out early, the first never)."""
    ids = [TOKENIZER.token_to_id(ch) for ch in "xyzwvu"]
    req = _request(stop=("abcde",))   # holds back 4 characters
    texts = []
    for i, tok in enumerate(ids):
        req.add_tokens([tok], 0 if i == 0 else 1)
        texts.append(req.take().text)
    assert texts == ["", "", "", "", "x", "y"]
    req.end(scheduler_pb2.FINISH_REASON_LENGTH)
    assert "".join(texts) + req.take().text == "xyzwvu"


def test_a_text_of_exactly_the_size_bound_is_tokenized_not_refused_by_its_size() -> None:
    """The size check refuses only past `most * token_bytes` bytes: a text exactly that size may
    still be `most` tokens (each the longest token's bytes), a prompt that fits."""
    token_bytes = max_token_bytes(TOKENIZER)
    longest = next(s for i in range(TOKENIZER.get_vocab_size())
                   if len((s := TOKENIZER.decode([i], skip_special_tokens=False)).encode()) == token_bytes)
    small = Limits(vocab_size=LIMITS.vocab_size, max_context=40, block_size=16, eos_token_ids=(0,), kv_capacity_tokens=4096)
    most = small.max_context - small.block_size - 1
    text = longest * most
    assert len(text.encode()) == most * token_bytes
    assert len(encode_prompt(text, TOKENIZER, small, token_bytes)) == most
    assert len(validate(build_request(text, max_tokens=4), SchedulerSettings(), small, TOKENIZER).prompt_ids) == most
