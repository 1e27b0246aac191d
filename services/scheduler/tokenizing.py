"""Text prompts tokenized beside the scheduler's event loop, not on it.

Why: the `tokenizers` library keeps the GIL while it encodes, so a long text held every stream the
scheduler serves for as long as it took (460 KB: 0.7 s on the CI machine; a thread does not help).
A worker process encodes long texts; short ones, the common case, stay inline, where the round trip
to a process would cost more than the encode itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import grpc
from tokenizers import Tokenizer

from services.common.grpc_server import ServiceError, exit_when_orphaned
from services.common.logging import get_logger

__all__ = ["INLINE_CHARS", "PromptEncoder"]

INLINE_CHARS = 16384  # texts up to this long encode inline (a few ms at most)
# Long texts waiting for the one worker at most: each may take a second, and a client sending many
# (before any admission check counts them) held every other long prompt behind them.
MAX_PENDING = 32

log = get_logger("scheduler")
_worker: Tokenizer | None = None  # the worker process's own copy


def _load(path: str, parent_pid: int, poll_s: float = 1.0) -> None:
    """The worker's start: its tokenizer, read from the file the scheduler wrote for this worker
    and removed once read, and a watch that ends it once the scheduler is gone. A scheduler killed
    outright (SIGKILL, the OOM killer) cannot stop its pool, and the worker stayed behind, one more
    for each restart."""
    global _worker
    _worker = Tokenizer.from_file(path)
    os.unlink(path)
    exit_when_orphaned(parent_pid, 0, poll_s)


def _encode(text: str) -> list[int]:
    assert _worker is not None
    return _worker.encode(text, add_special_tokens=False).ids


class PromptEncoder:
    """``encode(text)``: the text's token ids (no special tokens added); with ``apart``, long texts
    in a worker process started on first use, else all inline."""

    def __init__(self, tokenizer: Tokenizer, apart: bool = False, inline_chars: int = INLINE_CHARS,
                 max_pending: int = MAX_PENDING) -> None:
        self.tokenizer = tokenizer
        # serialised now, at start-up: 0.1 s for Kimi-K2's vocabulary, too long for the event loop
        self._source = tokenizer.to_str() if apart else None
        self.inline_chars = inline_chars
        self.max_pending = max_pending
        self._pending = 0
        self._pool: ProcessPoolExecutor | None = None
        # The file written for the current pool's worker, which removes it once read; the scheduler
        # removes it where the worker died (or never started) first.
        self._source_file: str | None = None
        self._retrying = asyncio.Lock()   # texts sent again after a worker died: one at a time
        self._closed = False
        if apart:
            try:   # said at the start, not only at the first long text
                tempfile.gettempdir()
            except FileNotFoundError as exc:
                log.warning("tokenizer_no_tmp", error=str(exc),
                            advice="long text prompts will be refused; set TMPDIR to a writable folder")

    async def encode(self, text: str) -> list[int]:
        """Raises ``ServiceError`` RESOURCE_EXHAUSTED where ``max_pending`` long texts wait already."""
        if self._source is None or len(text) <= self.inline_chars:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        if self._pending >= self.max_pending:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self._pending} long prompts wait to be tokenized already; try again shortly",
                               "tokenizer_busy")
        self._pending += 1
        try:
            return await self._encode_apart(text)
        finally:
            self._pending -= 1

    async def _encode_apart(self, text: str) -> list[int]:
        """In the worker; one that died is replaced, and each text that waited for it is sent again,
        one at a time, so a second death is the text's own: it fails alone. Never inline: the long
        texts that waited for the dead worker (up to ``max_pending``, of up to 4 MB) encoded one
        after another on the event loop held every stream for seconds, and a text that killed the
        worker (its memory) was then encoded in the scheduler itself."""
        try:
            return await self._in_worker(text)
        except BrokenProcessPool:
            pass
        async with self._retrying:
            try:
                return await self._in_worker(text)
            except BrokenProcessPool:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the tokenizing worker died twice on this prompt "
                                                                "(its memory?); send it as token ids",
                                   "tokenizer_died", retryable=False) from None

    async def _in_worker(self, text: str) -> list[int]:
        if self._closed:   # a text sent again after `close` broke the pool: no new worker
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the scheduler is stopping", "stopping")
        if self._pool is None:  # spawn, not fork: this process runs gRPC's threads
            # The tokenizer goes by a file, not in the start's arguments: spawn writes those to the
            # child's pipe on this thread, and past the pipe's 64 KB (the demo tokenizer is 100 KB)
            # the write waits for the child to read it. That held every stream for the child's
            # start, and for good where the child died first (the parent keeps the pipe's read end).
            self._source_file = self._write_source()
            try:
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_load, initargs=(self._source_file, os.getpid()))
            except BaseException:
                self._drop_source_file()
                raise
        pool = self._pool
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, _encode, text)
        except BrokenProcessPool as exc:
            if self._pool is pool:   # the first of its waiters to hear of it says so, and replaces it
                log.warning("tokenizer_worker_lost", error=str(exc), pending=self._pending)
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
                self._drop_source_file()   # where the worker died before it read the file
            raise

    def _write_source(self) -> str:
        """The tokenizer in a new temporary file (Kimi-K2's: milliseconds, once a worker start)."""
        assert self._source is not None
        path = None
        try:
            fd, path = tempfile.mkstemp(prefix="ddtree-tokenizer-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self._source)
        except OSError as exc:
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):   # a full folder (or quota) may have room later
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"no room for the tokenizing worker's tokenizer "
                                                                f"in the temporary folder ({exc}); retry, or send "
                                                                f"token ids", "tokenizer_no_tmp", retryable=True) from None
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"long text prompts need a writable temporary folder "
                                                            f"({exc}); set TMPDIR, or send token ids",
                               "tokenizer_no_tmp", retryable=False) from None
        return path

    def _drop_source_file(self) -> None:
        if self._source_file is not None:
            with contextlib.suppress(FileNotFoundError):   # the worker read and removed it
                os.unlink(self._source_file)
            self._source_file = None

    def close(self) -> None:
        """Ends the worker. A worker still starting reads and removes its file itself: removed
        here, it failed its start with a traceback, and the texts waiting for it started a new
        worker after the close."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            self._source_file = None   # its worker's to remove
        else:
            self._drop_source_file()
