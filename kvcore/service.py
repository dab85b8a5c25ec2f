"""The daemon: serves one :class:`~kvcore.manager.Manager` per pool over kvcore_ipc.

Request path (single-threaded, one request at a time, so Manager needs no lock)::

    ROUTER frame -> ServerCodec.decode_request -> Service._dispatch -> Manager op
                 -> result struct -> ServerCodec.encode_result -> ROUTER frame

Sessions and leases. ``attach`` opens a session on one pool; every request
renews its lease; a session that detaches or is silent for ``lease_timeout_s``
(its process died, or stopped heartbeating) has each of its sequences freed
through ``Manager.free``, so the pool is exactly as if they had been freed by
hand. Sequence ids are per pool; a sequence belongs to the session that
created it (allocate or fork): any other session touching it gets
``forbidden``. Invariant: ``pool.owner`` maps exactly the pool's live
sequences to live sessions, and ``session.seqs`` is its inverse.

Each start draws a fresh random ``epoch``; a request carrying another epoch
gets ``stale_epoch`` and changes nothing, so no client acts on pages of an
earlier daemon.
"""

from __future__ import annotations

import argparse
import gc
import secrets
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from kvcore_ipc import messages as msg
from kvcore_ipc.codec import FrameError, ServerCodec
from kvcore_ipc.events import EventPublisher
from kvcore_ipc.memory import CudaRegion, HostRegion
from kvcore_ipc.server import EndpointBusy, EndpointLock, RouterServer, endpoint_in_use

from kvcore.config import (
    ServiceConfig,
    default_endpoint,
    load_toml,
    parse_pool_spec,
    runtime_dir,
)
from kvcore.errors import (
    BadRequest,
    Forbidden,
    InternalError,
    KVCoreError,
    LayoutMismatch,
    NotAttached,
    StaleEpoch,
    UnknownPool,
    VersionMismatch,
)
from kvcore.layout import KVLayout
from kvcore.manager import Manager
from kvcore.prefix import PageEvent, PageStored, root_key


@dataclass(slots=True)
class Pool:
    """One served pool: its memory, its Manager and who owns which sequence."""

    name: str
    device: str
    manager: Manager  # changed only by Service._run / Service._drop
    region: HostRegion | CudaRegion  # described anew for each attach (CUDA IPC refcounts)
    ephemeral: bool = False  # created by an attach; closed when its last session leaves
    owner: dict[int, int] = field(default_factory=dict)  # seq id -> session id
    num_sessions: int = 0
    event_seq: int = 0  # seq_no of the last event published for this pool


@dataclass(slots=True)
class Session:
    id: int
    pool: Pool
    namespace: str
    pid: int
    name: str
    deadline: float  # time.monotonic() after which the lease is over
    last_seen: float
    seqs: set[int] = field(default_factory=set)  # inverse of pool.owner for this session


def layout_message(layout: KVLayout) -> msg.PoolLayout:
    return msg.PoolLayout(**layout.to_dict())


