"""Prometheus metrics and ``/health`` on an HTTP port of the daemon (``--metrics-port``).

Two kinds of figures, so that the request path pays (almost) nothing:

* **State** (pages by state, sessions, per-namespace usage, the prefix cache's
  query and hit tokens, evictions, lease expiries, errors by code): a scrape
  asks the daemon's loop for a :class:`Snapshot` through an :class:`Exchange`;
  the loop copies it at its next tick (between requests, so no Manager is read
  mid-change) and the HTTP thread renders it. Nothing is updated per request.
* **Latency** per operation: :class:`RequestTimer`, a histogram the handler
  feeds only when metrics are on (two ``perf_counter`` calls per request).

``GET /health`` answers 200 while the loop turns (its last tick less than
``stale_after_s`` ago) and 503 when it is stuck; every other path is the
Prometheus exposition. Names are in the ``kvcore_`` namespace with their unit
in the name (``_pages``, ``_tokens``, ``_seconds``); counters end in
``_total``. The registry is this module's own, never prometheus_client's
global one. The server thread binds loopback unless told otherwise.

The pools' lower tiers add their families (kvcore.daemon.tiering). Not yet
exported (docs/deploy.md): event subscribers and dropped events (a PUB socket
counts neither).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from kvcore_ipc import messages as msg
from prometheus_client import (
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from kvcore.errors import BadRequest

from .tiering import tier_metric_families

# Request latencies: the daemon answers in tens of microseconds; a big batch takes ms.
LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3, 0.25, 1.0)
SCRAPE_WAIT_S = 2.0  # a scrape waits this long for the loop, then renders the last snapshot


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    pool: str
    namespace: str
    pages: int  # page references held by the namespace's sequences (quotas count these)
    sequences: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the loop copies for one scrape (taken between two requests)."""

    stats: msg.StatsOk  # what ``stats`` answers the operator
    errors: dict[str, int]  # error code -> requests answered with it
    namespaces: list[NamespaceUsage]


class Exchange:
    """A scrape asks for a snapshot; the loop answers at its next :meth:`turn`.

    Invariant: ``last_turn`` is the monotonic time of the loop's latest tick;
    only the loop thread calls :meth:`turn`, only HTTP threads call :meth:`ask`.
    """

    def __init__(self, take: Callable[[], Snapshot]) -> None:
        self._take = take
        self._cond = threading.Condition()
        self._want = False
        self.snapshot: Snapshot | None = None
        self.last_turn = time.monotonic()

    def turn(self, now: float) -> None:
        """The loop's tick: stamp the time; take a snapshot if a scrape waits for one."""
        self.last_turn = now
        if self._want:
            snapshot = self._take()
            with self._cond:
                self.snapshot, self._want = snapshot, False
                self._cond.notify_all()

    def ask(self, timeout_s: float) -> Snapshot | None:
        """A fresh snapshot, or the last one if the loop does not turn within ``timeout_s``."""
        with self._cond:
            self._want = True
            self._cond.wait_for(lambda: not self._want, timeout_s)
            return self.snapshot


class RequestTimer:
    """Latency per operation (``kvcore_request_duration_seconds{op}``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._histogram = Histogram(
            "kvcore_request_duration_seconds",
            "Time the daemon took to serve a request, from decoded to encoded reply, by operation",
            ["op"],
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self._children: dict[type, Any] = {}

    def observe(self, body_type: type, seconds: float) -> None:
        child = self._children.get(body_type)
        if child is None:
            op = getattr(getattr(body_type, "__struct_config__", None), "tag", None)
            op = op or body_type.__name__
            child = self._children[body_type] = self._histogram.labels(op=str(op))
        child.observe(seconds)


class SnapshotCollector(Collector):
    """Renders the loop's snapshot as metric families at scrape time."""

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange

    def collect(self) -> Iterable[Metric]:
        snapshot = self._exchange.ask(SCRAPE_WAIT_S)
        age = GaugeMetricFamily(
            "kvcore_loop_last_turn_age_seconds",
            "Seconds since the daemon's loop last turned (health)",
        )
        age.add_metric([], time.monotonic() - self._exchange.last_turn)
        yield age
        if snapshot is not None:
            yield from _families(snapshot)


