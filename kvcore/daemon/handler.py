"""The request handler: one frame in, one frame out, dispatched through the operation table.

Request path (single-threaded, one request at a time, so no Manager needs a lock)::

    frame -> ServerCodec.decode_request -> session (epoch, lease) -> ownership
          -> Operation.serve(Manager) -> claim / release -> encode -> frame

Manager operations come from :data:`kvcore.ops.OPERATIONS` (ownership rule and
all); this module adds only the session-level operations (attach, detach,
heartbeat, stats, check, snapshot, batch). Every failure is a typed error
reply; a failed operation changed nothing (the Manager's promise, and
ownership changes only after the Manager succeeded).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
from kvcore_ipc import messages as msg
from kvcore_ipc.codec import FrameError, ServerCodec
from kvcore_ipc.server import RouterServer

from kvcore.errors import (
    BadRequest,
    Forbidden,
    InternalError,
    KVCoreError,
    LayoutMismatch,
    NotAttached,
    StaleEpoch,
    VersionMismatch,
)
from kvcore.layout import KVLayout
from kvcore.ops import OPERATIONS, Operation
from kvcore.prefix import root_key

from .pools import Pool, PoolTable
from .sessions import Session, SessionTable

log = logging.getLogger("kvcore.daemon")


class Handler:
    """Answers request frames against the daemon's pools and sessions; never raises."""

    def __init__(
        self,
        pools: PoolTable,
        sessions: SessionTable,
        codec: ServerCodec,
        *,
        allow_ephemeral: bool,
        events_endpoint: str,
    ) -> None:
        self.pools = pools
        self.sessions = sessions
        self.codec = codec
        self.epoch = pools.epoch
        self.allow_ephemeral = allow_ephemeral
        self.events_endpoint = events_endpoint
        self.started = time.monotonic()
        self.requests = 0
        self.errors = 0
        self.expired = 0
        self.server: RouterServer | None = None  # set once the socket is bound (frame counters)

    def handle(self, frame: bytes) -> bytes:
        """Answer one request frame."""
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
            log.exception("internal error on %s", type(request.body).__name__)
            return self.codec.encode_error(request.id, "internal", f"{type(exc).__name__}: {exc}")

    def _dispatch(self, request: msg.Request) -> msgspec.Struct:
        body = request.body
        op = OPERATIONS.get(type(body))
        if op is not None:  # the hot path: one Manager operation
            session = self._session(request)
            return self._run(session, self.pools.pools[session.pool], op, body)
        match body:
            case msg.Attach():
                return self._attach(body)
            case msg.GetStats():
                return self._stats()
        session = self._session(request)
        pool = self.pools.pools[session.pool]
        match body:
            case msg.Batch(ops=ops):
                results: list[Any] = []
                try:
                    for item in ops:  # every BatchOp is in the table (kvcore.ops asserts it)
                        results.append(self._run(session, pool, OPERATIONS[type(item)], item))
                except KVCoreError as exc:
                    self.errors += 1
                    return msg.BatchOk(results, msg.ErrorBody(exc.code, str(exc)))
                return msg.BatchOk(results)
            case msg.Heartbeat():
                return msg.Empty()
            case msg.Detach():
                self.end_session(session)
                return msg.Empty()
            case msg.Check():
                return self._check()
            case msg.Snapshot():
                return self.pools.snapshot(pool)
        raise BadRequest(f"operation {type(body).__name__} is not allowed here")

    def _session(self, request: msg.Request) -> Session:
        if request.session == 0:
            raise NotAttached("attach first")
        if request.epoch != self.epoch:
            raise StaleEpoch(f"epoch {request.epoch} is over; this daemon runs epoch {self.epoch}")
        return self.sessions.renew(request.session, time.monotonic())

    def _run(self, session: Session, pool: Pool, op: Operation[Any, Any], body: Any) -> msgspec.Struct:
        """One Manager operation under the ownership rule of its table entry."""
        for name in op.owns:
            self.sessions.check_owner(session, getattr(body, name))
        result = op.serve(pool.manager, body, session.namespace)
        if op.creates is not None:
            self.sessions.claim(session, getattr(body, op.creates))
        if op.ends is not None:
            self.sessions.release(session, getattr(body, op.ends))
        return result

    # -- sessions --------------------------------------------------------------------

    def _attach(self, body: msg.Attach) -> msg.AttachOk:
        if body.version != msg.PROTOCOL_VERSION:
            raise VersionMismatch(
                f"client speaks protocol v{body.version}; this daemon speaks v{msg.PROTOCOL_VERSION}"
            )
        root_key(body.namespace)  # BadRequest if the namespace is over 256 bytes
        pool = self._ephemeral_pool(body) if body.ephemeral else self.pools.get(body.pool)
        want = body.layout
        have = pool.layout_message()
        if want is not None and have != msgspec.structs.replace(
            want, num_pages=want.num_pages or have.num_pages
        ):
            raise LayoutMismatch(f"pool {pool.name!r} has layout {pool.layout}; expected {want}")
        session = self.sessions.open(pool.name, body.namespace, body.pid, body.name, time.monotonic())
        log.info("session %x attached to pool %r (pid %d, %r)", session.id, pool.name, body.pid, body.name)
        return msg.AttachOk(
            session=session.id, epoch=self.epoch, version=msg.PROTOCOL_VERSION, pool=pool.name,
            device=pool.device, layout=have, memory=pool.region.describe(),
            lease_ms=int(self.sessions.lease_s * 1000), max_frame_bytes=self.codec.max_frame_bytes,
            max_batch=self.codec.max_batch, events=self.events_endpoint,
        )  # fmt: skip

    def _ephemeral_pool(self, body: msg.Attach) -> Pool:
        if not self.allow_ephemeral:
            raise Forbidden("this daemon does not create ephemeral pools (--allow-ephemeral)")
        if body.layout is None or body.layout.num_pages == 0:
            raise BadRequest("an ephemeral pool needs a full layout (num_pages > 0)")
        layout = KVLayout(**msgspec.structs.asdict(body.layout))
        return self.pools.open(body.pool, "cpu", layout, ephemeral=True)

    def end_session(self, session: Session) -> None:
        """Detach or lease expiry: free every sequence of the session (ascending ids, each
        as ``free`` would), then close its pool if it was ephemeral and is now unused."""
        pool = self.pools.pools[session.pool]
        for seq in self.sessions.close(session):
            pool.manager.free(seq)
        if pool.ephemeral and self.sessions.on_pool(pool.name) == 0:
            self.sessions.forget_pool(pool.name)
            self.pools.close(pool.name)

    def expire(self, now: float) -> None:
        """End every session whose lease is over."""
        for session in self.sessions.expired(now):
            self.expired += 1
            log.warning(
                "session %x (pid %d) lease expired; freeing %d sequences",
                session.id, session.pid, len(session.seqs),
            )  # fmt: skip
            self.end_session(session)

    # -- queries ---------------------------------------------------------------------

    def _check(self) -> msg.Empty:
        try:
            self.check_integrity()
        except AssertionError as exc:
            raise InternalError(f"integrity check failed: {exc}") from None
        return msg.Empty()

    def check_integrity(self) -> None:
        """Assert every pool's Manager invariants and the session table's ownership."""
        self.pools.check_integrity()
        pools = self.pools.pools
        self.sessions.check_integrity(
            {name: pool.manager.stats().num_sequences for name, pool in pools.items()},
            lambda name, seq: seq in pools[name].manager,
        )

    def _stats(self) -> msg.StatsOk:
        now = time.monotonic()
        pools = []
        for pool in self.pools.pools.values():
            s = pool.manager.stats()
            pools.append(msg.PoolStats(
                name=pool.name, device=pool.device, layout=pool.layout_message(),
                total_pages=s.total_pages, free_pages=s.free_pages,
                evictable_pages=s.evictable_pages, held_pages=s.held_pages,
                cached_pages=s.cached_pages, num_sequences=s.num_sequences,
                query_tokens=s.query_tokens, hit_tokens=s.hit_tokens, evictions=s.evictions,
                num_sessions=self.sessions.on_pool(pool.name), ephemeral=pool.ephemeral,
                event_seq_no=self.pools.last_seq_no(pool.name),
            ))  # fmt: skip
        sessions = [
            msg.SessionStats(
                pool=s.pool, namespace=s.namespace, pid=s.pid, name=s.name,
                num_sequences=len(s.seqs), idle_ms=int((now - s.last_seen) * 1000),
            )
            for s in self.sessions
        ]
        counters = msg.ServerCounters(
            epoch=self.epoch, version=msg.PROTOCOL_VERSION, uptime_s=now - self.started,
            requests=self.requests, errors=self.errors,
            dropped_frames=self.server.dropped_frames if self.server else 0,
            expired_sessions=self.expired,
        )  # fmt: skip
        return msg.StatsOk(pools, sessions, counters)
