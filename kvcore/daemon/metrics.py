"""Prometheus metrics and ``/health`` on an HTTP port of the daemon (``--metrics-port``).

Two kinds of figures, so that the request path pays (almost) nothing:

* **State** (pages by state, sessions, per-namespace usage, the prefix cache's
  query and hit tokens, evictions, lease expiries, errors by code): a scrape
  asks the daemon's loop for a :class:`Snapshot` through an :class:`Exchange`;
  the loop copies it at its next tick (between requests, so no Manager is read
  mid-change) and the HTTP thread renders it. Nothing is updated per request,
  and the loop takes at most one snapshot per ``SNAPSHOT_MIN_INTERVAL_S``
  however often it is scraped (scrapes in between share the last one).
* **Latency** per operation: :class:`RequestTimer`, a histogram the handler
  feeds only when metrics are on (two ``perf_counter`` calls per request).

``GET /health`` answers 200 while the loop turns (its last tick less than
``stale_after_s`` ago) and 503 when it is stuck; every other path is the
Prometheus exposition (its families: kvcore.daemon.metrics_families; the collector,
the server and :func:`~kvcore.daemon.metrics_server.start`, which builds them:
kvcore.daemon.metrics_server). This module holds the plain types the handler and the
loop use (:class:`Snapshot`, :class:`Exchange`, :class:`RequestTimer`). Importing it
loads no prometheus_client (only building a :class:`RequestTimer` does, which only
``start`` does), so the request path never imports it (tests/test_metrics.py checks);
it imports nothing of the server side at run time, so the server's modules import it
without a circle (tests/test_imports.py checks). The registry is ``start``'s own,
never prometheus_client's global one. The server
thread binds loopback unless told otherwise, or a unix socket instead; it may
require a bearer token and drop the namespace labels (the HTTP side and its
bounds: kvcore.daemon.metrics_http). Not yet exported (docs/deploy.md): event
subscribers and dropped events (a PUB socket counts neither).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcore_ipc import messages as msg

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from .metrics_server import MetricsServer as MetricsServer  # daemon.py's annotation

# Request latencies: the daemon answers in tens of microseconds; a big batch takes ms.
LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3, 0.25, 1.0)
SCRAPE_WAIT_S = 2.0  # a scrape waits this long for the loop, then renders the last snapshot
SNAPSHOT_MIN_INTERVAL_S = 0.25  # a snapshot younger than this answers a scrape: no new one


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
    eviction: dict[str, str] = field(default_factory=dict)  # pool -> its eviction policy


class Exchange:
    """A scrape asks for a snapshot; the loop answers at its next :meth:`turn`.

    Invariant: ``last_turn`` is the monotonic time of the loop's latest tick and
    ``taken_at`` that of :attr:`snapshot` (-inf before the first); only the loop thread
    calls :meth:`turn`, only HTTP threads call :meth:`ask`. The loop takes a snapshot
    only when asked, and at most one per ``min_interval_s`` (seconds): scrapes cost it
    nothing more, however many there are.
    """

    def __init__(self, min_interval_s: float = SNAPSHOT_MIN_INTERVAL_S) -> None:
        self._cond = threading.Condition()
        self._want = False
        self.min_interval_s = min_interval_s
        self.snapshot: Snapshot | None = None
        self.taken_at = float("-inf")
        self.last_turn = time.monotonic()

    def turn(self, now: float, take: Callable[[], Snapshot]) -> None:
        """The loop's tick: stamp the time; ``take()`` a snapshot if a scrape waits for one."""
        self.last_turn = now
        if self._want:
            snapshot = take()
            with self._cond:
                self.snapshot, self.taken_at, self._want = snapshot, now, False
                self._cond.notify_all()

    def ask(self, timeout_s: float) -> Snapshot | None:
        """A snapshot at most ``min_interval_s`` old: the last one if it is that young, else
        a fresh one, or the last one if the loop does not turn within ``timeout_s``."""
        with self._cond:
            if time.monotonic() - self.taken_at < self.min_interval_s:
                return self.snapshot
            self._want = True
            self._cond.wait_for(lambda: not self._want, timeout_s)
            return self.snapshot


class RequestTimer:
    """Latency per operation (``kvcore_request_duration_seconds{op}``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Histogram

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
