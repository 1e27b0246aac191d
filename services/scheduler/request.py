"""One request's life in the scheduler: validated parameters, output so far, stop rules, streaming.

The scheduler never touches tensors; it turns token ids into text incrementally and decides when a
request is done (max tokens, EOS, stop token, stop string, max context, abort).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from tokenizers import Tokenizer

from ddtree.v1 import common_pb2, scheduler_pb2
from services.common.grpc_server import ServiceError, reply_feature_rows
from services.common.settings import MAX_BUDGET, TEMPERATURE_RANGE, SchedulerSettings, temperature_ok
from services.scheduler.detokenize import IncrementalDetokenizer

if TYPE_CHECKING:
    from services.scheduler.batcher import KvBudget

__all__ = ["ActiveRequest", "Limits", "MAX_REQUEST_ID_CHARS", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "MAX_STOP_TOKEN_IDS",
           "MESSAGE_MAX_CHARS", "MESSAGE_MAX_TOKENS", "check_text_size", "encode_prompt", "kv_reservation",
           "max_token_bytes", "step_prompt_tokens", "validate"]

# Every step rescans each stop string, and the stream holds back the longest one's length of text:
# a request's stop rules must stay small beside the work of a step.
MAX_STOP_STRINGS = 32
# Stop token ids a request may list: each is checked on the scheduler's event loop, so an
# unbounded list (a 4 MB request holds 1.3M) would hold every other stream up while it is.
MAX_STOP_TOKEN_IDS = 4096
MAX_STOP_CHARS = 1024
MAX_REQUEST_ID_CHARS = 256  # the id is echoed in every message and log line
# The most tokens (and acceptance lengths) and text characters one stream message carries. A client
# far behind gets its unsent output merged; past these it comes in several messages, so that one
# stays well under gRPC's default 4 MB receive cap (16384 ids <= 80 KB, 262144 characters <= 1 MB of
# UTF-8), whatever `scheduler.max_tokens_limit` allows.
MESSAGE_MAX_TOKENS = 16384
MESSAGE_MAX_CHARS = 262144


@dataclass(frozen=True)
class Limits:
    """What the serving stack can take, learned from the draft at start-up."""

    vocab_size: int
    max_context: int
    block_size: int
    eos_token_ids: tuple[int, ...]          # every id that ends a sequence (none: an empty tuple)
    kv_capacity_tokens: int
    kv_page_size: int = 1   # the verifier reserves whole pages
    feature_bytes_per_token: int = 0   # a committed token's features in a verifier reply (0: not known)



def step_prompt_tokens(settings: SchedulerSettings, limits: Limits) -> int:
    """The prompt tokens one step may carry: ``scheduler.max_prefill_tokens``, or fewer where the
    verifier's reply would outgrow gRPC's message cap. The reply carries the features of every token
    the step commits (its prompt tokens, and up to a block a running request), and a long prefill's
    exceed a ring slot, so they go in the message: at Kimi-K2 widths in bf16 a step of about 24K
    prompt tokens passes 1 GiB, and such a step failed every request of the stream. 0 where even a
    step of running requests alone cannot fit (the scheduler's start refuses that)."""
    room = reply_feature_rows(limits.feature_bytes_per_token)
    if room is None:
        return settings.max_prefill_tokens
    return max(0, min(settings.max_prefill_tokens, room - settings.max_batch * limits.block_size))


def kv_reservation(tokens: int, limits: Limits) -> int:
    """The KV the verifier reserves for ``tokens`` tokens: whole pages. Admitting by the tokens
    alone let a full batch's last request find its pages gone (RESOURCE_EXHAUSTED at the
    verifier) where it should have waited in the queue."""
    page = max(1, limits.kv_page_size)
    return -(-tokens // page) * page


@dataclass
class ActiveRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams
    max_tokens: int
    budget: int
    mode: int
    stop: tuple[str, ...]
    stop_ids: frozenset[int]
    eos_ids: frozenset[int]                 # empty when the request ignores EOS
    tokenizer: Tokenizer | None
    kv_tokens: int = 0                      # KV the verifier reserves: prompt + output + one block, in pages
    kv_budget: KvBudget | None = None       # the verifier group's KV it was admitted against, given back there
    draft: str = ""                         # the draft replica this request is pinned to
    wire_id: str = ""                       # what the draft and verifier call it, from admission (batcher.wire_id)
    out_ids: list[int] = field(default_factory=list)
    acceptance: list[int] = field(default_factory=list)
    tree_steps: int = 0                     # of the steps in `acceptance`, those verified with a draft tree
    text: str = ""                          # text decoded so far (before stop truncation)
    emitted_chars: int = 0
    emitted_ids: int = 0
    emitted_steps: int = 0
    finish: int = scheduler_pb2.FINISH_REASON_UNSPECIFIED
    error: ServiceError | None = None
    started: bool = False                   # prefill sent
    prompt_sent: int = 0                    # prompt tokens sent to the draft so far (a long one goes in pieces)
    aborted: bool = False
    left: bool = False                      # its client left (closed its stream, went away) before it ended
    created: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    # Set when there is something new to send (`next_event`). The stream's message is built when its
    # handler is ready to send it, from every step since the last one: a queue of one message a step
    # held ~650 bytes a step for a client that did not read (300 unread streams of 1000 tokens grew
    # the scheduler by 110 MB); merged, a stream holds what it has not sent, about its output.
    news: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _final_sent: bool = False
    _error_sent: bool = False
    # Where the step being taken starts (`out_ids`, `acceptance`) and how far the text was looked
    # through for stop strings: the stop rules' cursors. Not `emitted_*`, which lag behind the steps
    # by as much as the client has not read (the cut after a stop string then decoded every unsent
    # token against the whole output: 3.4 s of the event loop at 8000 unread tokens).
    _step_ids: int = 0
    _step_steps: int = 0
    _checked_chars: int = 0
    _detok: IncrementalDetokenizer | None = field(default=None, repr=False)
    # Tokens `text` does not hold yet: without stop strings the text decides nothing in the step loop,
    # so it is decoded when the stream's message is built (`take`), after the next step has gone out
    # (0.08 ms of the loop between a C=1 step's answer and the next step on a 2-core machine).
    _undecoded: bool = False

    @property
    def done(self) -> bool:
        return self.finish != scheduler_pb2.FINISH_REASON_UNSPECIFIED or self.error is not None

    def add_tokens(self, token_ids: list[int], acceptance_length: int, tree: bool = False) -> None:
        """Takes one step's tokens, applying max_tokens, EOS and stop rules, for the stream's next
        message. ``tree``: the step verified a draft tree for this request (not an autoregressive step)."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        before = self._step_ids = len(self.out_ids)
        self._step_steps = len(self.acceptance)
        for tok in token_ids:
            self.out_ids.append(tok)
            if tok in self.stop_ids or tok in self.eos_ids:
                self.finish = scheduler_pb2.FINISH_REASON_STOP
                break
            if len(self.out_ids) >= self.max_tokens:
                self.finish = scheduler_pb2.FINISH_REASON_LENGTH
                break
        if acceptance_length:  # a step cut short by a stop rule or max_tokens counts the tokens the user gets
            self.acceptance.append(min(acceptance_length, len(self.out_ids) - before))
            self.tree_steps += tree
        if self.stop:   # a stop string ends the request here, before its next step is scheduled
            self._decode()
        else:
            self._undecoded = True
        self.news.set()

    def _catch_up(self) -> None:
        """The text of every token taken so far (`_undecoded`)."""
        if self._undecoded:
            self._decode()

    def take(self) -> scheduler_pb2.GenerateResponse | ServiceError | None:
        """What the stream sends next, None where nothing is new: the output since the last message
        (every step since, in one), then the error that ended the request, if one did."""
        self._catch_up()
        if self._unsent():
            return self._message()
        if self.error is not None and not self._error_sent:
            self._error_sent = True
            return self.error
        return None

    async def next_event(self) -> scheduler_pb2.GenerateResponse | ServiceError:
        """`take`, waiting for something new."""
        while (event := self.take()) is None:
            self.news.clear()
            await self.news.wait()
        return event

    def _unsent(self) -> bool:
        finished = self.finish != scheduler_pb2.FINISH_REASON_UNSPECIFIED
        return self._unsent_output() or (finished and not self._final_sent)

    def _unsent_output(self) -> bool:
        return (len(self.out_ids) > self.emitted_ids or len(self.acceptance) > self.emitted_steps
                or self._safe_chars() > self.emitted_chars)

    def _decode(self) -> None:
        self._undecoded = False
        if self.tokenizer is None:
            return
        ids = self.out_ids
        if self.finish == scheduler_pb2.FINISH_REASON_STOP and ids and ids[-1] in self._hidden_ids():
            ids = ids[:-1]
        if self._detok is None:
            self._detok = IncrementalDetokenizer(self.tokenizer)
        full = self._detok.update(ids, final=self.done)
        self.text = full
        # The stop string completed first ends the output, as it would have with one token a step,
        # whatever the list order or how the tokens came in steps; of two ending together, the one
        # that starts first ("self" over "elf").
        # Not in a last character cut short (a U+FFFD a stop string could name, which the model did not write).
        whole = len(full) - self._detok.unfinished
        found = [(pos + len(s), pos) for s in self.stop
                 if (pos := full.find(s, max(0, self._checked_chars - len(s)), whole)) >= 0]
        self._checked_chars = whole
        if found:
            end, pos = min(found)
            self.text = full[:pos]
            self.finish = scheduler_pb2.FINISH_REASON_STOP
            self._keep_tokens_through(full[:end])

    def _keep_tokens_through(self, head: str) -> None:
        """Drops the tokens past the one that completes a stop string (a verify step may accept
        several), so that token_ids and usage end where the text does, as for a stop token. The
        candidates decode from the detokenizer's window on, whose text before it is known (from
        the first token, the step that ended a 30k-token output took 32 ms of the event loop)."""
        start, before = self._detok.anchor(self.out_ids) if self._detok is not None else (0, "")
        if start > self._step_ids or not head.startswith(before):
            start, before = 0, ""
        rest = head[len(before):]
        for k in range(self._step_ids + 1, len(self.out_ids) + 1):
            got = self.tokenizer.decode(self.out_ids[start:k], skip_special_tokens=False)
            if got.endswith("\ufffd") and self._detok is not None and self._detok.ends_inside_a_character(self.out_ids[:k]):
                got = got[:-1]   # the lead of a character the next token completes: not the stop's U+FFFD
            if got.startswith(rest):
                if len(self.acceptance) > self._step_steps:  # the tokens cut were this step's
                    self.acceptance[-1] = max(1, self.acceptance[-1] - (len(self.out_ids) - k))
                del self.out_ids[k:]
                return

    def _hidden_ids(self) -> frozenset[int]:
        return self.stop_ids | self.eos_ids

    def _safe_chars(self) -> int:
        """The text that is safe to show (not a possible stop-string prefix): through its last whole
        character (the detokenizer's), all of it at the finish or a failure."""
        safe = len(self.text)
        if self.finish == scheduler_pb2.FINISH_REASON_UNSPECIFIED and self.error is None:
            hold = max((len(s) - 1 for s in self.stop), default=0)
            safe = max(self.emitted_chars, safe - hold)
        return safe

    def _message(self) -> scheduler_pb2.GenerateResponse:
        """The tokens and safe text not sent yet, up to a message's caps; the finish and usage with
        the last of them once finished (not on a failure's last tokens: the error follows them)."""
        ids = min(len(self.out_ids), self.emitted_ids + MESSAGE_MAX_TOKENS)
        chars = min(self._safe_chars(), self.emitted_chars + MESSAGE_MAX_CHARS)
        steps = min(len(self.acceptance), self.emitted_steps + MESSAGE_MAX_TOKENS)
        msg = scheduler_pb2.GenerateResponse(
            request_id=self.request_id, token_ids=self.out_ids[self.emitted_ids:ids],
            text=self.text[self.emitted_chars:chars], acceptance_lengths=self.acceptance[self.emitted_steps:steps])
        self.emitted_ids, self.emitted_chars, self.emitted_steps = ids, chars, steps
        if self.finish != scheduler_pb2.FINISH_REASON_UNSPECIFIED and not self._unsent_output():
            msg.finish_reason = self.finish
            msg.usage.CopyFrom(self.usage())
            self._final_sent = True
        return msg

    def usage(self) -> scheduler_pb2.Usage:
        steps = len(self.acceptance)
        return scheduler_pb2.Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.out_ids),
                                   steps=steps, mean_acceptance=sum(self.acceptance) / steps if steps else 0.0,
                                   tree_steps=self.tree_steps)

    def end(self, finish: int) -> None:
        """Ends the stream with a reason (abort, length at max context) and whatever is left."""
        if self.done:
            return
        self.finish = finish
        self._step_ids, self._step_steps = len(self.out_ids), len(self.acceptance)   # no step: nothing to cut
        self._decode()
        self.news.set()

    def fail(self, error: ServiceError) -> None:
        if self.done:
            return
        self._catch_up()   # the tokens before the failure, decoded as they came
        self.error = error
        if self._detok is not None:   # no token follows: the text held back (a stop's possible start,
            self.text = self._detok.update(self.out_ids, final=True)   # a character's first bytes) is output
        self.news.set()