def _families(snap: Snapshot) -> Iterator[Metric]:
    c = snap.stats.counters
    info = GaugeMetricFamily(
        "kvcore_daemon_info",
        "The daemon's protocol version and epoch (hex)",
        labels=["version", "epoch"],
    )
    info.add_metric([str(c.version), f"{c.epoch:x}"], 1)
    yield info
    yield GaugeMetricFamily(
        "kvcore_uptime_seconds", "Seconds since the daemon started", value=c.uptime_s
    )
    yield CounterMetricFamily("kvcore_requests", "Requests answered", value=c.requests)
    errors = CounterMetricFamily(
        "kvcore_errors",
        "Requests answered with an error, and failed ops inside batches, by error code",
        labels=["code"],
    )
    for code, count in sorted(snap.errors.items()):
        errors.add_metric([code], count)
    yield errors
    yield CounterMetricFamily(
        "kvcore_dropped_frames",
        "Frames of a shape the daemon cannot answer, dropped",
        value=c.dropped_frames,
    )
    yield CounterMetricFamily(
        "kvcore_lease_expiries", "Sessions whose lease ran out", value=c.expired_sessions
    )
    yield from _pool_families(snap.stats.pools)
    yield from tier_metric_families(snap.stats.pools)  # the pools' lower tiers
    sessions = GaugeMetricFamily(
        "kvcore_sessions", "Live sessions, by pool and namespace", labels=["pool", "namespace"]
    )
    counts: dict[tuple[str, str], int] = {}
    for s in snap.stats.sessions:
        counts[s.pool, s.namespace] = counts.get((s.pool, s.namespace), 0) + 1
    for (pool, namespace), count in sorted(counts.items()):
        sessions.add_metric([pool, namespace], count)
    yield sessions
    ns_pages = GaugeMetricFamily(
        "kvcore_namespace_pages",
        "Page references held by a namespace's sequences (what quotas count)",
        labels=["pool", "namespace"],
    )
    ns_seqs = GaugeMetricFamily(
        "kvcore_namespace_sequences", "Live sequences of a namespace", labels=["pool", "namespace"]
    )
    for u in snap.namespaces:
        ns_pages.add_metric([u.pool, u.namespace], u.pages)
        ns_seqs.add_metric([u.pool, u.namespace], u.sequences)
    yield ns_pages
    yield ns_seqs


def _pool_families(pools: list[msg.PoolStats]) -> Iterator[Metric]:
    labels = ["pool"]
    pages = GaugeMetricFamily(
        "kvcore_pool_pages",
        "Pages of a pool by state: free, evictable "
        "(cached, unreferenced), held (referenced by sequences)",
        labels=["pool", "state"],
    )
    capacity = GaugeMetricFamily("kvcore_pool_capacity_pages", "Pages in the pool", labels=labels)
    cached = GaugeMetricFamily(
        "kvcore_pool_cached_pages", "Pages in the prefix index", labels=labels
    )
    usage = GaugeMetricFamily(
        "kvcore_pool_usage_ratio",
        "Held pages / pages (as vLLM's kv_cache_usage counts: evictable pages are free to take)",
        labels=labels,
    )
    seqs = GaugeMetricFamily("kvcore_pool_sequences", "Live sequences", labels=labels)
    queries = CounterMetricFamily(
        "kvcore_prefix_cache_queries_tokens",
        "Prompt tokens looked up by successful allocations (vLLM's prefix_cache_queries)",
        labels=labels,
    )
    hits = CounterMetricFamily(
        "kvcore_prefix_cache_hits_tokens",
        "Of those, tokens served from the prefix cache (vLLM's prefix_cache_hits)",
        labels=labels,
    )
    evictions = CounterMetricFamily(
        "kvcore_evictions_pages", "Cached pages evicted to make room", labels=labels
    )
    for p in pools:
        for state, count in (
            ("free", p.free_pages),
            ("evictable", p.evictable_pages),
            ("held", p.held_pages),
        ):
            pages.add_metric([p.name, state], count)
        capacity.add_metric([p.name], p.total_pages)
        cached.add_metric([p.name], p.cached_pages)
        usage.add_metric([p.name], p.held_pages / p.total_pages if p.total_pages else 0.0)
        seqs.add_metric([p.name], p.num_sequences)
        queries.add_metric([p.name], p.query_tokens)
        hits.add_metric([p.name], p.hit_tokens)
        evictions.add_metric([p.name], p.evictions)
    yield from (pages, capacity, cached, usage, seqs, queries, hits, evictions)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer:
    """The HTTP endpoint (a thread): ``/health`` and the Prometheus exposition.

    ``port`` 0 picks a free port (:attr:`port` says which). ``stale_after_s``: how
    old the loop's last turn may be before ``/health`` answers 503.
    """

    def __init__(
        self,
        exchange: Exchange,
        registry: CollectorRegistry,
        *,
        port: int,
        addr: str = "127.0.0.1",
        stale_after_s: float = 5.0,
    ) -> None:
        self.exchange = exchange
        self.stale_after_s = stale_after_s
        metrics_app = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Any) -> Any:
            if environ.get("PATH_INFO") == "/health":
                return self._health(start_response)
            return metrics_app(environ, start_response)

        try:
            self._server = make_server(addr, port, app, ThreadingWSGIServer, _QuietHandler)
        except OSError as exc:  # taken, or an address this host does not have
            raise BadRequest(f"--metrics-port {port} on {addr}: {exc.strerror or exc}") from None
        self.addr = addr
        self.port: int = self._server.server_port
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvcore-metrics", daemon=True
        )
        self._thread.start()

    def _health(self, start_response: Any) -> list[bytes]:
        age = time.monotonic() - self.exchange.last_turn
        ok = age < self.stale_after_s
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        word = "ok" if ok else "stuck"
        return [f"{word}: the loop turned {age:.3f} s ago\n".encode()]

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start(
    take: Callable[[], Snapshot], *, port: int, addr: str = "127.0.0.1", stale_after_s: float = 5.0
) -> tuple[Exchange, RequestTimer, MetricsServer]:
    """A registry of its own with the snapshot collector and the latency histogram,
    served on ``addr:port``."""
    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created: see uptime
    registry = CollectorRegistry(auto_describe=False)
    exchange = Exchange(take)
    registry.register(SnapshotCollector(exchange))
    timer = RequestTimer(registry)
    server = MetricsServer(exchange, registry, port=port, addr=addr, stale_after_s=stale_after_s)
    return exchange, timer, server
