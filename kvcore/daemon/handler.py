"""The request handler: one frame in, one frame out, dispatched through the operation table.

Request path (single-threaded, one request at a time, so no Manager needs a lock)::

    frame -> ServerCodec.decode_request -> session (epoch, lease, fence)
          -> tokens carried (a batch: all its ops) -> per op: its work, priced as it runs
          -> ownership, namespace grant, quota -> Operation.serve(Manager)
          -> claim / release, ledger -> encode -> frame

Who sent a frame comes from the transport (:func:`kvcore_ipc.server.peer_of`);
its :class:`~.auth.Grant` is fixed at attach (``stats`` asks per request).

Manager operations come from :data:`kvcore.ops.OPERATIONS` (ownership rule,
work and quota growth and all); this module adds only the session-level
operations (attach, detach, heartbeat, stats, check, snapshot, batch). Every
failure is a typed error reply; a failed operation changed nothing (the
Manager's promise, and ownership changes only after the Manager succeeded).
The session-level operations stay beside the dispatch (a little over ~400
lines): each is a few lines of the same checks the path above runs.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import msgspec
import zmq
from kvcore_ipc import messages as msg
from kvcore_ipc.codec import FrameError, ServerCodec
from kvcore_ipc.server import RouterServer, peer_of

from kvcore.errors import (
    BadRequest,
    Forbidden,
    InternalError,
    KVCoreError,
    LayoutMismatch,
    NotAttached,
    QuotaExceeded,
    StaleEpoch,
    UntrustedEndpoint,
    VersionMismatch,
    error_from_code,
)
from kvcore.layout import KVLayout
from kvcore.ops import OPERATIONS, Operation, operation_of
from kvcore.prefix import KeySpace, root_key

from .auth import Authority
from .metrics import NamespaceUsage, RequestTimer, Snapshot
from .pools import Pool, PoolTable
from .quotas import Holder, Ledger, Limits
from .sessions import Session, SessionTable, State
from .work import WorkBudget, check_carried

log = logging.getLogger("kvcore.daemon")

REFUSALS: tuple[type[KVCoreError], ...] = (
    Forbidden,
    QuotaExceeded,
    UntrustedEndpoint,
    VersionMismatch,
    LayoutMismatch,
)
"""Error replies logged at WARNING (a peer was refused); the others at DEBUG."""


class Handler:
    """Answers request frames against the daemon's pools and sessions; never raises."""

    def __init__(
        self,
        pools: PoolTable,
        sessions: SessionTable,
        codec: ServerCodec,
        *,
        authority: Authority,
        ledger: Ledger,
        server: RouterServer | None = None,
        timer: RequestTimer | None = None,
        ipc: bool = False,
        max_request_tokens: int,
        allow_ephemeral: bool,
        events_endpoint: str,
    ) -> None:
        self.pools = pools
        self.sessions = sessions
        self.codec = codec
        self.authority = authority
        self.ledger = ledger
        self.max_request_tokens = max_request_tokens
        self.epoch = pools.epoch
        self.allow_ephemeral = allow_ephemeral
        self.events_endpoint = events_endpoint
        self.started = time.monotonic()
        self.requests = 0
        self.errors = 0  # error replies and failed ops inside batches
        self.errors_by_code: dict[str, int] = {}  # the same, by error code (metrics)
        self.timer = timer  # latency per op, when metrics are on
        self.server = server  # the socket this handler answers (its frame counters)
        self.ipc = ipc  # the socket is ipc:// (peers have kernel credentials)
        self._holders: dict[int, Holder] = {}  # session id -> its Holder, until it is gone

    def handle(self, frame: bytes, raw: zmq.Frame | None = None) -> bytes:
        """Answer one request frame (``raw``: the received frame, which knows the peer)."""
        self.requests += 1
        try:
            request = self.codec.decode_request(frame)
        except FrameError as exc:
            self._failed(error_from_code(exc.code, exc.message), None)
            return self.codec.encode_error(exc.request_id, exc.code, exc.message)
        except Exception as exc:  # a frame the codec failed to classify: still a bad request
            self._failed(BadRequest(repr(exc)), None)
            return self.codec.encode_error(0, BadRequest.code, f"undecodable request: {exc!r}")
        if self.timer is not None:
            return self._timed(self.timer, request, raw)
        return self._answer(request, raw)

    def _timed(self, timer: RequestTimer, request: msg.Request, raw: zmq.Frame | None) -> bytes:
        start = time.perf_counter()
        reply = self._answer(request, raw)
        timer.observe(type(request.body), time.perf_counter() - start)
        return reply

    def _answer(self, request: msg.Request, raw: zmq.Frame | None) -> bytes:
        try:
            return self.codec.encode_result(request.id, self._dispatch(request, raw))
        except KVCoreError as exc:
            self._failed(exc, request)
            return self.codec.encode_error(request.id, exc.code, str(exc))
        except Exception as exc:  # a bug: report it, keep serving
            self._failed(InternalError(), None)
            log.exception("internal error on %s", type(request.body).__name__)
            return self.codec.encode_error(
                request.id, InternalError.code, f"{type(exc).__name__}: {exc}"
            )

    def _failed(self, error: KVCoreError, request: msg.Request | None) -> None:
        """Count an error reply (or a failed op of a batch) by code; log refusals."""
        code = error.code
        self.errors += 1
        self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1
        level = logging.WARNING if isinstance(error, REFUSALS) else logging.DEBUG
        if request is not None and log.isEnabledFor(level):
            log.log(
                level,
                "session %x: %s refused: %s: %s",
                request.session,
                type(request.body).__name__,
                code,
                error,
            )

    def _dispatch(self, request: msg.Request, raw: zmq.Frame | None) -> msgspec.Struct:
        body = request.body
        op = OPERATIONS.get(type(body))
        if op is not None:  # the hot path: one Manager operation
            session = self._session(request)
            budget = WorkBudget(self.max_request_tokens)  # one op: its work is all it costs
            return self._run(session, self.pools.pools[session.pool], op, body, budget)
        match body:
            case msg.Attach():
                return self._attach(body, raw)
            case msg.GetStats():
                return self._stats(raw)
            case msg.Detach():
                if self.sessions.acknowledge(request.session):
                    return msg.Empty()  # a fenced client unmapped the pool: its pages drain now
        session = self._session(request)
        pool = self.pools.pools[session.pool]
        match body:
            case msg.Batch(ops=items):
                check_carried(items, self.max_request_tokens)  # too heavy whole: nothing runs
                budget = WorkBudget(self.max_request_tokens)
                results: list[Any] = []
                try:
                    for item in items:  # every BatchOp is in the table (kvcore.ops asserts it)
                        results.append(self._run(session, pool, operation_of(item), item, budget))
                except KVCoreError as exc:
                    self._failed(exc, request)
                    return msg.BatchOk(results, msg.ErrorBody(exc.code, str(exc)))
                return msg.BatchOk(results)
            case msg.Heartbeat():
                return msg.Empty()
            case msg.Detach():
                self.sessions.end(session)  # its sequences drain in the next ticks
                log.info(
                    "session %x detached from pool %r (pid %d, %d sequences)",
                    session.id,
                    session.pool,
                    session.pid,
                    len(session.seqs),
                )
                return msg.Empty()
            case msg.Check():
                return self._check()
            case msg.Snapshot():
                if not session.grant.everything:
                    raise Forbidden("a snapshot shows every namespace of the pool")
                return self.pools.snapshot(pool)
        raise BadRequest(f"operation {type(body).__name__} is not allowed here")

    def _session(self, request: msg.Request) -> Session:
        if request.session == 0:
            raise NotAttached("attach first")
        if request.epoch != self.epoch:
            raise StaleEpoch(
                f"epoch {request.epoch:x} is over; this daemon runs epoch {self.epoch:x}"
            )
        return self.sessions.renew(request.session, time.monotonic())

    def _run(
        self, session: Session, pool: Pool, op: Operation[Any, Any], body: Any, budget: WorkBudget
    ) -> msgspec.Struct:
        """One Manager operation under the request's work budget (priced against the books
        as they are now, after the request's earlier ops), the ownership rule of its table
        entry, the session's grant (a per-call namespace) and the pool's quotas."""
        budget.charge(op, body, self.ledger.books(pool.name))
        for name in op.owns:
            self.sessions.check_owner(session, getattr(body, name))
        namespace = getattr(body, "namespace", None)
        if namespace is not None:
            session.grant.check_namespace(namespace)
        holder = self._holders.get(session.id) or self._holder(session)
        self.ledger.check(pool.name, holder, op, body)
        result = op.serve(pool.manager, body, session.namespace)
        if op.creates is not None:
            self.sessions.claim(session, getattr(body, op.creates))
        if op.ends is not None:
            self.sessions.release(session, getattr(body, op.ends))
        self.ledger.apply(pool.name, holder, op, body)
        return result

    def _holder(self, session: Session) -> Holder:
        """What ``session``'s sequences count against, kept until it is gone: its session,
        namespace, tenant (none for the operator) and, for a watched ipc:// peer, its
        process (the kernel's pid)."""
        process = session.pid if session.peer is not None else 0
        holder = Holder(session.id, session.namespace, session.grant.tenant, process)
        self._holders[session.id] = holder
        return holder

    # -- sessions --------------------------------------------------------------------

    def _attach(self, body: msg.Attach, raw: zmq.Frame | None) -> msg.AttachOk:
        if body.version != msg.PROTOCOL_VERSION:
            raise VersionMismatch(
                f"client speaks protocol v{body.version}; this daemon speaks v{msg.PROTOCOL_VERSION}"
            )
        root_key(KeySpace(body.namespace))  # BadRequest if the namespace is over 256 bytes
        peer = peer_of(raw, ipc=self.ipc) if raw is not None else None
        grant = self.authority.grant(peer) if peer is not None else self.authority.local()
        grant.check_pool(body.pool)
        grant.check_namespace(body.namespace)
        if body.ephemeral and grant.tenant:  # its pool would bypass every tenant's quota
            raise Forbidden(
                f"tenant {grant.tenant!r} may not create ephemeral pools (the operator's only)"
            )
        pool = self._ephemeral_pool(body) if body.ephemeral else self.pools.get(body.pool)
        want = body.layout
        have = pool.layout_message()
        if want is not None and have != msgspec.structs.replace(
            want, num_pages=want.num_pages or have.num_pages
        ):
            raise LayoutMismatch(f"pool {pool.name!r} has layout {pool.layout}; expected {want}")
        if body.shards and body.shards != pool.shards:
            raise LayoutMismatch(
                f"pool {pool.name!r} has {pool.shards} shard(s); the client expects "
                f"{body.shards} (one per pipeline stage): "
                f"serve it with --pool ...,shards={body.shards}"
            )
        memory = pool.memory(body.shard)  # BadRequest past the last shard
        pid = peer.pid if peer is not None and peer.pid is not None else body.pid
        watch = peer is not None and peer.pid is not None  # the kernel's pid: safe to watch
        session = self.sessions.open(
            pool.name,
            body.namespace,
            grant,
            pid,
            watch,
            body.name,
            time.monotonic(),
            maps=body.maps,
        )
        log.info(
            "session %x attached to pool %r shard %d (pid %d, %r)",
            session.id,
            pool.name,
            body.shard,
            pid,
            body.name,
        )
        return msg.AttachOk(
            session=session.id,
            epoch=self.epoch,
            version=msg.PROTOCOL_VERSION,
            pool=pool.name,
            device=pool.device,
            layout=have,
            memory=memory,
            lease_ms=int(self.sessions.lease_s * 1000),
            max_frame_bytes=self.codec.max_frame_bytes,
            max_batch=self.codec.max_batch,
            events=self.events_endpoint,
            shard=body.shard,
            shards=pool.shards,
        )

    def _ephemeral_pool(self, body: msg.Attach) -> Pool:
        if not self.allow_ephemeral:
            raise Forbidden("this daemon does not create ephemeral pools (--allow-ephemeral)")
        if body.layout is None or body.layout.num_pages == 0:
            raise BadRequest("an ephemeral pool needs a full layout (num_pages > 0)")
        layout = KVLayout(**msgspec.structs.asdict(body.layout))
        pool = self.pools.open(body.pool, "cpu", layout, ephemeral=True, shards=max(body.shards, 1))
        log.info(
            "ephemeral pool %r opened: %d pages x %d tokens, %d shard(s)",
            pool.name,
            layout.num_pages,
            layout.page_size,
            pool.shards,
        )
        self.ledger.open_pool(pool.name, layout.page_size, Limits(session_sequences=65536))
        return pool

    def expire(self, now: float) -> None:
        """Fence (or drain) every session whose lease is over; drain fenced sessions whose
        process exited."""
        for session in self.sessions.expire(now):
            log.warning(
                "session %x (pid %d): lease over, %s with %d sequences",
                session.id,
                session.pid,
                session.state.value,
                len(session.seqs),
            )

    def reap(self, budget: int) -> None:
        """Free up to about ``budget`` page references of draining sessions (each sequence
        as ``free`` would); remove the sessions left empty and close an ephemeral pool
        that nobody uses any more."""
        for session, seq in self.sessions.reap(budget, self.ledger.pages):
            self.pools.pools[session.pool].manager.free(seq)
            self.ledger.drop(session.pool, seq)
        for session in self.sessions.finished():
            self._holders.pop(session.id, None)
            pool = self.pools.pools[session.pool]
            if pool.ephemeral and self.sessions.on_pool(pool.name) == 0:
                self.sessions.forget_pool(pool.name)
                self.ledger.close_pool(pool.name)
                self.pools.close(pool.name)

    # -- queries ---------------------------------------------------------------------

    def _check(self) -> msg.Empty:
        try:
            self.check_integrity()
        except AssertionError as exc:
            raise InternalError(f"integrity check failed: {exc}") from None
        return msg.Empty()

    def check_integrity(self) -> None:
        """Assert every pool's Manager invariants, the session table's ownership and the
        quota ledger's books."""
        self.pools.check_integrity()
        pools = self.pools.pools
        self.sessions.check_integrity(
            {name: pool.manager.stats().num_sequences for name, pool in pools.items()},
            lambda name, seq: seq in pools[name].manager,
        )
        for name, pool in pools.items():
            self.ledger.check_integrity(name, pool.manager.num_tokens)

    def snapshot(self) -> Snapshot:
        """The operator's stats, errors by code and per-namespace usage (for metrics; the
        loop calls it between requests)."""
        usage: dict[tuple[str, str], list[int]] = {}
        for s in self.sessions:
            held = self.ledger.usage(s.pool, s.id)
            total = usage.setdefault((s.pool, s.namespace), [0, 0])
            total[0] += held.pages
            total[1] += held.sequences
        namespaces = [
            NamespaceUsage(pool, ns, pages, seqs)
            for (pool, ns), (pages, seqs) in sorted(usage.items())
        ]
        eviction = {name: pool.manager.eviction for name, pool in self.pools.pools.items()}
        return Snapshot(self._stats(None), dict(self.errors_by_code), namespaces, eviction)

    def _stats(self, raw: zmq.Frame | None) -> msg.StatsOk:
        """What the peer's grant may see: its pools, and the sessions of its namespaces."""
        authority = self.authority
        grant = (
            authority.grant(peer_of(raw, ipc=self.ipc)) if raw is not None else authority.local()
        )
        now = time.monotonic()
        pools = []
        for pool in self.pools.pools.values():
            if not grant.sees(pool.name):
                continue
            s = pool.manager.stats()
            namespaces, busiest = pool.hit_stats(functools.partial(grant.sees, pool.name))
            pools.append(
                msg.PoolStats(
                    name=pool.name,
                    device=pool.device,
                    layout=pool.layout_message(),
                    total_pages=s.total_pages,
                    free_pages=s.free_pages,
                    evictable_pages=s.evictable_pages,
                    held_pages=s.held_pages,
                    cached_pages=s.cached_pages,
                    num_sequences=s.num_sequences,
                    query_tokens=s.query_tokens,
                    hit_tokens=s.hit_tokens,
                    evictions=s.evictions,
                    withheld_pages=s.withheld_pages,
                    num_sessions=self.sessions.on_pool(pool.name),
                    ephemeral=pool.ephemeral,
                    event_seq_no=self.pools.last_seq_no(pool.name),
                    tiers=pool.tier_stats(),
                    shards=pool.shards,
                    namespaces=namespaces,
                    busiest=busiest,
                )
            )
        sessions = [
            msg.SessionStats(
                pool=s.pool,
                namespace=s.namespace,
                pid=s.pid,
                name=s.name,
                num_sequences=len(s.seqs),
                idle_ms=int((now - s.last_seen) * 1000),
            )
            for s in self.sessions
            if s.state is not State.DRAINING and grant.sees(s.pool, s.namespace)
        ]
        counters = msg.ServerCounters(
            epoch=self.epoch,
            version=msg.PROTOCOL_VERSION,
            uptime_s=now - self.started,
            requests=self.requests,
            errors=self.errors,
            dropped_frames=self.server.dropped_frames if self.server else 0,
            expired_sessions=self.sessions.expired,
        )
        return msg.StatsOk(pools, sessions, counters)
