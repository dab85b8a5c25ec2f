"""Sessions: leases and sequence ownership, both directions, in one place.

A session is opened by ``attach`` on one pool and lives until ``detach`` or
until its lease runs out (no request for ``lease_s`` seconds: its process
died or stopped heartbeating). Sequence ids are per pool; a sequence belongs
to the session that created it (allocate, or fork for the child), and any
other session that names it gets ``forbidden``.

Invariant (checked by :meth:`SessionTable.check_integrity`)::

    owner[pool][seq] == s.id   <=>   seq in s.seqs and s.pool == pool

Only :meth:`claim`, :meth:`release` and :meth:`close` change ownership, so the
two directions cannot drift apart. The table knows nothing of pages: whoever
closes a session frees the sequences :meth:`close` hands back.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from kvcore.errors import Forbidden, NotAttached


@dataclass(slots=True, eq=False)
class Session:
    """One attached client. ``seqs`` and the lease fields change only through the table."""

    id: int  # random, odd, < 2**63
    pool: str  # the pool's name, fixed at attach
    namespace: str  # default namespace of the session's calls, fixed at attach
    pid: int  # informational (what the client said)
    name: str  # informational
    deadline: float  # time.monotonic() after which the lease is over (seconds)
    last_seen: float  # time.monotonic() of the last request (seconds)
    seqs: set[int] = field(default_factory=set)  # the sequences this session owns


class SessionTable:
    """Every live session, its lease and what it owns."""

    __slots__ = ("_owner", "_sessions", "lease_s")

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s  # seconds without a request before a session expires
        self._sessions: dict[int, Session] = {}
        self._owner: dict[str, dict[int, int]] = {}  # pool -> seq -> session id

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    def open(self, pool: str, namespace: str, pid: int, name: str, now: float) -> Session:
        session = Session(
            secrets.randbits(63) | 1, pool, namespace, pid, name, now + self.lease_s, now
        )
        self._sessions[session.id] = session
        self._owner.setdefault(pool, {})
        return session

    def renew(self, session_id: int, now: float) -> Session:
        """The live session ``session_id`` with its lease renewed; NotAttached if none."""
        session = self._sessions.get(session_id)
        if session is None:
            raise NotAttached(f"no live session {session_id} (detached or lease expired)")
        session.last_seen = now
        session.deadline = now + self.lease_s
        return session

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
        """``seq`` ended (freed by its owner)."""
        del self._owner[session.pool][seq]
        session.seqs.discard(seq)

    def close(self, session: Session) -> list[int]:
        """End ``session``; its sequences, in ascending order, for the caller to free."""
        seqs = sorted(session.seqs)
        owners = self._owner[session.pool]
        for seq in seqs:
            del owners[seq]
        session.seqs.clear()
        del self._sessions[session.id]
        return seqs

    def expired(self, now: float) -> list[Session]:
        """Sessions whose lease is over at ``now``."""
        return [s for s in self._sessions.values() if s.deadline < now]

    def on_pool(self, pool: str) -> int:
        """How many live sessions are attached to ``pool``."""
        return sum(1 for s in self._sessions.values() if s.pool == pool)

    def forget_pool(self, pool: str) -> None:
        """Drop the ownership map of a closed pool (it has no sessions left)."""
        assert not self._owner.get(pool), f"pool {pool!r} closed with owned sequences"
        self._owner.pop(pool, None)

    def check_integrity(
        self, num_live: Mapping[str, int], is_live: Callable[[str, int], bool]
    ) -> None:
        """Assert the ownership invariant, and that the owned sequences of each pool are
        exactly its live ones (``num_live[pool]`` of them; ``is_live(pool, seq)``)."""
        for pool, owners in self._owner.items():
            assert len(owners) == num_live.get(pool, 0), (
                f"pool {pool!r}: {len(owners)} owned sequences, {num_live.get(pool, 0)} live"
            )
            for seq, session_id in owners.items():
                assert is_live(pool, seq), f"owned sequence {seq} is not live in {pool!r}"
                session = self._sessions.get(session_id)
                assert session is not None, f"sequence {seq} owned by a closed session"
                assert session.pool == pool and seq in session.seqs, f"sequence {seq} not in its session"
        for session in self._sessions.values():
            for seq in session.seqs:
                assert self._owner[session.pool].get(seq) == session.id, f"{seq} lost its owner"
