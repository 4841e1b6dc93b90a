"""`hybridkv serve --metrics-port`: the server's figures as Prometheus text at /metrics (prometheus_client).

The HTTP server runs on its own thread. A scrape asks the loop for a fresh snapshot (`Telemetry.fresh`: one
flag and a wake-up; the loop builds it between two requests from the counters it keeps anyway) and turns
it into metric families here, off the loop thread. Labels are bounded: request types, error codes, tiers,
directions; never a request id, an engine or a namespace. docs/metrics.md lists every metric.

A scraper cannot take what engines need: the endpoint holds at most MAX_CONNECTIONS connections (one more is
closed at once) and each for at most CONNECTION_S, whatever it sends or does not read (prometheus_client's own
server had a thread and a file for every connection, for as long as the client kept it open).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from hybridkv import __version__
from hybridkv.server.books.telemetry import BUCKETS_S, Snapshot, Telemetry

log = logging.getLogger("hybridkv.server")

SCRAPE_WAIT_S = 1.0  # a loop busier than this answers a scrape with its last snapshot (see snapshot_age)
MAX_CONNECTIONS = 16  # at once; within connections.FD_RESERVE, the files the engines' gate leaves to the server
CONNECTION_S = 10.0  # a connection's whole life: one request and its answer (Prometheus's default scrape timeout)


class MetricsError(ValueError):
    """A metrics endpoint that cannot be served; the message names the flag and the value."""


def check_metrics_address(host: str, port: int) -> tuple[str, int]:
    """(host, port) for --metrics-host / --metrics-port: an IP address (or localhost) and 0..65535 (0: any free
    port, printed on the ready line)."""
    if not 0 <= port <= 65535:
        raise MetricsError(f"--metrics-port must be in 0..65535 (0: any free port), got {port}")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise MetricsError(f"--metrics-host must be an IP address such as 127.0.0.1 (or localhost), "
                               f"got {host!r}") from None
    return host, port


class SnapshotCollector(Collector):
    """Metric families built from the latest snapshot the loop published."""

    def __init__(self, telemetry: Telemetry, wake: Callable[[], None]):
        self.telemetry, self.wake = telemetry, wake

    def collect(self) -> Iterator:
        snap = self.telemetry.fresh(self.wake, SCRAPE_WAIT_S)
        if snap is None:  # the loop has not answered any scrape yet and is busy past SCRAPE_WAIT_S
            return
        yield from families(snap, time.monotonic())


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _labelled(cls: type, name: str, doc: str, label: str, values: dict[str, float]):
    fam = cls(name, doc, labels=[label])
    for k, v in values.items():
        fam.add_metric([k], v)
    return fam


def families(snap: Snapshot, now: float) -> Iterator:
    """Every hybridkv_ metric family of one snapshot."""
    f, lim = snap.figures, snap.limits
    yield InfoMetricFamily("hybridkv_server", "the cache server's version", value={"version": __version__})
    yield _gauge("hybridkv_uptime_seconds", "seconds since the server started", f["uptime_s"])
    yield _gauge("hybridkv_snapshot_age_seconds", "age of the figures served (above 1 s: the loop was busy)",
                 now - snap.taken)
    yield _counter("hybridkv_messages", "messages received, decodable or not", f["requests"])

    requests = CounterMetricFamily("hybridkv_requests", "requests answered, by request type", labels=["type"])
    latency = HistogramMetricFamily("hybridkv_request_duration_seconds", "request receipt to reply sent, by "
                                    "request type (a lookup that waits for L2 reads included)", labels=["type"])
    for kind, (counts, total) in snap.latency.items():
        n = sum(counts)
        if not n:
            continue
        requests.add_metric([kind], n)
        cumulative, buckets = 0, []
        for bound, c in zip((*BUCKETS_S, math.inf), counts, strict=True):
            cumulative += c
            buckets.append(("+Inf" if bound == math.inf else repr(bound), cumulative))
        latency.add_metric([kind], buckets, total)
    yield requests
    yield latency
    errors = CounterMetricFamily("hybridkv_request_errors", "error replies, by request type and error code",
                                 labels=["type", "code"])
    for (kind, code), n in sorted(snap.errors.items()):
        errors.add_metric([kind, code], n)
    yield errors

    # hits and misses, in chunks and tokens, by tier
    hit_l2, hit_probe = f["hit_chunks_l2"], f["probe_hit_chunks"]
    tok_l2, tok_probe = f["hit_tokens_l2"], f["probe_hit_tokens"]
    yield _labelled(CounterMetricFamily, "hybridkv_hit_chunks", "chunks of lookups' hits, by where they came "
                    "from: l1, l2 (a lookup read an object back from L2), probe (pin=false, nothing moved)", "tier",
                    {"l1": f["hit_chunks"] - hit_l2 - hit_probe, "l2": hit_l2, "probe": hit_probe})
    yield _labelled(CounterMetricFamily, "hybridkv_hit_tokens", "tokens of lookups' hits, by tier", "tier",
                    {"l1": f["hit_tokens"] - tok_l2 - tok_probe, "l2": tok_l2, "probe": tok_probe})
    yield _counter("hybridkv_miss_chunks", "chunks looked up beyond the hit", f["lookup_chunks"] - f["hit_chunks"])
    yield _counter("hybridkv_miss_tokens", "tokens (of whole chunks) looked up beyond the hit",
                   f["lookup_tokens"] - f["hit_tokens"])
    yield _counter("hybridkv_lookup_l2_waits", "pinned lookups that waited for an L2 read", f["lookup_l2_waits"])

    yield _labelled(CounterMetricFamily, "hybridkv_bytes", "payload bytes: stored (committed), loaded (pinned by "
                    "lookups for their engines), spilled (L1 -> L2), reloaded (L2 -> L1)", "op",
                    {"stored": f["bytes_committed"], "loaded": f["bytes_leased"], "spilled": f["l2_spill_bytes"],
                     "reloaded": f["l2_prefetch_bytes"]})
    yield _labelled(CounterMetricFamily, "hybridkv_store_objects", "objects of store requests, by outcome",
                    "result", {"committed": f["objects_committed"], "present": f["objects_skipped_present"],
                               "refused": f["objects_refused"], "aborted": f["objects_aborted"]})
    yield _labelled(CounterMetricFamily, "hybridkv_fenced_commits", "commits sent with their copies, by outcome: "
                    "published (the fence word showed), timeout (it did not within --client-timeout)", "result",
                    {"published": f["commits_fenced"], "timeout": f["fence_timeouts"]})
    yield _labelled(CounterMetricFamily, "hybridkv_prefetch_objects", "objects of Prefetch requests, by outcome",
                    "result", {"started": f["prefetch_objects_started"], "in_l1": f["prefetch_objects_in_l1"],
                               "refused": f["prefetch_objects_refused"]})

    # tiers
    has_l2 = "l2_capacity_bytes" in f
    used = {"l1": f["l1_bytes_used"], **({"l2": f["l2_bytes"]} if has_l2 else {})}
    cap = {"l1": f["l1_capacity_bytes"], **({"l2": f["l2_capacity_bytes"]} if has_l2 else {})}
    yield _labelled(GaugeMetricFamily, "hybridkv_tier_used_bytes", "bytes held, by tier", "tier", used)
    yield _labelled(GaugeMetricFamily, "hybridkv_tier_capacity_bytes", "capacity, by tier", "tier", cap)
    yield _labelled(GaugeMetricFamily, "hybridkv_tier_objects", "objects held, by tier", "tier",
                    {"l1": f["l1_objects"], **({"l2": f["l2_objects"]} if has_l2 else {})})
    states = {"ready": f["l1_objects"] - f["l1_unready_objects"], "reserved_or_loading": f["l1_unready_objects"],
              "pinned": f["l1_pinned_objects"], "quarantined": f["l1_quarantined_slots"]}
    yield _labelled(GaugeMetricFamily, "hybridkv_l1_objects", "L1 objects by state (pinned: ready and held by a "
                    "lease; quarantined: reclaimed slots not reused yet)", "state", states)
    yield _labelled(CounterMetricFamily, "hybridkv_evictions", "objects evicted, by tier", "tier",
                    {"l1": f["l1_evictions"], **({"l2": f.get("l2_evictions", 0)} if has_l2 else {})})
    yield _gauge("hybridkv_arena_bytes", "size of the shared-memory L1 arena", f["arena_bytes"])
    if has_l2:
        yield _counter("hybridkv_l2_corrupt_removed", "L2 objects that failed their checks and were removed",
                       f.get("l2_corrupt_removed", 0))
        yield _labelled(CounterMetricFamily, "hybridkv_l2_errors", "failed L2 operations: spill and reload as the "
                        "server saw them, store as the adapter counted them (writes or store requests)", "op",
                        {"spill": f["l2_spill_failures"], "reload": f["l2_prefetch_failures"],
                         "store": f.get("l2_write_errors", f.get("l2_store_errors", 0))})
        yield _counter("hybridkv_l2_clear_walks", "walks of the L2 index for Clears (the Clears waiting share one)",
                       f["l2_clear_walks"])
        if "l2_store_up" in f:
            yield _gauge("hybridkv_l2_up", "1 while the shared L2 store answers (0: backing off, lookups miss)",
                         f["l2_store_up"])

    # sessions against their limits
    yield _gauge("hybridkv_engines", "registered engines", f["engines"])
    yield _gauge("hybridkv_engines_limit", "--max-engines", lim["max_engines"])
    yield _gauge("hybridkv_namespaces", "distinct namespaces of the registered engines (a count: never a label)",
                 f["namespaces"])
    yield _gauge("hybridkv_leases", "leases held, all engines", f["leases"])
    yield _gauge("hybridkv_leases_max_engine", "leases held by the engine that holds the most", f["leases_max_engine"])
    yield _gauge("hybridkv_leases_limit", "--max-leases (per engine)", lim["max_leases"])
    yield _gauge("hybridkv_reservations", "open store reservations, all engines", f["reservations"])
    yield _gauge("hybridkv_reservations_max_engine", "open reservations of the engine that holds the most",
                 f["reservations_max_engine"])
    yield _gauge("hybridkv_reservations_limit", "--max-reservations (per engine)", lim["max_reservations"])
    yield _gauge("hybridkv_parked_requests", "requests waiting for L2 reads or room", f["parked"])
    yield _gauge("hybridkv_worker_jobs", "L2 and payload jobs on the worker threads", f["workers_inflight"])
    yield _counter("hybridkv_engines_reclaimed", "engines silent past --client-timeout, reclaimed",
                   f["engines_reclaimed"])
    yield _counter("hybridkv_reservations_reclaimed", "reservations of reclaimed engines", f["reservations_reclaimed"])
    yield _counter("hybridkv_limit_refusals", "requests refused by a configured limit", f["limit_refusals"])
    yield _counter("hybridkv_forbidden_refusals", "server-wide requests refused without --admin",
                   f["forbidden_refusals"])
    yield _counter("hybridkv_namespace_refusals", "requests that named objects held under another namespace "
                   "(answered as misses for them)", f["namespace_refusals"])


class _QuietHandler(WSGIRequestHandler):
    timeout = CONNECTION_S  # no single read or write waits longer; BoundedServer ends the whole connection

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing: a line per scrape (or per hostile connection) is noise."""


class BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, as prometheus_client's server, but at most MAX_CONNECTIONS of them, each ended
    (shut down under its thread, which then closes it) CONNECTION_S after it was accepted."""

    daemon_threads = True
    request_queue_size = MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any):
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}  # the connections open, and when each must end
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = len(self._deadlines) >= MAX_CONNECTIONS
            if not full:
                self._deadlines[request] = time.monotonic() + CONNECTION_S
        if full:
            super().shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:  # under the lock: service_actions never shuts a socket whose number was reused
            self._deadlines.pop(request, None)
            super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed: a client that timed out or went away is a debug line. socketserver printed
        a traceback to stderr for each, which any client could repeat at will, outside the log's format (a JSON
        log got lines that are not JSON) and into a stderr pipe that, once full, blocks every thread that logs."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # TimeoutError, ConnectionResetError, BrokenPipeError, ...
            log.debug("metrics connection from %s ended: %s", client_address[0], exc)
        else:
            log.error("metrics connection from %s failed", client_address[0], exc_info=exc)

    def service_actions(self) -> None:
        """Every poll of serve_forever (half a second): end the connections past their time."""
        now = time.monotonic()
        with self._lock:
            for request, deadline in self._deadlines.items():
                if now >= deadline:
                    try:
                        request.shutdown(socket.SHUT_RDWR)  # its thread's read or write returns, and it closes
                    except OSError:
                        pass


def _server_class(host: str) -> type[BoundedServer]:
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return type("BoundedServer", (BoundedServer,), {"address_family": family})


class MetricsEndpoint:
    """The /metrics HTTP server on its own thread, until close()."""

    def __init__(self, telemetry: Telemetry, wake: Callable[[], None], host: str, port: int):
        host, port = check_metrics_address(host, port)
        self.registry = CollectorRegistry()
        self.registry.register(SnapshotCollector(telemetry, wake))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        try:
            self._httpd = make_server(host, port, make_wsgi_app(self.registry), _server_class(host), _QuietHandler)
        except OSError as e:
            raise MetricsError(f"cannot serve metrics on --metrics-host {host} --metrics-port {port}: {e}") from None
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        self.host, self.port = host, self._httpd.server_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
