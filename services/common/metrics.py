"""Prometheus metrics, one registry per process, named with the shared stage vocabulary.

Stages (`ddtree_step_ms{stage=...}`; README "Metrics" says what each service times): scheduler
step_rpc, scheduler; draft ahead_wait, step, draft (propose, propose_cpu, tree), verifier_rpc,
context_commit, draft_ahead, verify, transport; verifier stream_step, verify, commit, features.
Each service serves `/metrics` over HTTP on its `metrics_port` (0 = off).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector,
                               make_wsgi_app)
from prometheus_client.exposition import ThreadingWSGIServer

from services.common.settings import cannot_listen

if TYPE_CHECKING:   # the scheduler imports this module and runs without torch
    import torch

__all__ = ["Metrics", "serve_metrics"]

# From a GPU stage's tenth of a millisecond to a CPU step of seconds, up to `step_timeout_s`'s 60 s
# (the lowest bucket was 0.5 ms: every scheduler, draft-wait and feature observation fell in it).
_STEP_BUCKETS_MS = (0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000,
                    60000)
# Request latencies, in seconds: a queued request can wait minutes behind a full batch.
_REQUEST_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Acceptance up to budget 128's longest path and its bonus token.
_ACCEPTANCE_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 129)


# The metrics each service exports: the ones it updates. Registered everywhere, the others read 0
# forever there (a draft replica's ddtree_generated_tokens_total, its ddtree_transport_peers beside
# a live ring), and a per-replica dashboard built on them was flat without a hint why.
_EXPORTS = {
    "scheduler": {"tokens", "requests", "refused", "acceptance", "step_ms", "queue_depth", "running",
                  "replica_up", "kv_reserved", "kv_capacity", "queue_seconds", "ttft_seconds", "request_seconds",
                  "speculation_pauses"},
    "draft": {"step_ms", "draft_trees", "running", "ring_inline_fallbacks", "gpu_memory_allocated"},
    "verifier": {"step_ms", "running", "kv_pages_free", "kv_pages_total", "peers", "ring_slots_in_use",
                 "ring_inline_fallbacks", "gpu_memory_allocated"},
}
# The ring's fallback reasons each service can raise, exported at 0 from the start: the draft's
# features never go through a ring of its own, so ring_full / ring_error would stay 0 there forever.
_FALLBACK_REASONS = {"draft": ("slot_too_small",)}


class Metrics:
    """The stack's metrics; a service exports (and updates) its own, `_EXPORTS[service]` (another
    name, a test's, exports them all). The others exist unregistered, so shared code may update
    any without a check."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        # Process start time (a restart shows as a new value), CPU seconds and memory, as a default
        # registry would have them: this one is per process and starts empty.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        exported = _EXPORTS.get(service)

        def r(attribute: str) -> CollectorRegistry | None:
            return self.registry if exported is None or attribute in exported else None

        self.tokens = Counter("ddtree_generated_tokens", "Tokens streamed to clients", registry=r("tokens"))
        self.requests = Counter("ddtree_requests", "Requests by final status", ["status"], registry=r("requests"))
        self.refused = Counter("ddtree_requests_refused", "Requests refused before they ran, by gRPC code and "
                               "reason (queue_full, no_replica, prompt_too_long, ...; the code where it has one "
                               "cause)", ["code", "reason"], registry=r("refused"))
        self.acceptance = Histogram("ddtree_acceptance_length", "Tokens a tree step's verify accepted (bonus "
                                    "included; autoregressive and paused steps left out)",
                                    buckets=_ACCEPTANCE_BUCKETS, registry=r("acceptance"))
        self.step_ms = Histogram("ddtree_step_ms", "Step time by stage", ["stage"], buckets=_STEP_BUCKETS_MS,
                                 registry=r("step_ms"))
        self.queue_seconds = Histogram("ddtree_request_queue_seconds", "Time from a request's arrival at "
                                       "the scheduler to its admission into a batch", buckets=_REQUEST_BUCKETS_S,
                                       registry=r("queue_seconds"))
        self.ttft_seconds = Histogram("ddtree_time_to_first_token_seconds", "Time from a request's arrival at "
                                      "the scheduler to its first token", buckets=_REQUEST_BUCKETS_S,
                                      registry=r("ttft_seconds"))
        self.request_seconds = Histogram("ddtree_request_duration_seconds", "Time from a request's arrival at the "
                                         "scheduler to its end, by final status", ["status"], buckets=_REQUEST_BUCKETS_S,
                                         registry=r("request_seconds"))
        self.draft_trees = Counter("ddtree_draft_trees", "Draft trees (more than the root) sent to the verifier, by "
                                   "when they were drafted (ahead: while the last step's answer travelled; step: in "
                                   "the step)",
                                   ["drafted"], registry=r("draft_trees"))
        for drafted in ("ahead", "step"):   # both on the page from the start (a root alone counts in neither)
            self.draft_trees.labels(drafted)
        self.queue_depth = Gauge("ddtree_queue_depth", "Requests waiting for admission", registry=r("queue_depth"))
        self.running = Gauge("ddtree_running_requests", "Requests being decoded", registry=r("running"))
        self.kv_pages_free = Gauge("ddtree_kv_pages_free", "Free KV cache pages", registry=r("kv_pages_free"))
        self.kv_pages_total = Gauge("ddtree_kv_pages_total", "KV cache pages", registry=r("kv_pages_total"))
        # The scheduler's view, read when scraped: which replicas it steps, what it has admitted.
        self.replica_up = Gauge("ddtree_draft_replica_up", "Draft replicas the scheduler knows: 1 while it "
                                "steps them, 0 while marked down", ["draft"], registry=r("replica_up"))
        self.speculation_pauses = Counter("ddtree_speculation_pauses", "Pauses of speculation on a draft replica's "
                                          "batch (its trees' acceptance fell below scheduler.spec_min_acceptance; "
                                          "autoregressive steps follow)", ["draft"], registry=r("speculation_pauses"))
        self.kv_reserved = Gauge("ddtree_kv_tokens_reserved", "KV tokens reserved for admitted requests (prompt + "
                                 "max_tokens + one block each), by verifier group", ["verifier"],
                                 registry=r("kv_reserved"))
        self.kv_capacity = Gauge("ddtree_kv_tokens_capacity", "KV tokens a verifier group holds, as its "
                                 "replicas report it", ["verifier"], registry=r("kv_capacity"))
        # What a dead peer must give back: its stream, its ring slots, the ring's memory.
        self.peers = Gauge("ddtree_transport_peers", "Drafts hand-shaken here, their verify stream open or still "
                           "awaited (up to verifier.peer_stream_timeout_s)", registry=r("peers"))
        self.ring_slots_in_use = Gauge("ddtree_ring_slots_in_use", "Shared-buffer slots peers have not released",
                                       registry=r("ring_slots_in_use"))
        self.ring_inline_fallbacks = Counter(
            "ddtree_ring_inline_fallbacks", "Messages sent inside the gRPC message instead of a ring slot, by reason: "
            "slot_too_small (raise ring_slot_bytes if this grows); the verifier's features also ring_full (the "
            "draft held every slot: raise ring_slots), ring_error (the slot could not be written: /dev/shm full)",
            ["reason"], registry=r("ring_inline_fallbacks"))
        for reason in _FALLBACK_REASONS.get(service, ("slot_too_small", "ring_full", "ring_error")):
            self.ring_inline_fallbacks.labels(reason)
        self.gpu_memory_allocated = Gauge("ddtree_gpu_memory_allocated_bytes",
                                          "Bytes of live tensors on this service's GPU (torch allocator)",
                                          registry=r("gpu_memory_allocated"))
        self.service = service

    def track_gpu_memory(self, device: torch.device) -> None:
        """Reports `device`'s allocated bytes (nothing off CUDA). Read at scrape time:
        torch.cuda.memory_allocated builds the allocator's whole stats dict, which stood out in a
        profile of the demo stack when it ran after every step."""
        if device.type == "cuda":
            import torch

            self.gpu_memory_allocated.set_function(lambda: torch.cuda.memory_allocated(device))


