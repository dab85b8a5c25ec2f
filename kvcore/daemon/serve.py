"""`kvcore serve`: assemble the daemon, hold its endpoints, run the loop, clean up.

The :class:`Daemon` owns what a start creates: the epoch, the event publisher,
the pools, the session table, the request handler and the ROUTER socket.
``main`` adds what a process needs around it: the configuration (flags over
TOML), an exclusive lock on each ``ipc://`` endpoint it binds (the request
socket and the event socket: a second daemon on the same paths is refused,
and a dead daemon's socket files are swept), the trust checks of those paths
(docs/security.md), the sweep of a killed daemon's segments, signals
(SIGINT, SIGTERM, SIGHUP: a clean stop), the banner and logging (text or one JSON
object per line), and the metrics endpoint (``--metrics-port``, kvcore/daemon/metrics.py).

The loop's tick (:meth:`Daemon.tick`) keeps leases fair to clients: time in
which the daemon could not hear anyone (it was stopped, or busy) is no one's
lease, and what is queued is read before anyone is expired.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import os
import secrets
import signal
import sys
import time
from datetime import datetime, timezone
from typing import Any

import msgspec
import zmq
from kvcore_ipc import messages as msg
from kvcore_ipc.codec import ServerCodec
from kvcore_ipc.events import EventPublisher, Publisher
from kvcore_ipc.memory import HostRegion, sweep
from kvcore_ipc.server import EndpointBusy, EndpointLock, RouterServer, endpoint_in_use
from kvcore_ipc.vllm_events import VllmEventPublisher

from kvcore.config import (
    LOG_LEVELS,
    ServiceConfig,
    apply_env,
    check_socket_path,
    default_endpoint,
    load_toml,
    parse_pool_spec,
)
from kvcore.errors import BadRequest, KVCoreError
from kvcore.paths import runtime_dir

from . import metrics
from .auth import EVENTS_DOMAIN, REQUEST_DOMAIN, Authority, read_secret_key
from .handler import Handler
from .pools import MAX_EVENT_MESSAGE_BYTES, PoolTable
from .quotas import Ledger, Limits
from .sessions import SessionTable

DEAF_S = 0.25  # a gap between ticks longer than this was time the daemon could not listen
REAP_BUDGET = 16384  # page references of ended sessions freed per tick

log = logging.getLogger("kvcore.daemon")


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


def segment_prefix(endpoint: str) -> str:
    """The name prefix of this endpoint's host segments (see :func:`sweep`)."""
    return f"kvcore-{hashlib.sha256(endpoint.encode()).hexdigest()[:12]}"


