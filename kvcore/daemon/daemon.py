"""The Daemon: the parts one start creates, built once and in order, and the loop's tick.

A start builds, each part once and handed to the next::

    config -> epoch, endpoint (trust checks), authority, CURVE key, sessions, ledger
           -> publisher (events; None when off)
           -> pools      (publish through the publisher; host pools re-adopted from a
                          previous daemon where kvcore.daemon.restart can), then the
                          sweep of what a killed daemon left and nobody re-adopted
           -> handler    (answers frames against pools, sessions, ledger)
           -> server     (the ROUTER socket; calls the handler)
           -> metrics    (reads the handler's snapshot; None when off)

Each part that holds a resource registers its close as it is built; :meth:`Daemon.close`
(or a failed build) closes them last built first. The command line around it
(configuration, endpoint locks, signals, banner, logs) is :mod:`kvcore.daemon.serve`.

The loop's tick (:meth:`Daemon.tick`) keeps leases fair to clients: time in
which the daemon could not hear anyone (it was stopped, or busy) is no one's
lease, and what is queued is read before anyone is expired.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import time

from kvcore_ipc.codec import ServerCodec
from kvcore_ipc.events import EventPublisher, Publisher
from kvcore_ipc.memory import sweep
from kvcore_ipc.server import RouterServer
from kvcore_ipc.vllm_events import VllmEventPublisher

from kvcore.config import ServiceConfig
from kvcore.errors import BadRequest, StaleEpoch
from kvcore.paths import check_socket_path, default_endpoint, runtime_dir

from . import metrics, restart
from .auth import EVENTS_DOMAIN, REQUEST_DOMAIN, Authority, read_secret_key
from .handler import Handler
from .metrics_http import read_token
from .pools import MAX_EVENT_MESSAGE_BYTES, PoolTable
from .quotas import Ledger, Limits
from .sessions import SessionTable

DEAF_S = 0.25  # a gap between ticks longer than this was time the daemon could not listen
REAP_BUDGET = 16384  # page references of ended sessions freed per reap call (~1 ms)
REAP_SLICE_S = 0.1  # at most this long reaping in one loop turn (seconds; < DEAF_S - tick_ms)
RELEASE_CHECK_S = 0.5  # how often withheld pages are checked for release (reads /proc), and
# vLLM-format subscribers reminded of the start (VllmEventPublisher.remind)

log = logging.getLogger("kvcore.daemon")


class Daemon:
    """Pools, sessions and the handler behind one ROUTER socket; :meth:`serve` runs the loop.

    Invalid configuration or an untrusted endpoint path is BadRequest or
    UntrustedEndpoint before anything is created; a failure while building closes
    whatever was built (see the module doc for the order)."""

    pools: PoolTable
    handler: Handler
    server: RouterServer

    def __init__(self, config: ServiceConfig) -> None:
        config.validate()
        self.config = config
        self.epoch = secrets.randbits(63) | 1
        endpoint = config.endpoint or default_endpoint()
        for path in ipc_paths(endpoint, config.events, config.events_replay):
            check_socket_path(path, {os.getuid()}, creating=True)
        self.authority = Authority(config.tenants, keys_dir=config.authorized_keys_dir)
        secret = _server_key(config)
        self.swept: list[str] = []  # what a killed daemon left and no pool re-adopted
        self.sessions = SessionTable(
            config.lease_timeout_s,
            config.fence_timeout_s,
            config.max_sessions,
            max_sessions_per_process=config.max_sessions_per_process,
            max_sessions_per_tenant=config.max_sessions_per_tenant,
        )
        self.ledger = Ledger()
        self.publisher: Publisher | None = None
        self.metrics: metrics.Exchange | None = None
        self.metrics_server: metrics.MetricsServer | None = None
        self._next_scan = self._last_tick = self._next_release = 0.0
        self._closing = contextlib.ExitStack()  # the built parts' closes, last built first
        self._closing.callback(self.authority.stop_zap)
        self._closing.callback(self.sessions.close_all)
        try:
            self._build(config, endpoint, secret)
        except BaseException:
            self.close()
            raise

    def _build(self, config: ServiceConfig, endpoint: str, secret: bytes | None) -> None:
        """Publisher, pools, server (bound), metrics, handler: each built once, from the
        ones before (the handler gets the server's counters and the metrics' timer)."""
        prefix = segment_prefix(endpoint)
        check_shm(config, prefix=prefix)
        if secret is not None:
            self.authority.start_zap()
        self.publisher = event_publisher(config, endpoint, secret)
        if self.publisher is not None:
            self._closing.callback(self.publisher.close)
        self.pools = PoolTable(self.epoch, self.publisher, prefix)
        self._closing.callback(self.pools.close_all)  # publishes the removals: before the publisher
        self._open_pools(config, prefix)
        self.swept = sweep(prefix, keep=self.pools.kept_segments())
        self.server = RouterServer(
            endpoint,
            curve_secret_key=secret,
            insecure=config.insecure,
            hard_limit_bytes=4 * config.max_frame_bytes,
            max_queued_bytes=config.max_queued_bytes,
            socket_mode=config.socket_mode,
            zap_domain=REQUEST_DOMAIN if secret else "",
        )
        self._closing.callback(self.server.close)
        timer = self._start_metrics(config)
        self.handler = Handler(
            self.pools,
            self.sessions,
            ServerCodec(config.max_frame_bytes, config.max_batch),
            authority=self.authority,
            ledger=self.ledger,
            server=self.server,
            timer=timer,
            ipc=endpoint.startswith("ipc://"),
            max_request_tokens=config.max_request_tokens,
            allow_ephemeral=config.allow_ephemeral,
            events_endpoint=self.publisher.endpoint if self.publisher else "",
        )

    def _start_metrics(self, config: ServiceConfig) -> metrics.RequestTimer | None:
        """The metrics endpoint, if configured (its snapshots are taken by :meth:`tick`);
        the latency timer the handler records into."""
        if config.metrics_port is None and not config.metrics_socket:
            return None
        from .metrics_server import start  # prometheus_client: only when metrics are on

        token = read_token(config.metrics_token_file) if config.metrics_token_file else None
        self.metrics, timer, self.metrics_server = start(
            port=config.metrics_port or 0,
            addr=config.metrics_addr,
            unix_path=config.metrics_socket or None,
            token=token,
            namespace_labels=config.metrics_namespace_labels,
        )
        self._closing.callback(self.metrics_server.close)
        return timer

    def _open_pools(self, config: ServiceConfig, prefix: str) -> None:
        """Each configured pool: its memory and Manager (kept across restarts where
        kvcore.daemon.restart can, unless ``restore`` is off), and its quotas in the ledger."""
        for pool in config.pools:
            layout = pool.layout()
            if config.restore and restart.keeps(pool):
                regions, manager, kept = restart.open_kept(
                    pool, prefix, self.epoch, config.fence_timeout_s
                )
                self.pools.adopt(pool.name, regions, manager, kept)
            else:
                restart.forget(pool, prefix)  # a kept pool's manifest: this start is cold
                self.pools.open(
                    pool.name,
                    pool.device,
                    layout,
                    group=pool.group,
                    tiers=pool.tiers,
                    shards=pool.shards,
                    eviction=pool.eviction,
                )
            self.ledger.open_pool(pool.name, layout.page_size, Limits.of(pool))
            log.info(
                "pool %r created: %s, %d pages x %d tokens, %d shard(s), %.1f MiB",
                pool.name,
                pool.device,
                layout.num_pages,
                layout.page_size,
                pool.shards,
                pool.total_bytes() / (1 << 20),
            )

    def tick(self) -> None:
        """Between requests: publish the events of the request just answered (after its
        reply went out); give back to every lease the time the daemon was deaf (a gap
        since the last tick over DEAF_S); expire sessions whose lease is over, but only
        once nothing is queued (a heartbeat may be waiting) or half a lease has passed;
        free what ended sessions held (:meth:`_reap`); a few times a second, release
        withheld pages and remind vLLM-format subscribers of the start."""
        self.pools.publish()
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.turn(now, self.handler.snapshot)
        if self._last_tick and now - self._last_tick > DEAF_S:
            self.sessions.pause(now - self._last_tick)
        self._last_tick = now
        if now >= self._next_scan and not (
            self.server.pending() and now - self._next_scan < self.sessions.lease_s / 2
        ):
            self._next_scan = now + min(0.05, self.sessions.lease_s / 10)
            self.handler.expire(now)
        if self.sessions.draining():
            self._reap()
            self.pools.publish()
        if now >= self._next_release:
            self._next_release = now + RELEASE_CHECK_S
            self.pools.release_withheld(self.sessions.mappers, now)
            if isinstance(self.publisher, VllmEventPublisher):
                self.publisher.remind(now)  # routers that (re)join after the start learn of it

    def _reap(self) -> None:
        """Free what ended sessions held, REAP_BUDGET page references at a time: at least
        once per loop turn, and again while sessions drain, nothing is queued and the turn
        is under REAP_SLICE_S. So a request waits at most one REAP_BUDGET for the loop,
        one turn stays bounded in time (and well under DEAF_S, with the loop's 50 ms
        wait for a request: no lease is paused for it), and an idle daemon frees
        sequences as fast as it can (one budget per 50 ms wait freed ~1.3k sequences of
        254 pages a second, against ~28k/s that one client can fork)."""
        end = time.monotonic() + REAP_SLICE_S
        self.handler.reap(REAP_BUDGET)
        while self.sessions.draining() and not self.server.pending() and time.monotonic() < end:
            self.handler.reap(REAP_BUDGET)

    def serve(self) -> None:
        """Answer requests until :meth:`stop`; then refuse those already read with
        ``stale_epoch`` (their sessions end with this daemon: their clients attach again,
        to the next one, instead of waiting out their timeout)."""
        self.server.serve(self.handler.handle, self.tick)
        refused = self.server.drain(self._refuse)
        if refused:
            log.info("stopping: refused %d request(s) read but not served", refused)

    def _refuse(self, frame: bytes, _raw: object) -> bytes:
        return self.handler.codec.refusal(
            frame, StaleEpoch.code, "the daemon is stopping (a restart or a takeover): attach again"
        )

    def stop(self) -> None:
        """Return from :meth:`serve` after the current request (signal-handler safe)."""
        self.server.stop()

    def close(self) -> None:
        """Close what was built, last built first: the metrics endpoint, the socket, every
        pool (publishing its removals), the publisher, the sessions' process handles, ZAP.
        Closing again does nothing."""
        self._closing.close()


def events_endpoint(events: str, endpoint: str) -> str:
    """The PUB endpoint for ``--events``: "" (off), an explicit endpoint, or "auto".

    "auto" gives each daemon its own path, derived from its request endpoint:
    ``ipc:///dir/name.sock`` publishes on ``ipc:///dir/name.events.sock``; other
    transports on a socket in the runtime directory named after the endpoint.
    """
    if events != "auto":
        return events
    if endpoint.startswith("ipc://"):
        return f"{endpoint.removesuffix('.sock')}.events.sock"
    digest = hashlib.sha256(endpoint.encode()).hexdigest()[:16]
    return f"ipc://{runtime_dir() / f'events-{digest}.sock'}"


def ipc_paths(endpoint: str, events: str, replay: str = "") -> list[str]:
    """The filesystem paths of the request, event and replay sockets that are ipc://."""
    paths = [endpoint, events_endpoint(events, endpoint) if events else "", replay]
    return [p[len("ipc://") :] for p in paths if p.startswith("ipc://")]


