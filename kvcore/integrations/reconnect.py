"""The one rule for "the daemon is gone" and coming back, shared by every engine integration.

An integration must never fail its engine because the daemon died, restarted or
stalled: while the daemon is gone its calls are misses (the engine recomputes),
and it attaches again later. Three users share this module: the vLLM connector's
link (the scheduler's I/O thread), the vLLM worker (its mapping of the pool) and
the SGLang storage backend. It says, once:

* **which failures mean gone** (:data:`DAEMON_GONE`, :func:`daemon_gone`): the daemon
  did not answer (``Timeout``), restarted (``StaleEpoch``), or ended this session
  (``LeaseLost``, ``NotAttached``). Any other :class:`~kvcore.errors.KVCoreError`
  (out of pages, a quota, a forbidden namespace, too many tokens) is the one call's:
  the daemon is fine.
* **how long to stay quiet** (:class:`Backoff`): ``retry_s`` seconds after the first
  failure, doubled per failure in a row, at most :data:`MAX_RETRY_S`; nothing is
  sent meanwhile. The first call that succeeds resets it. A row that starts with
  ``StaleEpoch`` (a daemon answered: a restarted one, or one stopping for a
  takeover whose successor binds within moments) starts at :data:`SOON_S`
  instead, doubling from there: an engine attaches to the new daemon at once.
* **how to re-attach** (:class:`Reconnector`): once the quiet period is over, the next
  call first attaches again (``Client.reconnect``: a new session, the pool mapped
  afresh); an attach that fails (any :class:`~kvcore.errors.KVCoreError`, or an
  ``OSError`` of the environment: it is never raised into the engine) is one more
  failure in a row. A session known to be over without a failed call (the heartbeat
  found the lease lost; a vLLM worker saw a plan of a newer daemon) attaches again at
  the next call, at once unless quiet. Attaching again acknowledges a lost session
  not yet acknowledged (the daemon frees its pages: ``Client.reconnect``), so a user
  whose page numbers are in use elsewhere (the vLLM scheduler's, in its workers'
  plans) calls :meth:`Reconnector.ready` only once nothing built on them can run
  (:mod:`kvcore.integrations.vllm.link`).

::

    calls ok .. a call fails | quiet retry_s | attach ok -> calls go on (backoff reset)
                                             | attach fails | quiet 2 retry_s | attach ..

What an attachment is (:class:`Attachment`): the daemon's ``epoch`` (one per daemon
start; it names the pools' memory) and the ``session`` id. Sequences live and die with
their session, so state built on one attachment (a sequence id, a page number) means
nothing on another: each user compares attachments, never reads them live mid-step.

Threads: a Reconnector belongs to one thread at a time (the link's thread; the vLLM
worker's; the SGLang backend under its lock). :meth:`Reconnector.quiet` may be read
from any thread (a stale answer costs one miss or one dropped call).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvcore.errors import BatchFailed, KVCoreError, LeaseLost, NotAttached, StaleEpoch, Timeout

log = logging.getLogger("kvcore.reconnect")

DAEMON_GONE: tuple[type[KVCoreError], ...] = (Timeout, StaleEpoch, LeaseLost, NotAttached)
"""Failures that mean the daemon (or this session on it) is gone; any other KVCoreError
is the one call's."""
MAX_RETRY_S = 60.0
"""Seconds: the longest quiet period, however many failures in a row."""
MAX_DOUBLINGS = 32  # 2**32 * any retry_s is past MAX_RETRY_S: no float overflow
SOON_S = 0.05
"""Seconds: the first quiet period of a row that starts with StaleEpoch (at most retry_s)."""


def daemon_gone(exc: BaseException) -> bool:
    """Whether ``exc`` means the daemon is gone (for a BatchFailed: its cause)."""
    if isinstance(exc, BatchFailed):
        return isinstance(exc.error, DAEMON_GONE)
    return isinstance(exc, DAEMON_GONE)


