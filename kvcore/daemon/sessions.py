"""Sessions: leases, fencing and sequence ownership, both directions, in one place.

A session is opened by ``attach`` on one pool and goes through three states::

    live --(lease over, process alive)--> fenced --(process exits, client acks,
      |                                     |       or fence timeout)--+
      +--(detach, or lease over and the process is gone)---------------+--> draining --> gone

* **live**: its requests are served; each renews the lease (``lease_s``).
* **fenced**: the lease ran out but its process may still write its pages (a
  stopped or paused client). Its sequences stay live and held, so no page of
  it is reused; every request of it gets ``lease_lost``. It leaves this state
  when the process exits (the daemon watches a pidfd of the kernel-reported
  peer pid), when the client acknowledges (``detach``: it unmapped the pool),
  or, for a peer whose process cannot be watched (tcp://), after
  ``fence_timeout_s``.
* **draining**: its sequences are freed a bounded number of page references
  per tick (:meth:`SessionTable.reap`), so ending a session with 200,000 forks
  never stalls the daemon; then the session is gone. Its requests get
  ``not_attached``.

Lease time counts only while the daemon could hear the client: the daemon
calls :meth:`pause` with the time it was deaf (stopped, or busy in one
request), which pushes every live deadline back, and it reads what is queued
before it expires anyone.

Sequence ids are per pool; a sequence belongs to the session that created it
(allocate, or fork for the child), in any state, and any other session that
names it gets ``forbidden``. Invariant (checked by :meth:`check_integrity`)::

    owner[pool][seq] == s.id   <=>   seq in s.seqs and s.pool == pool

Only :meth:`claim`, :meth:`release` and :meth:`reap` change ownership, so the
two directions cannot drift apart. The table knows nothing of pages: whoever
reaps frees the sequences :meth:`reap` hands back.
"""

from __future__ import annotations

import contextlib
import enum
import os
import secrets
import select
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from kvcore.errors import Forbidden, LeaseLost, NotAttached, QuotaExceeded

from .auth import Grant


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
    pidfd: int | None = None  # a pidfd of the client process, if the daemon can watch it
    state: State = State.LIVE
    fenced_until: float = 0.0  # fenced without a pidfd: released at this time (seconds)
    seqs: set[int] = field(default_factory=set)  # the sequences this session owns


class SessionTable:
    """Every session, its lease, its state and what it owns."""

    __slots__ = ("_owner", "_sessions", "expired", "fence_s", "fenced", "lease_s", "max_sessions")

    def __init__(self, lease_s: float, fence_s: float = 300.0, max_sessions: int = 1024) -> None:
        self.lease_s = lease_s  # seconds without a request before a session expires
        self.fence_s = fence_s  # seconds an unwatchable expired session stays fenced
        self.max_sessions = max_sessions
        self.expired = 0  # sessions whose lease ran out (counters for stats and tests)
        self.fenced = 0  # of those, sessions fenced because their process lived
        self._sessions: dict[int, Session] = {}
        self._owner: dict[str, dict[int, int]] = {}  # pool -> seq -> session id

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    def open(
        self, pool: str, namespace: str, grant: Grant, pid: int, watch: bool, name: str, now: float
    ) -> Session:
        """A new live session; QuotaExceeded past ``max_sessions``. With ``watch`` the
        process ``pid`` (the kernel's peer pid) is watched through a pidfd."""
        if len(self._sessions) >= self.max_sessions:
            raise QuotaExceeded(f"the daemon serves at most {self.max_sessions} sessions")
        pidfd = None
        if watch:
            with contextlib.suppress(OSError, AttributeError):  # gone already, or no pidfd here
                pidfd = os.pidfd_open(pid)
        session = Session(
            secrets.randbits(63) | 1,
            pool,
            namespace,
            grant,
            pid,
            name,
            now + self.lease_s,
            now,
            pidfd,
        )
        self._sessions[session.id] = session
        self._owner.setdefault(pool, {})
        return session

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
        """The daemon could not hear anyone for ``seconds``: that time is no one's lease."""
        for session in self._sessions.values():
            if session.state is State.LIVE:
                session.deadline += seconds

    def expire(self, now: float) -> list[Session]:
        """Move live sessions whose lease is over to fenced (process alive or unknown) or
        draining (process gone); fenced ones whose process exited, or whose fence timed
        out, to draining. The sessions that changed state."""
        changed = []
        for session in self._sessions.values():
            if session.state is State.LIVE and session.deadline < now:
                self.expired += 1
                if session.pidfd is not None and _exited(session.pidfd):
                    self._drain(session)
                else:
                    session.state = State.FENCED
                    session.fenced_until = now + self.fence_s
                    self.fenced += 1
                changed.append(session)
            elif session.state is State.FENCED and (
                _exited(session.pidfd) if session.pidfd is not None else now >= session.fenced_until
            ):
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
        for session in [s for s in self._sessions.values() if s.state is State.DRAINING]:
            for seq in sorted(session.seqs):
                if spent >= budget:
                    return
                spent += 1 + cost(session.pool, seq)
                self.release(session, seq)
                yield session, seq

    def finished(self) -> list[Session]:
        """Remove draining sessions that hold nothing any more; they are returned."""
        done = [s for s in self._sessions.values() if s.state is State.DRAINING and not s.seqs]
        for session in done:
            del self._sessions[session.id]
            if session.pidfd is not None:
                os.close(session.pidfd)
                session.pidfd = None
        return done

    def draining(self) -> bool:
        return any(s.state is State.DRAINING for s in self._sessions.values())

    def _drain(self, session: Session) -> None:
        session.state = State.DRAINING

    # -- queries -------------------------------------------------------------------------

    def on_pool(self, pool: str) -> int:
        """How many sessions (in any state) are on ``pool``."""
        return sum(1 for s in self._sessions.values() if s.pool == pool)

    def forget_pool(self, pool: str) -> None:
        """Drop the ownership map of a closed pool (it has no sessions left)."""
        assert not self._owner.get(pool), f"pool {pool!r} closed with owned sequences"
        self._owner.pop(pool, None)

    def close_all(self) -> None:
        for session in self._sessions.values():
            if session.pidfd is not None:
                os.close(session.pidfd)
                session.pidfd = None

    def check_integrity(
        self, num_live: Mapping[str, int], is_live: Callable[[str, int], bool]
    ) -> None:
        """Assert the ownership invariant, and that the owned sequences of each pool are
        exactly its live ones (``num_live[pool]`` of them; ``is_live(pool, seq)``): the
        sequences of fenced and draining sessions are held, never free."""
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
        for session in self._sessions.values():
            assert (
                session.state is not State.FENCED
                or session.pidfd is not None
                or (session.fenced_until > 0)
            ), f"session {session.id:x} fenced without a way out"
            for seq in session.seqs:
                assert self._owner[session.pool].get(seq) == session.id, f"{seq} lost its owner"


def _exited(pidfd: int) -> bool:
    """True once the process of ``pidfd`` has exited (a pidfd polls readable then)."""
    ready, _, _ = select.select([pidfd], [], [], 0)
    return bool(ready)