def max_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes one token decodes to (at least its raw bytes: a partial character
    decodes to U+FFFD, three bytes), so a text of B bytes is at least B / this many tokens."""
    pieces = tokenizer.decode_batch([[i] for i in range(tokenizer.get_vocab_size(with_added_tokens=True))],
                                    skip_special_tokens=False)
    return max((len(p.encode("utf-8", "surrogatepass")) for p in pieces), default=1) or 1


def check_text_size(text: str, limits: Limits, token_bytes: int) -> None:
    """Refuses a text too long for the context by its size alone, before anyone tokenizes it (a
    4 MB text took 10 s to tokenize)."""
    most = limits.max_context - limits.block_size - 1   # as `validate` counts a prompt's tokens
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > most * token_bytes:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"prompt text of {size} bytes is more than {most} tokens (a token is at most {token_bytes} "
                           f"bytes); max context is {limits.max_context} ({most} prompt tokens at most, leaving "
                           f"room for one tree)", "prompt_too_long")


def encode_prompt(text: str, tokenizer: Tokenizer, limits: Limits, token_bytes: int) -> list[int]:
    """A text prompt's token ids, inline (the server encodes through ``tokenizing.PromptEncoder``)."""
    check_text_size(text, limits, token_bytes)
    try:
        return tokenizer.encode(text, add_special_tokens=False).ids
    except Exception as exc:  # noqa: BLE001 - the tokenizer's own error type (e.g. a lone surrogate)
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt text cannot be tokenized: {exc}") from None