@dataclass(slots=True)
class Backoff:
    """When to call the daemon again after failures; pure (times from ``clock``, in
    seconds). Changed only by its owner's thread (:meth:`failed`, :meth:`succeeded`)."""

    retry_s: float  # the first quiet period, seconds (>= 0)
    max_retry_s: float = MAX_RETRY_S  # the longest, seconds
    clock: Callable[[], float] = time.monotonic
    failures: int = 0  # failures in a row; 0: the daemon answers
    quiet_until: float = 0.0  # clock time before which nothing is sent
    first_s: float = 0.0  # this row's first quiet period: retry_s, or SOON_S (see failed)

    def __post_init__(self) -> None:
        if not 0 <= self.retry_s <= self.max_retry_s:
            raise ValueError(f"retry_s must be in [0, {self.max_retry_s}], got {self.retry_s}")

    @property
    def down(self) -> bool:
        """Whether the last call (or attach) failed: attach again before the next one."""
        return self.failures > 0

    def quiet(self) -> bool:
        """Whether nothing may be sent now (within a quiet period)."""
        return self.clock() < self.quiet_until

    def failed(self, soon: bool = False) -> float:
        """One more failure in a row; the quiet period (seconds) it starts: the row's
        first period (``retry_s``; ``soon``, for the first failure of a row: at most
        SOON_S) doubled per earlier failure in the row, at most ``max_retry_s``."""
        if not self.failures:
            self.first_s = min(self.retry_s, SOON_S) if soon else self.retry_s
        period = min(self.first_s * 2.0 ** min(self.failures, MAX_DOUBLINGS), self.max_retry_s)
        self.failures += 1
        self.quiet_until = self.clock() + period
        return period

    def succeeded(self) -> None:
        """The daemon answered: no quiet period, the next failure waits ``retry_s``."""
        self.failures = 0
        self.quiet_until = 0.0


class Attachable(Protocol):
    """What a Reconnector uses of a :class:`~kvcore.client.Client`."""

    epoch: int
    session: int

    @property
    def lease_lost(self) -> bool: ...

    def reconnect(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Attachment:
    """One session on one daemon: ``epoch`` (the daemon's start; a restarted daemon has
    another, and other pool memory) and ``session`` (a re-attach to the same daemon
    gets another). Sequences and page numbers are valid only on the attachment that
    made them."""

    epoch: int
    session: int

    @classmethod
    def of(cls, client: Attachable) -> Attachment:
        return cls(client.epoch, client.session)


@dataclass(slots=True)
class Reconnector:
    """A client's way back after the daemon is gone (see the module docstring). Before
    each call :meth:`ready`; when a call raises an error of :data:`DAEMON_GONE`,
    :meth:`gone`. ``attachment`` changes only inside :meth:`ready`."""

    client: Attachable
    backoff: Backoff
    what: str  # who reconnects, for the logs ("vLLM scheduler", "SGLang storage")
    attachment: Attachment = field(init=False)
    _stale: bool = field(default=False, init=False)  # attach again at the next ready()

    def __post_init__(self) -> None:
        self.attachment = Attachment.of(self.client)

    @classmethod
    def of(
        cls,
        client: Attachable,
        *,
        retry_s: float,
        what: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> Reconnector:
        return cls(client, Backoff(retry_s, clock=clock), what)

    def quiet(self) -> bool:
        """Whether calls are misses now (the daemon was found gone, the quiet period runs)."""
        return self.backoff.down and self.backoff.quiet()

    def due(self) -> bool:
        """Whether :meth:`ready` would attach again now (which replaces the client's
        mapping: a caller still copying from the old one waits instead)."""
        down = self.backoff.down or self._stale or self.client.lease_lost
        return down and not self.backoff.quiet()

    def ready(self) -> bool:
        """Whether to call the daemon now. False within a quiet period; after it (or
        once the session is known to be over), attach again first: True if that worked
        (``attachment`` is then the new one), False if it failed (a new quiet period;
        ``attachment`` stays the last one that worked, whatever the client holds now).
        Never raises for the daemon's or the environment's failures."""
        if self.client.lease_lost:
            self._stale = True
        if not (self.backoff.down or self._stale):
            return True
        if self.backoff.quiet():
            return False
        try:
            self.client.reconnect()
        except (KVCoreError, OSError) as exc:  # Client maps its own failures to KVCoreError
            self.gone(exc, "attach")
            return False
        self.backoff.succeeded()
        self._stale = False
        self.attachment = Attachment.of(self.client)
        log.info("kvcore: %s attached again (epoch %x)", self.what, self.attachment.epoch)
        return True

    def gone(self, exc: Exception, call: str) -> None:
        """``call`` failed with ``exc`` (one of :data:`DAEMON_GONE`, or an attach that
        failed): quiet for the next period, then attach again."""
        period = self.backoff.failed(soon=isinstance(exc, StaleEpoch))  # a batch's too
        log.warning(
            "kvcore: %s: %s failed (%s: %s); calls are misses for %.3g s, then it attaches again",
            self.what,
            call,
            type(exc).__name__,
            exc,
            period,
        )

    def stale(self) -> None:
        """The session is known to be over though no call failed: attach again at the next
        :meth:`ready` (at once, unless a quiet period runs)."""
        self._stale = True