def segment_prefix(endpoint: str) -> str:
    """The name prefix of this endpoint's host segments (see :func:`sweep`)."""
    return f"kvcore-{hashlib.sha256(endpoint.encode()).hexdigest()[:12]}"


def check_shm(config: ServiceConfig, shm: str = "/dev/shm", prefix: str = "") -> None:
    """BadRequest, with the numbers, if the host pools (all their shards) need more shared
    memory than ``shm`` has free: a segment larger than its filesystem is created without complaint and
    kills whoever touches the missing pages (SIGBUS). What this user's segments of the
    endpoint's ``prefix`` hold counts as free: the start re-adopts them or unlinks them."""
    need = sum(p.total_bytes() for p in config.pools if p.device == "cpu")  # every shard
    try:
        st = os.statvfs(shm)
    except OSError:
        return  # no such filesystem here: nothing to measure against
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if prefix:
        free += _held_by(shm, f"{prefix}-")
    if need > free:
        gib = 1 << 30
        raise BadRequest(
            f"the host pools need {need / gib:.2f} GiB of shared memory, but {shm} has "
            f"{free / gib:.2f} GiB free (of {size / gib:.2f} GiB): give the pools a smaller "
            f"size, or grow {shm} (containers: docker run --shm-size; docs/deploy.md)"
        )