# A /metrics connection that sends no request this long is closed.
METRICS_IDLE_S = 10.0


class _ScrapeHandler(WSGIRequestHandler):
    """One /metrics connection: logs nothing, and gives up on a client that sends no request within
    METRICS_IDLE_S. prometheus_client's own server waits for ever, a thread and an fd each: 300
    idle connections held 300 of both until they were closed."""

    timeout = METRICS_IDLE_S   # each read; the whole request gets as long (`setup`)

    def setup(self) -> None:
        super().setup()
        # A client that sends a byte now and then never meets the per-read timeout: its request,
        # headers included, must have come by then, or the connection is shut.
        self._deadline = threading.Timer(self.timeout, self._give_up)
        self._deadline.daemon = True
        self._deadline.start()

    def _give_up(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def parse_request(self) -> bool:
        try:
            return super().parse_request()
        finally:
            self._deadline.cancel()

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


class _ScrapeServer(ThreadingWSGIServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A client that timed out or went: no traceback (the base class prints one to stderr)."""
        if not isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError)):
            super().handle_error(request, client_address)


def serve_metrics(metrics: Metrics, host: str, port: int) -> int | None:
    """Starts the /metrics HTTP endpoint (prometheus_client's app, in a thread a connection);
    returns the port, or None when disabled (port 0)."""
    if port <= 0:
        return None
    try:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
        server = make_server(host, port, make_wsgi_app(metrics.registry),
                             type("ScrapeServer", (_ScrapeServer,), {"address_family": family}),
                             handler_class=_ScrapeHandler)
    except (OSError, UnicodeError) as exc:
        raise cannot_listen(exc, host, port, f"{metrics.service}.metrics_port") from None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server.server_port
