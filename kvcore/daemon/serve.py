"""`kvcore serve`: the command line around the :class:`~kvcore.daemon.daemon.Daemon`.

``main`` adds what a process needs around the daemon: the configuration (flags
over ``KVCORE_*`` variables over TOML), the trust checks of its ipc:// paths
(docs/security.md), an exclusive lock on each ``ipc://`` endpoint it binds (the
request socket and the event socket: a second daemon on the same paths is
refused, and a dead daemon's socket files are swept), signals (SIGINT, SIGTERM,
SIGHUP: a clean stop), the banner and logging (text or one JSON object per
line), a takeover of the running daemon (``--takeover``: kvcore.daemon.takeover)
and the service manager's notifications (kvcore.daemon.notify). Exit status: 0
after a clean stop, 1 if the endpoint is taken (or a takeover timed out), 2 for
any other failure to start (the message on stderr).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
from datetime import datetime, timezone

import msgspec
import zmq
from kvcore_ipc import messages as msg
from kvcore_ipc.memory import HostRegion
from kvcore_ipc.server import EndpointBusy, EndpointLock, endpoint_in_use

from kvcore.config import Group, ServiceConfig, apply_env, load_toml, parse_pool_spec
from kvcore.errors import KVCoreError
from kvcore.paths import check_socket_path, default_endpoint

from . import fdlimit, flags
from .daemon import Daemon, events_endpoint, ipc_paths
from .notify import notify
from .takeover import Takeover, take_over

log = logging.getLogger("kvcore.daemon")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvcore serve`, in the groups --help lists them in: ``--config`` and
    ``--pool``, then one per scalar setting of ServiceConfig, derived from its field
    (:mod:`kvcore.daemon.flags`). Each flag given overrides its setting (:func:`build_config`)."""
    groups = flags.add_groups(parser)
    where = groups[Group.WHERE]
    where.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file (see docs/quickstart.md); KVCORE_* variables override it, "
        "flags override both (default: none)",
    )
    where.add_argument(
        "--pool",
        action="append",
        metavar="K=V,...",
        help="a pool, e.g. name=default,device=cpu,num_layers=16,size=256MiB "
        "(repeatable; replaces the configured pools); shards=N: one region per "
        "pipeline stage, num_layers being one stage's (num_kv_heads: every head)",
    )
    where.add_argument(
        "--takeover",
        action="store_true",
        help="start in place of the daemon that serves the endpoint: stop it (SIGTERM) once "
        "this one is ready, take its socket and re-adopt its kept pools (an upgrade with "
        "one re-attach; docs/deploy.md)",
    )
    flags.add_setting_flags(groups)


def build_config(args: argparse.Namespace) -> ServiceConfig:
    """The configuration: the TOML file, then ``KVCORE_*`` variables, then the flags given,
    each over the one before; BadRequest if a flag's text is no value of its setting, or if
    the result is invalid."""
    config = apply_env(load_toml(args.config) if args.config else ServiceConfig())
    config = msgspec.structs.replace(config, **flags.given(args))
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
        when = datetime.fromtimestamp(record.created, timezone.utc)
        entry = {
            "time": when.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
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
        fdlimit.raise_soft_limit()  # descriptors in reserve for ZeroMQ
        log.debug("effective configuration: %s", json.dumps(msgspec.to_builtins(config)))
        endpoint = config.endpoint or default_endpoint()  # checks the runtime directory
        # every ipc:// socket path is checked before a lock file is made there
        for path in ipc_paths(endpoint, config.events, config.events_replay):
            check_socket_path(path, {os.getuid()}, creating=True)
        events = [events_endpoint(config.events, endpoint), config.events_replay]
        events = [e for e in events if e.startswith("ipc://")]
        if args.takeover:
            took = take_over([endpoint, *events])
            locks = took.locks
        else:
            took = None
            locks.append(_lock(endpoint))
            locks.extend(EndpointLock(e) for e in events)
        daemon = Daemon(config)
    except (KVCoreError, OSError, ValueError, zmq.ZMQError) as exc:
        for lock in locks:
            lock.release()
        print(f"kvcore serve: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, EndpointBusy) else 2
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: daemon.stop())
    _banner(daemon, took)
    notify("READY=1")
    gc.freeze()  # the pools' bookkeeping is long-lived: keep it out of every collection
    kept = [p.name for p in daemon.pools.pools.values() if p.kept is not None]
    try:
        daemon.serve()
    finally:
        notify("STOPPING=1")
        daemon.close()
        for lock in locks:
            lock.release()
        what = (
            f"pools {', '.join(map(repr, kept))} kept for the next daemon"
            if kept
            else "pools unlinked"
        )
        print(f"kvcore serve: stopped; {what}, socket removed", flush=True)
    return 0


def _banner(daemon: Daemon, took: Takeover | None) -> None:
    config = daemon.config
    print(
        f"kvcore serve: listening on {daemon.server.endpoint} "
        f"(protocol v{msg.PROTOCOL_VERSION}, epoch {daemon.epoch:x}, "
        f"lease {config.lease_timeout_s:g} s)"
    )
    for pool in daemon.pools.pools.values():
        lay = pool.layout
        names = [r.name for r in pool.regions if isinstance(r, HostRegion)]
        where = ", ".join(names) if names else "CUDA IPC"
        shards = f", {pool.shards} shards of {lay.num_kv_heads} heads" if pool.shards > 1 else ""
        print(
            f"  pool {pool.name!r}: {pool.device}, {lay.num_pages} pages x {lay.page_size} "
            f"tokens, {lay.num_layers} layers x {lay.num_kv_heads} kv heads x {lay.head_dim} "
            f"{lay.dtype}, order {lay.order}{shards}, {pool.total_bytes / (1 << 20):.1f} MiB "
            f"({where}{'; kept across restarts' if pool.kept is not None else ''})"
        )
    if config.insecure and daemon.server.endpoint.startswith("tcp://"):
        print(
            "kvcore serve: WARNING: --insecure: no CURVE on tcp://; anyone who reaches "
            "this port can attach, read and write every pool"
        )
    if took is not None:
        print(
            f"  took over from pid {took.pid}: it let go in {took.stopped_s:.3f} s"
            if took.pid
            else "  --takeover: no daemon held the endpoint"
        )
    for name in daemon.swept:
        print(f"  removed {name}, left by a killed daemon of this endpoint")
    if daemon.metrics_server is not None:
        print(f"  metrics: {daemon.metrics_server.banner()}")
    print(f"  events: {daemon.handler.events_endpoint or 'off'}", flush=True)
