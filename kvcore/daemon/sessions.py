"""Sessions: leases, fencing and sequence ownership, both directions, in one place.

A session is opened by ``attach`` on one pool and goes through three states::

    live --(lease over, process alive)--> fenced --(process exits, client acks,
      |                                     |       or fence timeout)--+
      +--(detach, or lease over and the process is gone)---------------+--> draining --> gone

* **live**: its requests are served; each renews the lease (``lease_s``).
* **fenced**: the lease ran out but its process may still write its pages (a
  stopped or paused client). Its sequences stay live and held, so no page of
  it is reused; every request of it gets ``lease_lost``. It leaves this state
  when the process exits (the daemon watches the kernel-reported peer pid:
  :mod:`.watch`), when the client acknowledges (``detach``: it unmapped the
  pool), or after ``fence_timeout_s`` of listening time, whether or not its
  process can be watched: a process that maps a pool can write all of it
  anyway (docs/security.md), so fencing protects a paused honest client for a
  bounded time, and no silent process keeps sessions or pages for longer.
* **draining**: its sequences are freed a bounded number of page references
  per call of :meth:`SessionTable.reap` (O(1) per sequence), which the daemon
  repeats while nothing is queued (kvcore/daemon/daemon.py), so ending a
  session with 200,000 forks never stalls the daemon and is freed about as
  fast as the forks were made; then the session is gone. Its requests get
  ``not_attached``.

Lease and fence time count only while the daemon could hear the client: the
daemon calls :meth:`pause` with the time it was deaf (stopped, or busy in one
request), which pushes every live deadline and every fence's end back, and it
reads what is queued before it expires anyone.

What one client may hold is bounded three ways, sessions in any state counted
(each is a slot of the table until it is gone): ``max_sessions`` in all,
``max_sessions_per_process`` per watched peer process (its sessions share one
pidfd, so the descriptors the daemon holds are at most one per process), and
``max_sessions_per_tenant`` per tenant (the grant's ``tenant``; the operator, who
is the daemon's own user or root, is bounded per process only). By default
an eighth of ``max_sessions`` (rounded down) is kept from any one tenant or
process, and a process holds at most 64.

Sequence ids are per pool; a sequence belongs to the session that created it
(allocate, or fork for the child), in any state, and any other session that
names it gets ``forbidden``. Invariant (checked by :meth:`check_integrity`)::

    owner[pool][seq] == s.id   <=>   seq in s.seqs and s.pool == pool

Only :meth:`claim`, :meth:`release` and :meth:`reap` change ownership, so the
two directions cannot drift apart. The table knows nothing of pages: whoever
reaps frees the sequences :meth:`reap` hands back.
"""

from __future__ import annotations

import enum
import secrets
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from kvcore.errors import BadRequest, Forbidden, LeaseLost, NotAttached, QuotaExceeded

from .auth import Grant
from .watch import Watch, Watcher

PROCESS_SESSIONS = 64  # default bound of sessions per peer process (also <= the tenant bound)


class State(enum.Enum):
    LIVE = "live"
    FENCED = "fenced"
    DRAINING = "draining"


@dataclass(slots=True, eq=False)
class Session:
    """One attached client. ``seqs``, ``state`` and the lease fields change only through
    the table."""

    id: int  # random, odd, < 2**63
    pool: str  # the pool's name, fixed at attach
    namespace: str  # default namespace of the session's calls, fixed at attach
    grant: Grant  # what its credentials allow, fixed at attach
    pid: int  # the kernel's peer pid on ipc://, else what the client said (informational)
    name: str  # informational
    deadline: float  # time.monotonic() after which the lease is over (seconds)
    last_seen: float  # time.monotonic() of the last request (seconds)
    peer: Watch | None = None  # the watch of its process: only for a kernel-reported pid
    maps: bool = False  # it said it maps the pool's memory (Attach.maps)
    mapped: bool = False  # maps, and a request came after the attach: it has mapped by now
    state: State = State.LIVE
    fenced_until: float = 0.0  # fenced: drained at this time.monotonic() (seconds)
    seqs: set[int] = field(default_factory=set)  # the sequences this session owns