class Daemon:
    """Pools, sessions and the handler behind one ROUTER socket; :meth:`serve` runs the loop."""

    def __init__(self, config: ServiceConfig) -> None:
        config.validate()
        self.config = config
        self.epoch = secrets.randbits(63) | 1
        endpoint = config.endpoint or default_endpoint()
        for path in _ipc_paths(endpoint, config.events):
            check_socket_path(path, {os.getuid()}, creating=True)
        self.authority = Authority(config.tenants, keys_dir=config.authorized_keys_dir)
        secret = (
            read_secret_key(config.curve_secret_key_file) if config.curve_secret_key_file else None
        )
        if (
            secret is not None
            and not config.authorized_keys_dir
            and not any(t.keys for t in config.tenants)
        ):
            raise BadRequest("CURVE needs the public keys of the clients it admits: "
                             "--authorized-keys DIR (see `kvcore keys`) or tenants' keys")  # fmt: skip
        self.swept = sweep(segment_prefix(endpoint))  # what a killed daemon of this endpoint left
        self.publisher: Publisher | None = None
        self.pools = PoolTable(self.epoch, None, segment_prefix(endpoint))
        self.sessions = SessionTable(config.lease_timeout_s, config.fence_timeout_s,
                                     config.max_sessions)  # fmt: skip
        self.ledger = Ledger()
        self._next_scan = self._last_tick = 0.0
        self.metrics: metrics.Exchange | None = None
        self.metrics_server: metrics.MetricsServer | None = None
        try:
            check_shm(config)
            if secret is not None:
                self.authority.start_zap()
            events = events_endpoint(config.events, endpoint)
            if events and config.events_format == "vllm":
                self.publisher = vllm_publisher(config, events)
            elif events:
                self.publisher = EventPublisher(
                    events, curve_secret_key=secret, zap_domain=EVENTS_DOMAIN if secret else "",
                    max_messages=max(1, config.events_buffer_bytes // MAX_EVENT_MESSAGE_BYTES),
                )  # fmt: skip
            if self.publisher is not None:
                self.pools = PoolTable(self.epoch, self.publisher, segment_prefix(endpoint))
            self.handler = Handler(
                self.pools, self.sessions, ServerCodec(config.max_frame_bytes, config.max_batch),
                authority=self.authority, ledger=self.ledger,
                max_request_tokens=config.max_request_tokens,
                allow_ephemeral=config.allow_ephemeral,
                events_endpoint=self.publisher.endpoint if self.publisher else "",
            )  # fmt: skip
            for pool in config.pools:
                layout = pool.layout()
                self.pools.open(pool.name, pool.device, layout, group=pool.group, tiers=pool.tiers)
                self.ledger.open_pool(pool.name, layout.page_size, Limits.of(pool))
                log.info("pool %r created: %s, %d pages x %d tokens, %.1f MiB", pool.name,
                         pool.device, layout.num_pages, layout.page_size,
                         layout.total_bytes / (1 << 20))  # fmt: skip
            self.server = RouterServer(
                endpoint, self.handler.handle, curve_secret_key=secret, insecure=config.insecure,
                hard_limit_bytes=4 * config.max_frame_bytes, max_queued_bytes=config.max_queued_bytes,
                socket_mode=config.socket_mode, zap_domain=REQUEST_DOMAIN if secret else "",
            )  # fmt: skip
            self.handler.server = self.server
            self.handler.ipc = endpoint.startswith("ipc://")
            if config.metrics_port is not None:
                self.metrics, self.handler.timer, self.metrics_server = metrics.start(
                    self.handler.snapshot, port=config.metrics_port, addr=config.metrics_addr
                )
        except BaseException:
            self.close()
            raise

    def tick(self) -> None:
        """Between requests: publish the events of the request just answered (after its
        reply went out); give back to every lease the time the daemon was deaf (a gap
        since the last tick over DEAF_S); expire sessions whose lease is over, but only
        once nothing is queued (a heartbeat may be waiting) or half a lease has passed;
        free a bounded part of what ended sessions held."""
        self.pools.publish()
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.turn(now)
        if self._last_tick and now - self._last_tick > DEAF_S:
            self.sessions.pause(now - self._last_tick)
        self._last_tick = now
        if now >= self._next_scan and not (
            self.server.pending() and now - self._next_scan < self.sessions.lease_s / 2
        ):
            self._next_scan = now + min(0.05, self.sessions.lease_s / 10)
            self.handler.expire(now)
        if self.sessions.draining():
            self.handler.reap(REAP_BUDGET)
            self.pools.publish()

    def serve(self) -> None:
        self.server.serve(self.tick)

    def stop(self) -> None:
        """Return from :meth:`serve` after the current request (signal-handler safe)."""
        self.server.stop()

    def close(self) -> None:
        """Close the metrics endpoint, every pool (publishing its removals), the socket,
        the publisher, ZAP."""
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.pools.close_all()
        self.sessions.close_all()
        if hasattr(self, "server"):
            self.server.close()
        if self.publisher is not None:
            self.publisher.close()
        self.authority.stop_zap()


def check_shm(config: ServiceConfig, shm: str = "/dev/shm") -> None:
    """BadRequest, with the numbers, if the host pools need more shared memory than ``shm``
    has free: a segment larger than its filesystem is created without complaint and
    kills whoever touches the missing pages (SIGBUS)."""
    need = sum(p.layout().total_bytes for p in config.pools if p.device == "cpu")
    try:
        st = os.statvfs(shm)
    except OSError:
        return  # no such filesystem here: nothing to measure against
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if need > free:
        gib = 1 << 30
        raise BadRequest(
            f"the host pools need {need / gib:.2f} GiB of shared memory, but {shm} has "
            f"{free / gib:.2f} GiB free (of {size / gib:.2f} GiB): give the pools a smaller "
            f"size, or grow {shm} (containers: docker run --shm-size; docs/deploy.md)"
        )


def _ipc_paths(endpoint: str, events: str) -> list[str]:
    paths = [endpoint, events_endpoint(events, endpoint) if events else ""]
    return [p[len("ipc://") :] for p in paths if p.startswith("ipc://")]


# -- the command line -----------------------------------------------------------------


def vllm_publisher(config: ServiceConfig, endpoint: str) -> VllmEventPublisher:
    """The vLLM-format publisher (spec/vllm-events.md): ``medium`` GPU for cuda pools,
    CPU for host pools; a new daemon start is announced with AllBlocksCleared.
    ipc:// only or CURVE-less tcp:// (vLLM's subscribers speak no CURVE)."""
    if config.curve_secret_key_file and not endpoint.startswith("ipc://"):
        raise BadRequest("--events-format vllm over tcp:// would be unencrypted; use an ipc:// "
                         "--events endpoint (vLLM's subscribers speak no CURVE)")  # fmt: skip
    mediums = {p.name: "CPU" if p.device == "cpu" else "GPU" for p in config.pools}
    publisher = VllmEventPublisher(endpoint, config.events_replay or None,
                                   page_size=config.pools[0].page_size, mediums=mediums)  # fmt: skip
    publisher.cleared()
    return publisher


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file (see docs/quickstart.md); KVCORE_* "
                        "variables override it, flags override both (default: none)")  # fmt: skip
    parser.add_argument("--endpoint", help="ipc:// or tcp:// endpoint (default: "
                        "ipc://$XDG_RUNTIME_DIR/kvcore/kvcore.sock)")  # fmt: skip
    parser.add_argument("--pool", action="append", metavar="K=V,...",
                        help="a pool, e.g. name=default,device=cpu,num_layers=16,size=256MiB "
                        "(repeatable; replaces the configured pools)")  # fmt: skip
    parser.add_argument("--events", help="PUB endpoint for page events ('auto': beside "
                        "the request socket, one per daemon; default: off)")  # fmt: skip
    parser.add_argument("--events-format", choices=["kvcore", "vllm"], help="the event "
                        "stream's format: kvcore's (spec/protocol.md) or vLLM's KV events, as "
                        "KV-aware routers read them (spec/vllm-events.md); default kvcore")  # fmt: skip
    parser.add_argument("--events-replay", help="vllm format: ROUTER endpoint that replays "
                        "buffered event batches (vLLM's replay_endpoint; default: off)")  # fmt: skip
    parser.add_argument("--lease-timeout", type=float, help="seconds without a request "
                        "before a session's sequences are freed (default 10)")  # fmt: skip
    parser.add_argument("--max-frame-bytes", type=int, help="largest request or reply "
                        "(default 8388608)")  # fmt: skip
    parser.add_argument("--max-batch", type=int, help="operations per batch (default 4096)")
    parser.add_argument("--max-request-tokens", type=int, help="tokens of work one request "
                        "may carry, summed over a batch (default 1048576)")  # fmt: skip
    parser.add_argument("--max-sessions", type=int, help="sessions at once (default 1024)")
    parser.add_argument("--max-queued-bytes", type=int, help="bytes of requests queued per "
                        "connection before the daemon stops reading it (default 64 MiB)")  # fmt: skip
    parser.add_argument("--fence-timeout", type=float, help="seconds an expired session "
                        "whose process cannot be watched (tcp://) stays fenced (default 300)")  # fmt: skip
    parser.add_argument("--curve-secret-key-file", help="CURVE secret key (tcp://): z85, or "
                        "a `kvcore keys` .key_secret file; must be mode 0600 (default: none)")  # fmt: skip
    parser.add_argument("--authorized-keys", dest="authorized_keys_dir", help="directory of "
                        "client public keys (*.key, `kvcore keys`): only they may connect (default: none)")  # fmt: skip
    parser.add_argument("--insecure", action="store_true", help="allow tcp:// without CURVE "
                        "(anyone who reaches the port can read and write every pool)")  # fmt: skip
    parser.add_argument("--allow-ephemeral", action="store_true",
                        help="let attach create private pools (tests and development)")  # fmt: skip
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics and "
                        "/health over HTTP on this port (0: any free port; default: off)")  # fmt: skip
    parser.add_argument("--metrics-addr", help="address the metrics port binds "
                        "(default 127.0.0.1: loopback only)")  # fmt: skip
    parser.add_argument("--log-level", choices=LOG_LEVELS, help="the least severe "
                        "records logged (default INFO)")  # fmt: skip
    parser.add_argument("--log-format", choices=["text", "json"], help="text lines, or one "
                        "JSON object per line for log shippers (default text)")  # fmt: skip


