"""The Prometheus side of the metrics endpoint: the collector, the HTTP server and
:func:`start`, which builds them.

Imported only when metrics are on (the daemon imports :func:`start` when it builds
the endpoint), so that the request path never loads prometheus_client. The snapshot
and latency types it renders live in :mod:`kvcore.daemon.metrics`, which imports
nothing of this module at run time (no import circle); the families in
:mod:`.metrics_families`; the bounded HTTP server in :mod:`.metrics_http`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, disable_created_metrics, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import metrics_http
from .metrics import SCRAPE_WAIT_S, Exchange, RequestTimer
from .metrics_families import snapshot_families
from .metrics_http import DEFAULT_LIMITS, HttpLimits


class SnapshotCollector(Collector):
    """Renders the loop's snapshot as metric families at scrape time (in the HTTP
    thread); ``namespace_labels`` as :func:`snapshot_families` takes it."""

    def __init__(self, exchange: Exchange, *, namespace_labels: bool = True) -> None:
        self._exchange = exchange
        self._namespace_labels = namespace_labels

    def collect(self) -> Iterable[Metric]:
        snapshot = self._exchange.ask(SCRAPE_WAIT_S)
        age = GaugeMetricFamily(
            "kvcore_loop_last_turn_age_seconds",
            "Seconds since the daemon's loop last turned (health)",
        )
        age.add_metric([], time.monotonic() - self._exchange.last_turn)
        yield age
        if snapshot is not None:
            yield from snapshot_families(snapshot, namespace_labels=self._namespace_labels)


class MetricsServer:
    """The HTTP endpoint (a thread): ``/health`` and the Prometheus exposition.

    On ``addr:port`` (``port`` 0 picks a free port: :attr:`port` says which) or, given
    ``unix_path``, on that unix socket instead (mode 0600, the daemon's uid and root
    only). With ``token`` every path but ``/health`` needs ``Authorization: Bearer
    <token>``. ``stale_after_s``: how old the loop's last turn may be before ``/health``
    answers 503. ``limits`` bound what clients may take (kvcore.daemon.metrics_http).
    """

    def __init__(
        self,
        exchange: Exchange,
        registry: CollectorRegistry,
        *,
        port: int = 0,
        addr: str = "127.0.0.1",
        unix_path: str | None = None,
        token: str | None = None,
        stale_after_s: float = 5.0,
        limits: HttpLimits = DEFAULT_LIMITS,
    ) -> None:
        self.exchange = exchange
        self.stale_after_s = stale_after_s
        metrics_app = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Any) -> Any:
            if environ.get("PATH_INFO") == "/health":
                return self._health(start_response)
            return metrics_app(environ, start_response)

        served: metrics_http.App = app
        if token is not None:
            served = metrics_http.require_bearer(app, token, open_paths=frozenset({"/health"}))
        self.unix_path = unix_path
        if unix_path is not None:
            self._server: metrics_http.BoundedServer = metrics_http.serve_unix(
                served, unix_path, limits
            )
            self.addr, self.port = "localhost", 0
        else:
            self._server = metrics_http.serve_tcp(served, addr, port, limits)
            self.addr, self.port = addr, self._server.server_port
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
        """The base URL (``http://localhost`` on a unix socket: the host is not used)."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}" if self.unix_path else f"http://{host}:{self.port}"

    def banner(self) -> str:
        """Where to scrape, for the daemon's banner line ``  metrics: ...``."""
        if self.unix_path is None:
            return f"{self.url}/metrics, health: {self.url}/health"
        curl = f"curl --unix-socket {self.unix_path}"
        return f"unix:{self.unix_path} ({curl} {self.url}/metrics), health: {self.url}/health"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        if self.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)


def start(
    *,
    port: int = 0,
    addr: str = "127.0.0.1",
    unix_path: str | None = None,
    token: str | None = None,
    namespace_labels: bool = True,
    stale_after_s: float = 5.0,
    limits: HttpLimits = DEFAULT_LIMITS,
) -> tuple[Exchange, RequestTimer, MetricsServer]:
    """A registry of its own with the snapshot collector and the latency histogram,
    served on ``addr:port`` or ``unix_path`` (see :class:`MetricsServer`): the exchange
    the loop turns, the timer the handler records into, and the running server."""
    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created: see uptime
    registry = CollectorRegistry(auto_describe=False)
    exchange = Exchange()
    registry.register(SnapshotCollector(exchange, namespace_labels=namespace_labels))
    timer = RequestTimer(registry)
    server = MetricsServer(
        exchange,
        registry,
        port=port,
        addr=addr,
        unix_path=unix_path,
        token=token,
        stale_after_s=stale_after_s,
        limits=limits,
    )
    return exchange, timer, server
