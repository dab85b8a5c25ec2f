"""`kvcore serve`: assemble the daemon, hold its endpoints, run the loop, clean up.

The :class:`Daemon` owns what a start creates: the epoch, the event publisher,
the pools, the session table, the request handler and the ROUTER socket.
``main`` adds what a process needs around it: the configuration (flags over
TOML), an exclusive lock on each ``ipc://`` endpoint it binds (the request
socket and the event socket: a second daemon on the same paths is refused,
and a dead daemon's socket files are swept), signals, the banner and logging.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import secrets
import signal
import sys
import time
from typing import Any

import msgspec
import zmq
from kvcore_ipc import messages as msg
from kvcore_ipc.codec import ServerCodec
from kvcore_ipc.events import EventPublisher
from kvcore_ipc.memory import HostRegion
from kvcore_ipc.server import EndpointBusy, EndpointLock, RouterServer, endpoint_in_use

from kvcore.config import ServiceConfig, default_endpoint, load_toml, parse_pool_spec, runtime_dir
from kvcore.errors import KVCoreError

from .handler import Handler
from .pools import PoolTable
from .sessions import SessionTable

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


class Daemon:
    """Pools, sessions and the handler behind one ROUTER socket; :meth:`serve` runs the loop."""

    def __init__(self, config: ServiceConfig) -> None:
        config.validate()
        self.config = config
        self.epoch = secrets.randbits(63) | 1
        endpoint = config.endpoint or default_endpoint()
        events = events_endpoint(config.events, endpoint)
        self.publisher = EventPublisher(events) if events else None
        self.pools = PoolTable(self.epoch, self.publisher)
        self.sessions = SessionTable(config.lease_timeout_s)
        self.handler = Handler(
            self.pools, self.sessions, ServerCodec(config.max_frame_bytes, config.max_batch),
            allow_ephemeral=config.allow_ephemeral,
            events_endpoint=self.publisher.endpoint if self.publisher else "",
        )  # fmt: skip
        self._next_scan = 0.0
        try:
            for pool in config.pools:
                self.pools.open(pool.name, pool.device, pool.layout())
            secret = None
            if config.curve_secret_key_file:
                with open(config.curve_secret_key_file, "rb") as f:
                    secret = f.read().strip()
            self.server = RouterServer(
                endpoint, self.handler.handle, curve_secret_key=secret, insecure=config.insecure,
                hard_limit_bytes=4 * config.max_frame_bytes,
            )  # fmt: skip
            self.handler.server = self.server
        except BaseException:
            self.close()
            raise

    def tick(self) -> None:
        """Between requests: publish the events of the request just answered (after its
        reply went out), and expire the sessions whose lease is over."""
        self.pools.publish()
        now = time.monotonic()
        if now >= self._next_scan:
            self._next_scan = now + min(0.05, self.sessions.lease_s / 10)
            self.handler.expire(now)
            self.pools.publish()

    def serve(self) -> None:
        self.server.serve(self.tick)

    def stop(self) -> None:
        """Return from :meth:`serve` after the current request (signal-handler safe)."""
        self.server.stop()

    def close(self) -> None:
        """Close every pool (publishing its removals), the socket and the publisher."""
        self.pools.close_all()
        if hasattr(self, "server"):
            self.server.close()
        if self.publisher is not None:
            self.publisher.close()


# -- the command line -----------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file (see kvcore.config); flags override it")
    parser.add_argument("--endpoint", help="ipc:// or tcp:// endpoint (default: runtime dir)")
    parser.add_argument("--pool", action="append", metavar="K=V,...",
                        help="a pool, e.g. name=default,device=cpu,num_layers=16,size=256MiB "
                        "(repeatable; replaces the configured pools)")  # fmt: skip
    parser.add_argument("--events", help="PUB endpoint for page events ('auto': beside "
                        "the request socket, one per daemon)")  # fmt: skip
    parser.add_argument("--lease-timeout", type=float, help="seconds without a request "
                        "before a session's sequences are freed (default 10)")  # fmt: skip
    parser.add_argument("--max-frame-bytes", type=int)
    parser.add_argument("--max-batch", type=int)
    parser.add_argument("--curve-secret-key-file", help="z85 CURVE secret key (tcp://)")
    parser.add_argument("--insecure", action="store_true", help="allow tcp:// without CURVE")
    parser.add_argument("--allow-ephemeral", action="store_true",
                        help="let attach create private pools (tests and development)")  # fmt: skip
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])  # fmt: skip


def build_config(args: argparse.Namespace) -> ServiceConfig:
    config = load_toml(args.config) if args.config else ServiceConfig()
    overrides: dict[str, Any] = {
        "endpoint": args.endpoint, "events": args.events, "lease_timeout_s": args.lease_timeout,
        "max_frame_bytes": args.max_frame_bytes, "max_batch": args.max_batch,
        "curve_secret_key_file": args.curve_secret_key_file,
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


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="kvcore serve: %(levelname)s %(message)s")  # fmt: skip
    locks: list[EndpointLock] = []
    try:
        config = build_config(args)
        endpoint = config.endpoint or default_endpoint()
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
    for signum in (signal.SIGINT, signal.SIGTERM):
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
    print(f"  events: {daemon.handler.events_endpoint or 'off'}", flush=True)