class Service:
    """Pools, sessions and the request handler; :meth:`serve` runs the loop."""

    def __init__(self, config: ServiceConfig) -> None:
        config.validate()
        self.config = config
        self.epoch = secrets.randbits(63) | 1
        self.lease_s = config.lease_timeout_s
        self.codec = ServerCodec(config.max_frame_bytes, config.max_batch)
        self.pools: dict[str, Pool] = {}
        self.sessions: dict[int, Session] = {}
        self.started = time.monotonic()
        self.requests = self.errors = self.expired = 0
        self._next_scan = 0.0
        self._handlers: dict[type, Callable[[Session, Any], msgspec.Struct]] = {
            msg.Extend: self._extend, msg.Allocate: self._allocate, msg.Commit: self._commit,
            msg.Fork: self._fork, msg.Free: self._free, msg.Lookup: self._lookup,
            msg.BlockTable: self._block_table, msg.NumTokens: self._num_tokens,
        }  # fmt: skip
        endpoint = config.endpoint or default_endpoint()
        events = config.events
        if events == "auto":
            events = f"ipc://{runtime_dir() / 'events.sock'}"
        self.publisher = EventPublisher(events) if events else None
        self.events_endpoint = self.publisher.endpoint if self.publisher else ""
        try:
            for pool_config in config.pools:
                self._open_pool(pool_config.name, pool_config.device, pool_config.layout())
            secret = None
            if config.curve_secret_key_file:
                with open(config.curve_secret_key_file, "rb") as f:
                    secret = f.read().strip()
            self.server = RouterServer(
                endpoint, self.handle, curve_secret_key=secret, insecure=config.insecure,
                hard_limit_bytes=4 * config.max_frame_bytes,
            )  # fmt: skip
        except BaseException:
            self.close()
            raise

    # -- pools -------------------------------------------------------------------

    def _open_pool(self, name: str, device: str, layout: KVLayout, ephemeral: bool = False) -> Pool:
        region: HostRegion | CudaRegion
        if device == "cpu":
            region = HostRegion.create(layout.total_bytes)
        else:
            region = CudaRegion.create(layout.total_bytes, device)
        cell: list[Pool] = []  # the sink needs the pool, the pool needs the manager
        manager = Manager(layout, event_sink=lambda event: self._publish(cell[0], event))
        pool = Pool(name, device, manager, region, ephemeral)
        cell.append(pool)
        self.pools[name] = pool
        return pool

    def _publish(self, pool: Pool, event: PageEvent) -> None:
        if self.publisher is None:
            return
        pool.event_seq += 1
        out: msg.Event
        if isinstance(event, PageStored):
            out = msg.PageStoredEvent(pool.name, self.epoch, pool.event_seq, event.key,
                                      event.parent_key, event.page)  # fmt: skip
        else:
            out = msg.PageRemovedEvent(pool.name, self.epoch, pool.event_seq, event.key, event.page)
        self.publisher.publish(out)

    # -- the request path -----------------------------------------------------------

    def handle(self, frame: bytes) -> bytes:
        """Answer one request frame; never raises."""
        self.requests += 1
        try:
            request = self.codec.decode_request(frame)
        except FrameError as exc:
            self.errors += 1
            return self.codec.encode_error(exc.request_id, exc.code, exc.message)
        except Exception as exc:  # a frame the codec failed to classify: still a bad request
            self.errors += 1
            return self.codec.encode_error(0, "bad_request", f"undecodable request: {exc!r}")
        try:
            return self.codec.encode_result(request.id, self._dispatch(request))
        except KVCoreError as exc:
            self.errors += 1
            return self.codec.encode_error(request.id, exc.code, str(exc))
        except Exception as exc:  # a bug: report it, keep serving
            self.errors += 1
            traceback.print_exc(file=sys.stderr)
            return self.codec.encode_error(request.id, "internal", f"{type(exc).__name__}: {exc}")

    def _dispatch(self, request: msg.Request) -> msgspec.Struct:
        body = request.body
        if isinstance(body, msg.Attach):
            return self._attach(body)
        if isinstance(body, msg.GetStats):
            return self._stats()
        session = self._session(request)
        handler = self._handlers.get(type(body))
        if handler is not None:  # the hot path: one sequence operation
            return handler(session, body)
        match body:
            case msg.Batch(ops=ops):
                results: list[Any] = []
                handlers = self._handlers
                try:
                    for op in ops:  # every BatchOp type has a handler (the union says so)
                        results.append(handlers[type(op)](session, op))
                except KVCoreError as exc:
                    return msg.BatchOk(results, msg.ErrorBody(exc.code, str(exc)))
                return msg.BatchOk(results)
            case msg.Heartbeat():
                return msg.Empty()
            case msg.Detach():
                self._drop(session)
                return msg.Empty()
            case msg.Check():
                return self._check(session.pool)
        raise BadRequest(f"operation {type(body).__name__} is not allowed here")

    def _session(self, request: msg.Request) -> Session:
        if request.session == 0:
            raise NotAttached("attach first")
        if request.epoch != self.epoch:
            raise StaleEpoch(f"epoch {request.epoch} is over; this daemon runs epoch {self.epoch}")
        session = self.sessions.get(request.session)
        if session is None:
            raise NotAttached(f"no live session {request.session} (detached or lease expired)")
        now = time.monotonic()
        session.last_seen = now
        session.deadline = now + self.lease_s
        return session

    def _extend(self, session: Session, op: msg.Extend) -> msg.ExtendOk:
        self._own(session, op.seq)
        ext = session.pool.manager.extend(op.seq, op.num_tokens)
        return msg.ExtendOk(ext.new_pages, ext.copies)

    def _allocate(self, session: Session, op: msg.Allocate) -> msg.AllocateOk:
        namespace = session.namespace if op.namespace is None else op.namespace
        alloc = session.pool.manager.allocate(op.seq, op.tokens, namespace=namespace)
        session.pool.owner[op.seq] = session.id
        session.seqs.add(op.seq)
        return msg.AllocateOk(alloc.pages, alloc.num_cached_tokens)

    def _commit(self, session: Session, op: msg.Commit) -> msg.CommitOk:
        self._own(session, op.seq)
        return msg.CommitOk(session.pool.manager.commit(op.seq, op.tokens))

    def _fork(self, session: Session, op: msg.Fork) -> msg.PagesOk:
        self._own(session, op.parent)
        pages = session.pool.manager.fork(op.parent, op.child)
        session.pool.owner[op.child] = session.id
        session.seqs.add(op.child)
        return msg.PagesOk(pages)

    def _free(self, session: Session, op: msg.Free) -> msg.Empty:
        self._own(session, op.seq)
        session.pool.manager.free(op.seq)
        del session.pool.owner[op.seq]
        session.seqs.discard(op.seq)
        return msg.Empty()

    def _lookup(self, session: Session, op: msg.Lookup) -> msg.LookupOk:
        namespace = session.namespace if op.namespace is None else op.namespace
        return msg.LookupOk(session.pool.manager.lookup(op.tokens, namespace=namespace))

    def _block_table(self, session: Session, op: msg.BlockTable) -> msg.PagesOk:
        self._own(session, op.seq)
        return msg.PagesOk(session.pool.manager.block_table(op.seq))

    def _num_tokens(self, session: Session, op: msg.NumTokens) -> msg.NumTokensOk:
        self._own(session, op.seq)
        return msg.NumTokensOk(session.pool.manager.num_tokens(op.seq))

    @staticmethod
    def _own(session: Session, seq: int) -> None:
        owner = session.pool.owner.get(seq)
        if owner is not None and owner != session.id:
            raise Forbidden(f"sequence {seq} belongs to another session")

    # -- sessions -------------------------------------------------------------------

    def _attach(self, body: msg.Attach) -> msg.AttachOk:
        if body.version != msg.PROTOCOL_VERSION:
            raise VersionMismatch(
                f"client speaks protocol v{body.version}; this daemon speaks v{msg.PROTOCOL_VERSION}"
            )
        root_key(body.namespace)  # BadRequest if the namespace is too long
        if body.ephemeral:
            pool = self._ephemeral_pool(body)
        else:
            found = self.pools.get(body.pool)
            if found is None:
                raise UnknownPool(f"no pool {body.pool!r}; serving {sorted(self.pools)}")
            pool = found
        layout = pool.manager.layout
        want = body.layout
        if want is not None and (
            layout_message(layout) != msg.PoolLayout(**{**msgspec.structs.asdict(want),
                                                     "num_pages": want.num_pages or layout.num_pages})
        ):  # fmt: skip
            raise LayoutMismatch(f"pool {pool.name!r} has layout {layout}; expected {want}")
        now = time.monotonic()
        session_id = secrets.randbits(63) | 1
        self.sessions[session_id] = Session(
            session_id, pool, body.namespace, body.pid, body.name, now + self.lease_s, now
        )
        pool.num_sessions += 1
        return msg.AttachOk(
            session=session_id, epoch=self.epoch, version=msg.PROTOCOL_VERSION, pool=pool.name,
            device=pool.device, layout=layout_message(layout), memory=pool.region.describe(),
            lease_ms=int(self.lease_s * 1000), max_frame_bytes=self.codec.max_frame_bytes,
            max_batch=self.codec.max_batch, events=self.events_endpoint,
        )  # fmt: skip

    def _ephemeral_pool(self, body: msg.Attach) -> Pool:
        if not self.config.allow_ephemeral:
            raise Forbidden("this daemon does not create ephemeral pools (--allow-ephemeral)")
        if body.layout is None or body.layout.num_pages == 0:
            raise BadRequest("an ephemeral pool needs a full layout (num_pages > 0)")
        if body.pool in self.pools:
            raise BadRequest(f"pool {body.pool!r} exists")
        want = body.layout
        layout = KVLayout(want.num_layers, want.num_kv_heads, want.head_dim, want.page_size,
                          want.dtype, want.num_pages)  # fmt: skip
        if layout.total_bytes > 1 << 30 or layout.num_pages > 1 << 20:
            raise BadRequest("ephemeral pools are limited to 1 GiB and 2**20 pages")
        return self._open_pool(body.pool, "cpu", layout, ephemeral=True)

    def _drop(self, session: Session) -> None:
        """End a session: free its sequences (tail pages first, as Manager.free does)."""
        pool = session.pool
        for seq in sorted(session.seqs):
            pool.manager.free(seq)
            del pool.owner[seq]
        session.seqs.clear()
        del self.sessions[session.id]
        pool.num_sessions -= 1
        if pool.ephemeral and pool.num_sessions == 0:
            del self.pools[pool.name]
            pool.region.close()

    def tick(self) -> None:
        """Expire sessions whose lease is over (called by the loop between requests)."""
        now = time.monotonic()
        if now < self._next_scan:
            return
        self._next_scan = now + min(0.05, self.lease_s / 10)
        for session in [s for s in self.sessions.values() if s.deadline < now]:
            self.expired += 1
            print(f"kvcore: session {session.id:x} (pid {session.pid}) lease expired; "
                  f"freeing {len(session.seqs)} sequences", file=sys.stderr, flush=True)  # fmt: skip
            self._drop(session)

    # -- queries --------------------------------------------------------------------

    def _check(self, pool: Pool) -> msg.Empty:
        try:
            pool.manager.check_integrity()
            live = pool.manager.stats().num_sequences
            assert live == len(pool.owner), f"{live} live sequences, {len(pool.owner)} owned"
            for seq, owner in pool.owner.items():
                assert seq in pool.manager, f"owned sequence {seq} is not live"
                assert seq in self.sessions[owner].seqs, f"sequence {seq} not in its session"
        except AssertionError as exc:
            raise InternalError(f"integrity check failed: {exc}") from None
        return msg.Empty()

    def _stats(self) -> msg.StatsOk:
        now = time.monotonic()
        pools = []
        for pool in self.pools.values():
            s = pool.manager.stats()
            pools.append(msg.PoolStats(
                pool.name, pool.device, layout_message(pool.manager.layout), s.total_pages,
                s.free_pages, s.evictable_pages, s.held_pages, s.cached_pages, s.num_sequences,
                s.query_tokens, s.hit_tokens, s.evictions, pool.num_sessions, pool.ephemeral,
            ))  # fmt: skip
        sessions = [
            msg.SessionStats(
                s.pool.name, s.namespace, s.pid, s.name, len(s.seqs), int((now - s.last_seen) * 1000)
            )
            for s in self.sessions.values()
        ]
        counters = msg.ServerCounters(
            self.epoch, msg.PROTOCOL_VERSION, now - self.started, self.requests, self.errors,
            self.server.dropped_frames, self.expired,
        )  # fmt: skip
        return msg.StatsOk(pools, sessions, counters)

    # -- life cycle -----------------------------------------------------------------

    def serve(self) -> None:
        self.server.serve(self.tick)

    def stop(self) -> None:
        self.server.stop()

    def close(self) -> None:
        """Unlink every pool's memory and remove the socket file."""
        for pool in self.pools.values():
            pool.region.close()
        self.pools.clear()
        if hasattr(self, "server"):
            self.server.close()
        if self.publisher is not None:
            self.publisher.close()