def build_config(args: argparse.Namespace) -> ServiceConfig:
    config = apply_env(load_toml(args.config) if args.config else ServiceConfig())
    overrides: dict[str, Any] = {
        "endpoint": args.endpoint, "events": args.events, "lease_timeout_s": args.lease_timeout,
        "events_format": args.events_format, "events_replay": args.events_replay,
        "max_frame_bytes": args.max_frame_bytes, "max_batch": args.max_batch,
        "curve_secret_key_file": args.curve_secret_key_file,
        "authorized_keys_dir": args.authorized_keys_dir,
        "max_request_tokens": args.max_request_tokens, "max_sessions": args.max_sessions,
        "fence_timeout_s": args.fence_timeout, "max_queued_bytes": args.max_queued_bytes,
        "metrics_port": args.metrics_port, "metrics_addr": args.metrics_addr,
        "log_level": args.log_level, "log_format": args.log_format,
    }  # fmt: skip
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
    config.insecure = config.insecure or args.insecure
    config.allow_ephemeral = config.allow_ephemeral or args.allow_ephemeral
    if args.pool:
        config.pools = [parse_pool_spec(spec) for spec in args.pool]
    config.validate()
    return config


def _lock(endpoint: str) -> EndpointLock:
    """Take ``endpoint`` for this daemon: a lock for ipc://, a probe for other transports."""
    lock = EndpointLock(endpoint)  # ipc://: held until exit, so no probe can be fooled
    if not endpoint.startswith("ipc://"):
        probe = msgspec.msgpack.encode(msg.Request(id=1, body=msg.GetStats()))
        if endpoint_in_use(endpoint, probe):
            raise EndpointBusy(f"a daemon already serves {endpoint}")
    return lock


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message
    (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }  # fmt: skip
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str) -> None:
    """The ``kvcore`` loggers to stderr, as text or JSON lines (replaces earlier set-up)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("kvcore serve: %(levelname)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def main(args: argparse.Namespace) -> int:
    setup_logging(args.log_level or "INFO", args.log_format or "text")
    locks: list[EndpointLock] = []
    try:
        config = build_config(args)
        setup_logging(config.log_level, config.log_format)  # the file's or environment's
        log.debug("effective configuration: %s", json.dumps(msgspec.to_builtins(config)))
        endpoint = config.endpoint or default_endpoint()  # checks the runtime directory
        for path in _ipc_paths(endpoint, config.events):  # before a lock file is made there
            check_socket_path(path, {os.getuid()}, creating=True)
        locks.append(_lock(endpoint))
        events = events_endpoint(config.events, endpoint)
        if events.startswith("ipc://"):
            locks.append(EndpointLock(events))
        daemon = Daemon(config)
    except (KVCoreError, OSError, ValueError, zmq.ZMQError) as exc:
        for lock in locks:
            lock.release()
        print(f"kvcore serve: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, EndpointBusy) else 2
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: daemon.stop())
    _banner(daemon)
    gc.freeze()  # the pools' bookkeeping is long-lived: keep it out of every collection
    try:
        daemon.serve()
    finally:
        daemon.close()
        for lock in locks:
            lock.release()
        print("kvcore serve: stopped; pools unlinked, socket removed", flush=True)
    return 0


def _banner(daemon: Daemon) -> None:
    config = daemon.config
    print(f"kvcore serve: listening on {daemon.server.endpoint} "
          f"(protocol v{msg.PROTOCOL_VERSION}, epoch {daemon.epoch:x}, "
          f"lease {config.lease_timeout_s:g} s)")  # fmt: skip
    for pool in daemon.pools.pools.values():
        lay = pool.layout
        where = pool.region.name if isinstance(pool.region, HostRegion) else "CUDA IPC"
        print(f"  pool {pool.name!r}: {pool.device}, {lay.num_pages} pages x {lay.page_size} "
              f"tokens, {lay.num_layers} layers x {lay.num_kv_heads} kv heads x {lay.head_dim} "
              f"{lay.dtype}, {lay.total_bytes / (1 << 20):.1f} MiB ({where})")  # fmt: skip
    if config.insecure and daemon.server.endpoint.startswith("tcp://"):
        print("kvcore serve: WARNING: --insecure: no CURVE on tcp://; anyone who reaches "
              "this port can attach, read and write every pool")  # fmt: skip
    for name in daemon.swept:
        print(f"  removed {name}, left by a killed daemon of this endpoint")
    if daemon.metrics_server is not None:
        print(f"  metrics: {daemon.metrics_server.url}/metrics, health: "
              f"{daemon.metrics_server.url}/health")  # fmt: skip
    print(f"  events: {daemon.handler.events_endpoint or 'off'}", flush=True)
