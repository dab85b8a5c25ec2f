"""`kvcore serve`: the command line around the :class:`~kvcore.daemon.daemon.Daemon`.

``main`` adds what a process needs around the daemon: the configuration (flags
over ``KVCORE_*`` variables over TOML), the trust checks of its ipc:// paths
(docs/security.md), an exclusive lock on each ``ipc://`` endpoint it binds (the
request socket and the event socket: a second daemon on the same paths is
refused, and a dead daemon's socket files are swept), signals (SIGINT, SIGTERM,
SIGHUP: a clean stop), the banner and logging (text or one JSON object per
line). Exit status: 0 after a clean stop, 1 if the endpoint is taken, 2 for
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
from typing import Any

import msgspec
import zmq
from kvcore_ipc import messages as msg
from kvcore_ipc.memory import HostRegion
from kvcore_ipc.server import EndpointBusy, EndpointLock, endpoint_in_use

from kvcore.config import LOG_LEVELS, ServiceConfig, apply_env, load_toml, parse_pool_spec
from kvcore.errors import KVCoreError
from kvcore.paths import check_socket_path, default_endpoint

from . import fdlimit
from .daemon import Daemon, events_endpoint, ipc_paths

log = logging.getLogger("kvcore.daemon")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvcore serve`, in the order --help lists them. Each flag given
    overrides its configuration field (:func:`build_config`)."""
    _where_arguments(parser)
    _limit_arguments(parser)
    _access_arguments(parser)
    _observing_arguments(parser)


def _where_arguments(parser: argparse.ArgumentParser) -> None:
    """The configuration file, the endpoint, the pools and the event stream."""
    parser.add_argument(
        "--config",
        help="TOML file (see docs/quickstart.md); KVCORE_* variables override it, "
        "flags override both (default: none)",
    )
    parser.add_argument(
        "--endpoint",
        help="ipc:// or tcp:// endpoint (default: ipc://$XDG_RUNTIME_DIR/kvcore/kvcore.sock)",
    )
    parser.add_argument(
        "--pool",
        action="append",
        metavar="K=V,...",
        help="a pool, e.g. name=default,device=cpu,num_layers=16,size=256MiB "
        "(repeatable; replaces the configured pools); shards=N: one region per "
        "tensor-parallel rank, num_kv_heads being one rank's",
    )
    parser.add_argument(
        "--events",
        help="PUB endpoint for page events "
        "('auto': beside the request socket, one per daemon; default: off)",
    )
    parser.add_argument(
        "--events-format",
        choices=["kvcore", "vllm"],
        help="the event stream's format: kvcore's (spec/protocol.md) or vLLM's KV events, "
        "as KV-aware routers read them (spec/vllm-events.md); default kvcore",
    )
    parser.add_argument(
        "--events-replay",
        help="vllm format: ROUTER endpoint that replays buffered event batches "
        "(vLLM's replay_endpoint; default: off)",
    )