def validate(req: scheduler_pb2.GenerateRequest, settings: SchedulerSettings, limits: Limits,
             tokenizer: Tokenizer | None, text_ids: list[int] | None = None) -> ActiveRequest:
    """Checks every field a client sets; the error names the field so the caller can fix it.
    ``text_ids``: the text prompt already tokenized (``encode_prompt``), else it is done here."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    check_fields(req, settings, limits, tokenizer)
    which = req.WhichOneof("prompt")
    if which == "text":
        prompt = text_ids if text_ids is not None else encode_prompt(req.text, tokenizer, limits, max_token_bytes(tokenizer))
    elif which == "token_ids":
        prompt = list(req.token_ids.ids)
    else:
        prompt = []
    if not prompt:
        raise ServiceError(invalid, "prompt is empty: set text or token_ids")
    room = limits.max_context - limits.block_size
    if len(prompt) >= room:   # before the per-id check: a huge prompt is refused without a walk over it
        raise ServiceError(invalid, f"prompt has {len(prompt)} tokens; max context is {limits.max_context} "
                                    f"({room - 1} prompt tokens at most, leaving room for one tree)", "prompt_too_long")
    for i, t in enumerate(prompt):
        if not 0 <= t < limits.vocab_size:
            raise ServiceError(invalid, f"prompt.token_ids[{i}] = {t} is outside the vocabulary [0, {limits.vocab_size})")
    s = req.sampling
    mode = req.mode
    if mode == common_pb2.MODE_UNSPECIFIED:
        mode = common_pb2.MODE_DDTREE if settings.default_mode == "ddtree" else common_pb2.MODE_AUTOREGRESSIVE
    max_tokens = min(req.max_tokens, limits.max_context - limits.block_size - len(prompt))
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(s)
    if s.top_p == 0:
        sampling.top_p = 1.0
    return ActiveRequest(
        request_id=req.request_id or uuid.uuid4().hex, prompt_ids=prompt, sampling=sampling,
        max_tokens=max_tokens, budget=req.budget or settings.default_budget, mode=mode, stop=tuple(req.stop),
        stop_ids=frozenset(req.stop_token_ids), eos_ids=frozenset() if req.ignore_eos else frozenset(limits.eos_token_ids),
        tokenizer=tokenizer, kv_tokens=kv_reservation(len(prompt) + max_tokens + limits.block_size, limits))


def check_request_id(request_id: str, required: bool = False) -> None:
    """An id no request could have is refused, by Generate and by Abort alike (an Abort of one
    answered "not found", as for an id that had ended). Generate's may be empty (one is made);
    ``required``: Abort's, which names a request, may not."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    if required and not request_id:
        raise ServiceError(invalid, "request_id is required: the id of the request to abort")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ServiceError(invalid, f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    if not request_id.isprintable():   # it is logged: an escape sequence or a line break there forges or hides lines
        raise ServiceError(invalid, "request_id must be printable text: no control characters, line breaks "
                                    f"or spaces other than ' ' (got {request_id!r})")


def check_fields(req: scheduler_pb2.GenerateRequest, settings: SchedulerSettings, limits: Limits,
                 tokenizer: Tokenizer | None) -> None:
    """The checks of every field but the prompt's tokens, which need no tokenizer: run before a
    long text is tokenized too (a request with max_tokens 0 behind other long texts waited seconds
    for its INVALID_ARGUMENT, or got the tokenizer queue's RESOURCE_EXHAUSTED, which clients retry)."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    check_request_id(req.request_id)
    if req.WhichOneof("prompt") == "text":
        if not req.text:
            raise ServiceError(invalid, "prompt is empty: set text or token_ids")
        if tokenizer is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "this server has no tokenizer (a model directory without tokenizer.json or tiktoken.model under "
                               "`ddtree up`, an empty scheduler.tokenizer_path under `ddtree serve`); send prompt as token_ids")
    if req.max_tokens <= 0:
        raise ServiceError(invalid, f"max_tokens must be > 0 (got {req.max_tokens})")
    if req.max_tokens > settings.max_tokens_limit:
        raise ServiceError(invalid, f"max_tokens {req.max_tokens} exceeds this server's limit "
                                    f"{settings.max_tokens_limit}")
    if req.budget != 0 and not 1 <= req.budget <= MAX_BUDGET:
        raise ServiceError(invalid, f"budget must be in 1..{MAX_BUDGET}, or 0 for the server's default "
                                    f"(got {req.budget})")
    if req.mode not in (common_pb2.MODE_UNSPECIFIED, common_pb2.MODE_DDTREE, common_pb2.MODE_AUTOREGRESSIVE):
        raise ServiceError(invalid, f"mode {req.mode} is not a Mode (ddtree or autoregressive)")
    s = req.sampling
    lo, hi = TEMPERATURE_RANGE
    if not temperature_ok(s.temperature):  # also catches NaN and inf
        raise ServiceError(invalid, f"sampling.temperature must be 0 (greedy) or in [{lo:g}, {hi:g}] "
                                    f"(got {s.temperature:g})")   # the wire's float32, not its 17 digits
    if not 0 <= s.top_p <= 1:
        raise ServiceError(invalid, f"sampling.top_p must be in [0, 1] (0 or 1: no nucleus cut; got {s.top_p})")
    if s.top_k < 0:
        raise ServiceError(invalid, f"sampling.top_k must be >= 0 (got {s.top_k})")
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ServiceError(invalid, f"stop_token_ids has {len(req.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    for i, t in enumerate(req.stop_token_ids):
        if not 0 <= t < limits.vocab_size:
            raise ServiceError(invalid, f"stop_token_ids[{i}] = {t} is outside the vocabulary")
    if len(req.stop) > MAX_STOP_STRINGS:
        raise ServiceError(invalid, f"stop has {len(req.stop)} strings; at most {MAX_STOP_STRINGS}")
    if any(not s for s in req.stop):
        raise ServiceError(invalid, "stop strings must not be empty")
    if any(len(s) > MAX_STOP_CHARS for s in req.stop):
        raise ServiceError(invalid, f"a stop string is longer than {MAX_STOP_CHARS} characters")
    if req.stop and tokenizer is None:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "stop strings need a tokenizer on the server")