class SessionTable:
    """Every session, its lease, its state and what it owns."""

    __slots__ = (
        "_draining",
        "_owner",
        "_sessions",
        "_tenants",
        "_watcher",
        "expired",
        "fence_s",
        "fenced",
        "lease_s",
        "max_sessions",
        "max_sessions_per_process",
        "max_sessions_per_tenant",
    )

    def __init__(
        self,
        lease_s: float,
        fence_s: float = 300.0,
        max_sessions: int = 1024,
        *,
        max_sessions_per_process: int | None = None,
        max_sessions_per_tenant: int | None = None,
    ) -> None:
        """Bounds are session counts; ``None`` takes the default (module docstring).
        BadRequest unless ``1 <= max_sessions_per_process, max_sessions_per_tenant <=
        max_sessions``."""
        self.lease_s = lease_s  # seconds without a request before a session expires
        self.fence_s = fence_s  # seconds of listening time an expired session stays fenced
        self.max_sessions = max_sessions  # sessions in the table, daemon-wide
        if max_sessions_per_tenant is None:
            max_sessions_per_tenant = max_sessions - max_sessions // 8
        if max_sessions_per_process is None:
            max_sessions_per_process = min(PROCESS_SESSIONS, max_sessions_per_tenant)
        self.max_sessions_per_tenant = max_sessions_per_tenant  # per named tenant
        self.max_sessions_per_process = max_sessions_per_process  # per watched peer process
        if not (
            1 <= self.max_sessions_per_process <= max_sessions
            and 1 <= self.max_sessions_per_tenant <= max_sessions
        ):
            raise BadRequest(
                f"need 1 <= max_sessions_per_process, max_sessions_per_tenant <= max_sessions "
                f"({max_sessions}); got {max_sessions_per_process}, {max_sessions_per_tenant}"
            )
        self.expired = 0  # sessions whose lease ran out (counters for stats and tests)
        self.fenced = 0  # of those, sessions fenced because their process lived
        self._sessions: dict[int, Session] = {}
        self._draining: dict[int, Session] = {}  # the DRAINING ones, oldest first (O(1) asks)
        self._owner: dict[str, dict[int, int]] = {}  # pool -> seq -> session id
        self._tenants: dict[str, int] = {}  # named tenant -> its sessions, in any state
        self._watcher = Watcher()  # the processes of ipc:// peers, one pidfd each

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    def open(
        self,
        pool: str,
        namespace: str,
        grant: Grant,
        pid: int,
        watch: bool,
        name: str,
        now: float,
        *,
        maps: bool = False,
    ) -> Session:
        """A new live session (``maps``: it said it maps the pool's memory); QuotaExceeded
        past ``max_sessions``, past ``max_sessions_per_process`` of process ``pid`` if
        ``watch`` (``pid`` is the kernel's peer pid: the process is watched, sharing one
        pidfd with its other sessions), or past ``max_sessions_per_tenant`` of the
        grant's tenant (not the operator)."""
        if len(self._sessions) >= self.max_sessions:
            raise QuotaExceeded(f"the daemon serves at most {self.max_sessions} sessions")
        if watch and self._watcher.held(pid) >= self.max_sessions_per_process:
            raise QuotaExceeded(
                f"process {pid} holds {self._watcher.held(pid)} sessions; a process may hold "
                f"at most {self.max_sessions_per_process} (max_sessions_per_process)"
            )
        tenant = grant.tenant
        if tenant and self._tenants.get(tenant, 0) >= self.max_sessions_per_tenant:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds {self._tenants[tenant]} sessions; a tenant may hold "
                f"at most {self.max_sessions_per_tenant} (max_sessions_per_tenant)"
            )
        peer = self._watcher.watch(pid) if watch else None
        if tenant:
            self._tenants[tenant] = self._tenants.get(tenant, 0) + 1
        session = Session(
            secrets.randbits(63) | 1,
            pool,
            namespace,
            grant,
            pid,
            name,
            now + self.lease_s,
            now,
            peer,
            maps=maps,
        )
        self._sessions[session.id] = session
        self._owner.setdefault(pool, {})
        return session

    def mappers(self, pool: str) -> Counter[int]:
        """Per process (the kernel's pid), how many of its sessions on ``pool`` have mapped
        its memory: what may account for that process's mappings of the pool
        (kvcore.daemon.mappings). A session counts once it said it maps and sent a
        request after its attach (a client maps between the two: until then an old
        mapping of its process could pass for its own). Sessions of a pid the kernel
        did not report count for no process."""
        return Counter(
            s.pid
            for s in self._sessions.values()
            if s.pool == pool and s.mapped and s.peer is not None
        )

    def renew(self, session_id: int, now: float) -> Session:
        """The live session ``session_id`` with its lease renewed; LeaseLost if it is
        fenced, NotAttached if it ended or is ending."""
        session = self._sessions.get(session_id)
        if session is None or session.state is State.DRAINING:
            raise NotAttached(f"no live session {session_id} (detached or lease expired)")
        if session.state is State.FENCED:
            raise LeaseLost(
                "the lease ran out (the client was silent for longer than the lease); its "
                "pages are fenced until it unmaps the pool and detaches, or exits"
            )
        session.last_seen = now
        session.deadline = now + self.lease_s
        session.mapped = session.maps
        return session

    def acknowledge(self, session_id: int) -> bool:
        """A fenced session's client unmapped the pool and detached: drain it. False if
        ``session_id`` is not fenced."""
        session = self._sessions.get(session_id)
        if session is None or session.state is not State.FENCED:
            return False
        self._drain(session)
        return True

    def end(self, session: Session) -> None:
        """Detach: the session's sequences are freed by :meth:`reap`."""
        self._drain(session)

    def check_owner(self, session: Session, seq: int) -> None:
        """Forbidden if ``seq`` belongs to another session (an unowned id is the Manager's
        to judge: unknown_sequence)."""
        owner = self._owner[session.pool].get(seq)
        if owner is not None and owner != session.id:
            raise Forbidden(f"sequence {seq} belongs to another session")

    def claim(self, session: Session, seq: int) -> None:
        """``session`` created ``seq``."""
        self._owner[session.pool][seq] = session.id
        session.seqs.add(seq)

    def release(self, session: Session, seq: int) -> None:
        """``seq`` ended (freed by its owner, or reaped)."""
        del self._owner[session.pool][seq]
        session.seqs.discard(seq)

    # -- time ----------------------------------------------------------------------------

    def pause(self, seconds: float) -> None:
        """The daemon could not hear anyone for ``seconds``: that time is no one's lease,
        nor counts towards anyone's fence."""
        for session in self._sessions.values():
            if session.state is State.LIVE:
                session.deadline += seconds
            elif session.state is State.FENCED:
                session.fenced_until += seconds

    def expire(self, now: float) -> list[Session]:
        """Move live sessions whose lease is over to fenced (process alive or unknown) or
        draining (process gone); fenced ones whose process exited, or whose fence timed
        out (watched or not), to draining. The sessions that changed state."""
        self._watcher.poll()
        changed = []
        for session in self._sessions.values():
            gone = session.peer is not None and session.peer.exited
            if session.state is State.LIVE and session.deadline < now:
                self.expired += 1
                if gone:
                    self._drain(session)
                else:
                    session.state = State.FENCED
                    session.fenced_until = now + self.fence_s
                    self.fenced += 1
                changed.append(session)
            elif session.state is State.FENCED and (gone or now >= session.fenced_until):
                self._drain(session)
                changed.append(session)
        return changed

    def reap(self, budget: int, cost: Callable[[str, int], int]) -> Iterator[tuple[Session, int]]:
        """Release sequences of draining sessions, at most about ``budget`` cost units
        (``cost(pool, seq)``: its page references) per call; yields (session, seq) for the
        caller to free, after the sequence left the table. A draining session with nothing
        left is removed; the caller sees it as ``not seqs`` on its last yield or in
        :meth:`finished`."""
        spent = 0
        for session in list(self._draining.values()):
            owners = self._owner[session.pool]
            seqs = session.seqs
            while seqs:  # pop(): O(1) a sequence, where sorting them was O(n log n) a call
                if spent >= budget:
                    return
                seq = seqs.pop()
                del owners[seq]
                spent += 1 + cost(session.pool, seq)
                yield session, seq

    def finished(self) -> list[Session]:
        """Remove draining sessions that hold nothing any more; they are returned."""
        done = [s for s in self._draining.values() if not s.seqs]
        for session in done:
            del self._sessions[session.id]
            del self._draining[session.id]
            if session.peer is not None:
                self._watcher.release(session.peer)
                session.peer = None
            tenant = session.grant.tenant
            if tenant:
                self._tenants[tenant] -= 1
                if not self._tenants[tenant]:
                    del self._tenants[tenant]
        return done

    def draining(self) -> bool:
        """Whether a session is draining (asked every loop turn: O(1))."""
        return bool(self._draining)

    def _drain(self, session: Session) -> None:
        session.state = State.DRAINING
        self._draining[session.id] = session

    # -- queries -------------------------------------------------------------------------

    def on_pool(self, pool: str) -> int:
        """How many sessions (in any state) are on ``pool``."""
        return sum(1 for s in self._sessions.values() if s.pool == pool)

    def forget_pool(self, pool: str) -> None:
        """Drop the ownership map of a closed pool (it has no sessions left)."""
        assert not self._owner.get(pool), f"pool {pool!r} closed with owned sequences"
        self._owner.pop(pool, None)

    def on_process(self, pid: int) -> int:
        """How many sessions (in any state) the live watched process ``pid`` holds."""
        return self._watcher.held(pid)

    @property
    def descriptors(self) -> int:
        """How many pidfds the table holds open (at most one per watched process)."""
        return self._watcher.descriptors

    def close_all(self) -> None:
        """Close every pidfd (the daemon stops; the sessions are not used any more)."""
        self._watcher.close_all()

    def check_integrity(
        self, num_live: Mapping[str, int], is_live: Callable[[str, int], bool]
    ) -> None:
        """Assert the ownership invariant, and that the owned sequences of each pool are
        exactly its live ones (``num_live[pool]`` of them; ``is_live(pool, seq)``): the
        sequences of fenced and draining sessions are held, never free. Every watched
        process's refcount equals the sessions that name it, and every bound holds."""
        for pool, owners in self._owner.items():
            assert len(owners) == num_live.get(pool, 0), (
                f"pool {pool!r}: {len(owners)} owned sequences, {num_live.get(pool, 0)} live"
            )
            for seq, session_id in owners.items():
                assert is_live(pool, seq), f"owned sequence {seq} is not live in {pool!r}"
                session = self._sessions.get(session_id)
                assert session is not None, f"sequence {seq} owned by a closed session"
                assert session.pool == pool and seq in session.seqs, (
                    f"sequence {seq} not in its session"
                )
        assert len(self._sessions) <= self.max_sessions, "more sessions than allowed"
        peers = Counter(s.peer for s in self._sessions.values() if s.peer is not None)
        self._watcher.check_integrity(peers)
        assert all(n <= self.max_sessions_per_process for n in peers.values()), (
            "a process holds more sessions than allowed"
        )
        tenants = Counter(s.grant.tenant for s in self._sessions.values() if s.grant.tenant)
        assert tenants == self._tenants, f"tenant counts {self._tenants}, sessions {tenants}"
        assert all(n <= self.max_sessions_per_tenant for n in tenants.values()), (
            "a tenant holds more sessions than allowed"
        )
        draining = {s.id for s in self._sessions.values() if s.state is State.DRAINING}
        assert draining == self._draining.keys(), "the draining index lost a session"
        for session in self._sessions.values():
            assert session.state is not State.FENCED or session.fenced_until > 0, (
                f"session {session.id:x} fenced without an end"
            )
            for seq in session.seqs:
                assert self._owner[session.pool].get(seq) == session.id, f"{seq} lost its owner"
