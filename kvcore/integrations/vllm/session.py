"""The scheduler side's session on the daemon: one typed state, every transition here.

The scheduler side holds every request's sequence on one session of the daemon, its
*attachment* (:class:`~kvcore.integrations.reconnect.Attachment`: the daemon's epoch
and the session id). Sequences and page numbers mean something only on the
attachment that made them, so the session's :class:`Life` decides what the
scheduler side may do: ask and plan copies (ATTACHED only), take the link's answers
(those of its attachment, while ATTACHED), and when the link may attach again::

    life       event (from)                                       to
    ATTACHED   Lost of this attachment (the link: the lease ran   DRAINING; RETIRED at once
               out, the daemon alive; records dropped)            if no copy is unreported
    DRAINING   the worker reports a step >= ``drain_step`` (it    RETIRED: Retire sent
               runs plans in order: every earlier one ran too)
    any        Reconnected (the link attached again; records      ATTACHED on the new one
               dropped; the link posts it after a loss only once
               retired, :mod:`.link`)
    any        Lost of another attachment, or of this one again   unchanged

A session lost with the daemon alive (its lease ran out: the epoch is the same, so
the worker, whose own session is fine, would run any plan on it) leaves plans built
before the loss that may still run in the worker. The session's pages stay fenced on
the daemon (the link's client does not acknowledge the loss) until this side sends
:class:`~.link.Retire`, once the worker reported the last plan with a copy built
before the loss (``drain_step``); the link attaches again only then, which frees
them (:mod:`.link`). Nothing is asked or planned on a session not ATTACHED.

Steps (:attr:`Session.step`) count the plans this side built, over every session
(never reset), so a report's steps compare across sessions: a late report of a plan
built on an older session still counts towards draining.

The retiring ledger (:attr:`Session.retiring`): a sequence dropped from its request
while plans with copies of it are in flight (an answer that did not fit its record,
:mod:`.book`) is freed once its last one is reported. The ledger is of this
attachment only: a loss or a re-attach clears it (the sequences died with the
session), and a report of an older epoch's ticket never matches it.

The session is pure: transitions queue the ops they imply (:class:`~.link.Free`,
:class:`~.link.Retire`) and the scheduler side sends them (:meth:`Session.take_ops`).
Changed only by the scheduler side's thread; :meth:`Session.check_integrity` states
the invariants (tests/test_vllm_session.py drives it against a model).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcore.integrations.reconnect import Attachment
from kvcore.integrations.vllm.link import Free, Retire

if TYPE_CHECKING:
    from kvcore.integrations.vllm.metadata import Ticket


class Life(enum.Enum):
    """Where the scheduler side's session stands (module docstring: the transitions)."""

    ATTACHED = "attached"  # records, asks and copies on ``attachment``
    DRAINING = "draining"  # lost: plans with copies on it may still run; nothing new
    RETIRED = "retired"  # lost and drained: Retire sent; waiting for the link's Reconnected