def _held_by(shm: str, head: str) -> int:
    """Bytes that this user's files in ``shm`` named ``head...`` take (allocated, not size)."""
    held = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(shm):
            if entry.name.startswith(head):
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_uid == os.getuid():
                        held += st.st_blocks * 512
    return held


def _server_key(config: ServiceConfig) -> bytes | None:
    """The daemon's CURVE secret key (z85 bytes), or None without one. BadRequest if CURVE is
    on but no client key could ever be admitted."""
    if not config.curve_secret_key_file:
        return None
    secret = read_secret_key(config.curve_secret_key_file)
    if not config.authorized_keys_dir and not any(t.keys for t in config.tenants):
        raise BadRequest(
            "CURVE needs the public keys of the clients it admits: "
            "--authorized-keys DIR (see `kvcore keys`) or tenants' keys"
        )
    return secret


def event_publisher(config: ServiceConfig, endpoint: str, secret: bytes | None) -> Publisher | None:
    """The publisher of page events in the configured format, or None when events are off."""
    events = events_endpoint(config.events, endpoint)
    if not events:
        return None
    if config.events_format == "vllm":
        return vllm_publisher(config, events)
    return EventPublisher(
        events,
        curve_secret_key=secret,
        zap_domain=EVENTS_DOMAIN if secret else "",
        max_messages=max(1, config.events_buffer_bytes // MAX_EVENT_MESSAGE_BYTES),
    )


def vllm_publisher(config: ServiceConfig, endpoint: str) -> VllmEventPublisher:
    """The vLLM-format publisher (spec/vllm-events.md): ``medium`` GPU for cuda pools,
    CPU for host pools; a new daemon start is announced with AllBlocksCleared.
    Plain on tcp:// (vLLM's subscribers speak no CURVE), which the configuration allows
    only with ``insecure`` (ServiceConfig._validate_event_sockets)."""
    mediums = {p.name: "CPU" if p.device == "cpu" else "GPU" for p in config.pools}
    publisher = VllmEventPublisher(
        endpoint,
        config.events_replay or None,
        page_size=config.pools[0].page_size,
        mediums=mediums,
    )
    publisher.cleared()
    return publisher