def _limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Leases, and the bounds on frames, batches, sessions and queues."""
    parser.add_argument(
        "--lease-timeout",
        type=float,
        help="seconds without a request before a session's sequences are freed (default 10)",
    )
    parser.add_argument(
        "--max-frame-bytes", type=int, help="largest request or reply (default 8388608)"
    )
    parser.add_argument("--max-batch", type=int, help="operations per batch (default 4096)")
    parser.add_argument(
        "--max-request-tokens",
        type=int,
        help="tokens of work one request may carry, summed over a batch (default 1048576)",
    )
    parser.add_argument("--max-sessions", type=int, help="sessions at once (default 1024)")
    parser.add_argument(
        "--max-sessions-per-process",
        type=int,
        help="sessions one client process may hold (ipc://; default min(64, the tenant bound))",
    )
    parser.add_argument(
        "--max-sessions-per-tenant",
        type=int,
        help="sessions one tenant may hold (default max-sessions less an eighth)",
    )
    parser.add_argument(
        "--max-queued-bytes",
        type=int,
        help="bytes of requests queued per connection before the daemon stops reading it "
        "(default 64 MiB)",
    )
    parser.add_argument(
        "--fence-timeout",
        type=float,
        help="seconds an expired session stays fenced before its pages are freed, "
        "whether or not its process can be watched (default 300)",
    )


def _access_arguments(parser: argparse.ArgumentParser) -> None:
    """Who may connect: CURVE keys, tcp:// without them, a remote tier without a secret,
    ephemeral pools."""
    parser.add_argument(
        "--curve-secret-key-file",
        help="CURVE secret key (tcp://): z85, or a `kvcore keys` .key_secret file; "
        "must be mode 0600 (default: none)",
    )
    parser.add_argument(
        "--authorized-keys",
        dest="authorized_keys_dir",
        help="directory of client public keys (*.key, `kvcore keys`): "
        "only they may connect (default: none)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow tcp:// without CURVE "
        "(anyone who reaches the port can read and write every pool)",
    )
    parser.add_argument(
        "--insecure-remote-tier",
        action="store_true",
        help="allow a remote (Mooncake) tier without tier_secret_file "
        "(any client of the master can plant the K/V every daemon on it serves)",
    )
    parser.add_argument(
        "--allow-ephemeral",
        action="store_true",
        help="let attach create private pools (tests and development)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics and /health over HTTP on this port "
        "(0: any free port; default: off)",
    )


def _observing_arguments(parser: argparse.ArgumentParser) -> None:
    """The metrics endpoint and the logs."""
    parser.add_argument(
        "--metrics-addr", help="address the metrics port binds (default 127.0.0.1: loopback only)"
    )
    parser.add_argument(
        "--metrics-socket",
        metavar="PATH",
        help="serve metrics on this unix socket (mode 0600, the daemon's user and root only) "
        "instead of a port (default: off)",
    )
    parser.add_argument(
        "--metrics-token-file",
        metavar="FILE",
        help="every scrape but /health must send this bearer token (a mode 0600 file; "
        "default: none)",
    )
    parser.add_argument(
        "--metrics-namespace-labels",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="per-namespace series, which name every namespace (default: on)",
    )
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, help="the least severe records logged (default INFO)"
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="text lines, or one JSON object per line for log shippers (default text)",
    )


def build_config(args: argparse.Namespace) -> ServiceConfig:
    """The configuration: the TOML file, then ``KVCORE_*`` variables, then the flags given,
    each over the one before; BadRequest if the result is invalid."""
    config = apply_env(load_toml(args.config) if args.config else ServiceConfig())
    overrides: dict[str, Any] = {
        "endpoint": args.endpoint,
        "events": args.events,
        "lease_timeout_s": args.lease_timeout,
        "events_format": args.events_format,
        "events_replay": args.events_replay,
        "max_frame_bytes": args.max_frame_bytes,
        "max_batch": args.max_batch,
        "curve_secret_key_file": args.curve_secret_key_file,
        "authorized_keys_dir": args.authorized_keys_dir,
        "max_request_tokens": args.max_request_tokens,
        "max_sessions": args.max_sessions,
        "max_sessions_per_process": args.max_sessions_per_process,
        "max_sessions_per_tenant": args.max_sessions_per_tenant,
        "fence_timeout_s": args.fence_timeout,
        "max_queued_bytes": args.max_queued_bytes,
        "metrics_port": args.metrics_port,
        "metrics_addr": args.metrics_addr,
        "metrics_socket": args.metrics_socket,
        "metrics_token_file": args.metrics_token_file,
        "metrics_namespace_labels": args.metrics_namespace_labels,
        "log_level": args.log_level,
        "log_format": args.log_format,
    }
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
    config.insecure = config.insecure or args.insecure
    config.insecure_remote_tier = config.insecure_remote_tier or args.insecure_remote_tier
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
        locks.append(_lock(endpoint))
        for events in (events_endpoint(config.events, endpoint), config.events_replay):
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
            f"{lay.dtype}{shards}, {pool.total_bytes / (1 << 20):.1f} MiB ({where})"
        )
    if config.insecure and daemon.server.endpoint.startswith("tcp://"):
        print(
            "kvcore serve: WARNING: --insecure: no CURVE on tcp://; anyone who reaches "
            "this port can attach, read and write every pool"
        )
    for name in daemon.swept:
        print(f"  removed {name}, left by a killed daemon of this endpoint")
    if daemon.metrics_server is not None:
        print(f"  metrics: {daemon.metrics_server.banner()}")
    print(f"  events: {daemon.handler.events_endpoint or 'off'}", flush=True)