@dataclass(slots=True)
class Session:
    """The session's one state. Every field is changed only by the transitions below
    (the scheduler side's thread); steps count plans, never tokens or pages."""

    attachment: Attachment  # of the records and plans; changed only by reattach()
    life: Life = Life.ATTACHED
    step: int = 0  # the last plan built (every session's: never reset)
    copy_step: int = 0  # the last plan with a copy (a load or a save)
    reported_step: int = 0  # the highest step the worker reported run
    drain_step: int = 0  # lost: the last plan with a copy built before the loss; else 0
    retiring: dict[Ticket, int] = field(default_factory=dict)  # dropped sequence -> its
    # plans in flight (> 0), of ``attachment`` only
    _ops: list[Free | Retire] = field(default_factory=list)  # to send: take_ops()

    # -- questions ---------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        """Whether requests may be asked about and copies planned on the session."""
        return self.life is Life.ATTACHED

    def holds(self, attachment: Attachment) -> bool:
        """Whether the link's records of ``attachment`` are about this side's state (its
        attachment, not lost); any other's name sequences that are gone."""
        return self.life is Life.ATTACHED and attachment == self.attachment

    # -- transitions -------------------------------------------------------------------

    def planned(self, copies: bool) -> int:
        """A plan was built (with a load or a save if ``copies``); its step."""
        assert not copies or self.life is Life.ATTACHED, f"a copy planned on {self}"
        self.step += 1
        if copies:
            self.copy_step = self.step
        return self.step

    def steps_reported(self, steps: Iterable[int]) -> None:
        """The worker ran ``steps`` (in any order, late ones included); a lost session
        whose last copy is among them or before them is retired."""
        self.reported_step = max(self.reported_step, *steps, 0)
        self._retire_if_drained()

    def ticket_reported(self, ticket: Ticket) -> None:
        """A plan's ``ticket`` whose request no longer holds it was reported: a dropped
        sequence is freed after its last plan; any other ticket (finished, an older
        session's) is no concern of the session."""
        left = self.retiring.pop(ticket, 0) - 1
        if left > 0:
            self.retiring[ticket] = left
        elif left == 0:
            self._ops.append(Free(self.attachment, ticket.seq))

    def drop(self, ticket: Ticket, in_flight: int) -> None:
        """The sequence of ``ticket`` left its request with ``in_flight`` plans not yet
        reported: freed now if none, else after the last (:meth:`ticket_reported`)."""
        assert self.life is Life.ATTACHED and ticket.epoch == self.attachment.epoch, ticket
        assert ticket not in self.retiring and in_flight >= 0, (ticket, in_flight)
        if in_flight:
            self.retiring[ticket] = in_flight
        else:
            self._ops.append(Free(self.attachment, ticket.seq))

    def lose(self, attachment: Attachment) -> bool:
        """The link posted ``attachment`` lost. True if that ends this session now (the
        caller drops every record): ATTACHED -> DRAINING, or RETIRED at once when no
        plan with a copy is unreported."""
        if not self.holds(attachment):
            return False
        self.life = Life.DRAINING
        self.drain_step = self.copy_step
        self.retiring.clear()  # the sequences died with the session
        self._retire_if_drained()
        return True

    def reattach(self, attachment: Attachment) -> None:
        """The link attached again (any life -> ATTACHED): a new session, nothing of the
        old one held (the caller drops every record)."""
        self.attachment = attachment
        self.life = Life.ATTACHED
        self.drain_step = 0
        self.retiring.clear()

    def close(self) -> None:
        """The scheduler side shuts down: every dropped sequence is freed now."""
        self._ops += [Free(self.attachment, ticket.seq) for ticket in self.retiring]
        self.retiring.clear()

    def take_ops(self) -> list[Free | Retire]:
        """The ops the transitions since the last call imply, in order (to send)."""
        ops, self._ops = self._ops, []
        return ops

    def check_integrity(self) -> None:
        """The session's invariants (AssertionError naming the broken one)."""
        assert 0 <= self.drain_step <= self.copy_step <= self.step, self
        assert 0 <= self.reported_step <= self.step, self  # reports name plans built
        if self.life is Life.ATTACHED:
            assert self.drain_step == 0, self
            for ticket, in_flight in self.retiring.items():
                assert in_flight > 0 and ticket.epoch == self.attachment.epoch, self
            return
        assert not self.retiring, self  # a lost session's sequences are gone
        assert self.copy_step == self.drain_step, self  # no copy planned since the loss
        drained = self.reported_step >= self.drain_step
        assert drained == (self.life is Life.RETIRED), self  # retired as soon as drained

    def _retire_if_drained(self) -> None:
        """DRAINING -> RETIRED once the worker reported the last plan with a copy built
        before the loss (plans run in order: every earlier one ran too)."""
        if self.life is Life.DRAINING and self.reported_step >= self.drain_step:
            self.life = Life.RETIRED
            self._ops.append(Retire(self.attachment))