# -- `kvcore serve` -----------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file (see kvcore.config); flags override it")
    parser.add_argument("--endpoint", help="ipc:// or tcp:// endpoint (default: runtime dir)")
    parser.add_argument("--pool", action="append", metavar="K=V,...",
                        help="a pool, e.g. name=default,device=cpu,num_layers=16,size=256MiB "
                        "(repeatable; replaces the configured pools)")  # fmt: skip
    parser.add_argument("--events", help="PUB endpoint for page events ('auto': runtime dir)")
    parser.add_argument("--lease-timeout", type=float, help="seconds without a request "
                        "before a session's sequences are freed (default 10)")  # fmt: skip
    parser.add_argument("--max-frame-bytes", type=int)
    parser.add_argument("--max-batch", type=int)
    parser.add_argument("--curve-secret-key-file", help="z85 CURVE secret key (tcp://)")
    parser.add_argument("--insecure", action="store_true", help="allow tcp:// without CURVE")
    parser.add_argument("--allow-ephemeral", action="store_true",
                        help="let attach create private pools (tests and development)")  # fmt: skip


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


def main(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
        endpoint = config.endpoint or default_endpoint()
        lock = EndpointLock(endpoint)  # ipc://: held until exit, so no probe can be fooled
        if not endpoint.startswith("ipc://"):
            probe = msgspec.msgpack.encode(msg.Request(id=1, body=msg.GetStats()))
            if endpoint_in_use(endpoint, probe):
                raise EndpointBusy(f"a daemon already serves {endpoint}")
    except EndpointBusy as exc:
        print(f"kvcore serve: {exc}", file=sys.stderr)
        return 1
    except (KVCoreError, OSError, ValueError, zmq.ZMQError) as exc:
        print(f"kvcore serve: {exc}", file=sys.stderr)
        return 2
    try:
        service = Service(config)
    except (KVCoreError, OSError, ValueError, zmq.ZMQError) as exc:
        lock.release()
        print(f"kvcore serve: {exc}", file=sys.stderr)
        return 2
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: service.stop())
    print(f"kvcore serve: listening on {service.server.endpoint} "
          f"(protocol v{msg.PROTOCOL_VERSION}, epoch {service.epoch:x}, "
          f"lease {config.lease_timeout_s:g} s)")  # fmt: skip
    for pool in service.pools.values():
        lay = pool.manager.layout
        where = pool.region.name if isinstance(pool.region, HostRegion) else "CUDA IPC"
        print(f"  pool {pool.name!r}: {pool.device}, {lay.num_pages} pages x {lay.page_size} "
              f"tokens, {lay.num_layers} layers x {lay.num_kv_heads} kv heads x {lay.head_dim} "
              f"{lay.dtype}, {lay.total_bytes / (1 << 20):.1f} MiB ({where})")  # fmt: skip
    print(f"  events: {service.events_endpoint or 'off'}", flush=True)
    gc.freeze()  # the pools' bookkeeping is long-lived: keep it out of every collection
    try:
        service.serve()
    finally:
        service.close()
        lock.release()
        print("kvcore serve: stopped; pools unlinked, socket removed", flush=True)
    return 0


if __name__ == "__main__":  # `python -m kvcore.service`: the serve command alone
    _parser = argparse.ArgumentParser(prog="kvcore serve")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
